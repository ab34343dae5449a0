"""The one decoder and what describes it: config (both spellings) and its checks, the family table, MoE, the ops seam.

model_config.py (config.json -> ModelConfig; the table of families), config_checks.py / config_moe.py (the
keys' checks), decoder.py (the decoder, its pieces and its output), moe.py (the mixture-of-experts block),
ops.py (the seam through which a backend chooses how projections and attention are computed), hooks.py
(whether module hooks are set), pretrained.py (a model from a checkpoint folder, and back), gguf_loading.py (a model from a GGUF file), quantization.py
(weight-only int8/fp8: the config, the quantized linear, quantising a model) and quantized_values.py (its numbers).
The model knows nothing of devices, compilation or parallelism.

May import: checkpoints, utils.
"""
