"""LoRA adapters in PEFT's format, applied to a built model from outside.

lora_config.py (`LoraConfig`, PEFT's names and defaults), lora.py (the layers: add, merge, enable),
files.py (`adapter_config.json` + `adapter_model.safetensors` in and out), bank.py (several adapters in one
batch: stacked weights and a per-row index, shapes fixed), bank_registry.py (which bank a model has: a
weak map keyed by the model).

May import: models, checkpoints, utils.
"""
