"""Checkpoint files: where they are (a folder or the Hub) and how tensors and names are read and written.

hub.py (local folder or Hub id through huggingface_hub), json_files.py (config and tokenizer JSON with one
error), safetensors_io.py (plain reads into the tensors that keep the data), weights_writer.py (shards and
their index, atomically), names.py (each family's checkpoint-name adapter: Hub tensor names <-> parameters),
compressed_tensors.py (compressed-tensors' 8-bit weight-only quantization_config and packing), gguf_file.py
(a GGUF file's metadata and dequantised tensors), gguf_config.py (its config.json), gguf_names.py (its tensor names).
Nothing here knows the model: `models/pretrained.py` builds one from these files.

May import: utils.
"""
