"""The one compile path, device-neutral: compiled functions, graph counting, strict shapes, the on-disk cache.

compiler.py (compile one function under its own code objects, count its graphs, the persistent caches,
strict-shape violations), regions.py (per-layer regions built from the model's pieces, for generation, the
Trainer and FSDP2's blocks), steps.py (the whole-model prefill and decode step functions every device can run),
summary.py (how many graphs were compiled and how many the caches answered), cache_safety.py (which cache
files may be unpickled). Which compile backend and options a device gets is the device's backend's answer
(`backends/`), handed in by the caller.

May import: adapters, models, checkpoints, utils.
"""
