"""The transformers-named surface: `AutoModelForCausalLM`, `model.generate()`, `pipeline()`.

auto.py (the model class `from_pretrained` returns: loading, saving, adapters, distributed loading),
generate.py (transformers' `generate` arguments over the generation loop), pipeline.py
(`pipeline("text-generation", ...)`), quantization.py (quantizing at load or a built model, the device's fp8 check).

May import: generation, training, distributed, backends, compilation, adapters, tokenization, models,
checkpoints, utils; never serving or commands.
"""
