"""Generation over a declared shape plan: the plan, the engine's compiled steps, the one loop over slots.

plan.py (every shape, decided before the first request), engine.py (the steps per shape and the static
caches; it calls the device's backend through device_interface.py), engines.py (each model's engine, and a call's
compile settings), loop.py (requests join and leave a batch of slots between decode steps), step_plan.py (a step as
plain data, and its result), runner.py (runs a step: inputs, the engine's step, masks, sampling), sampling.py (per-row logits processors and draws on the device),
streamers.py (text out as tokens arrive), generation_config.py (GenerationConfig, CompileConfig),
chunking.py (a prompt in chunks, in steps that also decode the running rows), prefix_cache.py (prompt prefixes kept on the device).

May import: backends, compilation, adapters, models, checkpoints, utils; never training (the two are
independent), api, serving or commands.
"""
