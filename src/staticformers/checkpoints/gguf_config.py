"""A GGUF file's metadata turned into the config.json a Hugging Face checkpoint of that model would carry.

Why this exists: a GGUF names its architecture (`general.architecture`) and spells the config under
GGUF's own keys (`llama.block_count`, ...). We rebuild transformers' config dict from them, as transformers'
GGUF loader does (its `GGUF_CONFIG_MAPPING`), for the architectures whose families we run; anything else is
refused in one sentence. `models/model_config.py` then checks the dict as it checks any config.json.
"""

from __future__ import annotations

from .gguf_file import GGUFError, GGUFFile

# GGUF architecture -> the transformers class we build for it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",      # Llama 2/3, SmolLM, and Mistral (GGUF converters write Mistral as llama)
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# GGUF's key (after "<arch>.") -> config.json's key
_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# per architecture: which key gives head_dim (transformers reads llama's rope.dimension_count, qwen3's key_length)
_HEAD_DIM = {"llama": "rope.dimension_count", "qwen3": "attention.key_length"}


def check_architecture(f: GGUFFile) -> str:
    """The GGUF architecture, refused in one sentence when we run no family for it."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{f.path} holds a {arch!r} model (general.architecture), which staticformers does not load from GGUF "
            f"(it loads {', '.join(sorted(ARCHITECTURES))}): use the model's safetensors checkpoint instead.")
    if f.metadata.get(f"{arch}.expert_count"):
        raise GGUFError(
            f"{f.path} holds a mixture of experts ({arch}.expert_count = {f.metadata[f'{arch}.expert_count']}), "
            f"which staticformers does not load from GGUF yet: use the model's safetensors checkpoint instead.")
    return arch


def config_dict(f: GGUFFile) -> dict:
    """transformers' config.json for the model in `f` (what its GGUF loader builds)."""
    arch = check_architecture(f)
    meta = f.metadata
    config = {"architectures": [ARCHITECTURES[arch]], "model_type": arch}
    for key, name in _KEYS.items():
        if f"{arch}.{key}" in meta:
            config[name] = meta[f"{arch}.{key}"]
    head_dim_key = _HEAD_DIM.get(arch)
    if head_dim_key and f"{arch}.{head_dim_key}" in meta:
        config["head_dim"] = meta[f"{arch}.{head_dim_key}"]
    if "vocab_size" not in config and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    config["tie_word_embeddings"] = "output.weight" not in f.tensor_names
    config["attention_bias"] = any(n.endswith(".attn_q.bias") for n in f.tensor_names) and arch != "qwen2"
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if key in meta:
            config[name] = meta[key]
    return config


__all__ = ["ARCHITECTURES", "check_architecture", "config_dict"]
