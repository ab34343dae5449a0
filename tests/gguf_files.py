"""Tiny GGUF files for tests, written with `gguf.GGUFWriter` from a tiny transformers model (tests/tiny.py).

Each file carries what llama.cpp's Hugging Face converter writes: the config under `<arch>.*` keys, a
tokenizer under `tokenizer.ggml.*` (a byte-level BPE, a SentencePiece-style one, or a Gemma-style one, trained
here on a few sentences), a chat template, and the tensors under llama.cpp's names, in the asked ggml types
(quantized with `gguf.quants.quantize`; the K-quants, which it cannot quantize, as random blocks with finite
scales). As the converter does, per architecture:
- llama: q/k rows permuted to interleaved pairs;
- gemma2 / gemma3: every `*norm.weight` stored as 1 + w (Gemma's RMSNorm scales by 1 + w), the sandwich
  norms as `post_attention_norm` / `ffn_norm` / `post_ffw_norm`, no `output.weight` for Gemma 2 (its
  converter drops lm_head), head_dim as `attention.key_length`, Gemma 2's soft caps, the sliding window,
  Gemma 3's full-attention RoPE base and linear factor (`rope.scaling.*`);
- phi3: q/k/v stored fused as `attn_qkv` and gate/up as `ffn_up` (the Hub's own fused tensors), the
  rotated dims as `rope.dimension_count`, `rope.scaling.original_context_length`, and LongRoPE's factors as
  the tensors `rope_factors_long.weight` / `rope_factors_short.weight` with `rope.scaling.attn_factor`.
Nothing is downloaded.
"""

from __future__ import annotations

import math

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")

ARCH = {
    "llama": "llama",
    "llama-tied": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3-untied": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "phi4-longrope": "phi3",
}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = [
    "Hello world, this is a tiny tokenizer for GGUF tests.",
    "def f(x):\n    return x * 2  # twice\n",
    "The quick brown fox jumps over the lazy dog 1234567890 times.",
    "café naïve über straße",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# per architecture, the names that differ from llama's (llama.cpp's gguf.MODEL_TENSORS / TensorNameMap)
_ARCH_TO_GGUF = {
    "gemma2": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_ARCH_TO_GGUF["gemma3"] = _ARCH_TO_GGUF["gemma2"]
# offsets of a K-quant block's fp16 scale(s), in bytes
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_name(hf: str, arch: str = "llama") -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, leaf = rest.rpartition(".")
    names = {**_TO_GGUF, **_ARCH_TO_GGUF.get(arch, {})}
    return f"blk.{layer}.{names[module]}.{leaf}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(size: int = 320) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE trained on TEXT, the special tokens first."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    return tokens, merges, [3 if t in SPECIALS else 1 for t in tokens]


def sentencepiece_vocab(size: int = 400) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, then
    pieces of a BPE trained on TEXT with "▁" for spaces, best first."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=size - 259, show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def gemma_vocab(size: int = 400) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a Gemma-style SentencePiece vocabulary: <pad> <eos> <bos> <unk> <mask>,
    runs of 2 and 4 spaces stored as real spaces (as Gemma files store them), 256 byte tokens, then the pieces
    of `sentencepiece_vocab`. Every score is 0: Gemma's scores do not give its merge order, the token order does."""
    tokens = sentencepiece_vocab(size)[0][259:]
    spaces = [t for t in ("  ", "    ") if "\u2581" * len(t) not in tokens]
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + spaces + [f"<0x{b:02X}>" for b in range(256)]
    tokens = head + tokens[: size - len(head)]
    types = [3, 3, 3, 2, 3] + [4] * len(spaces) + [6] * 256 + [1] * (len(tokens) - len(head))
    return tokens, [0.0] * len(tokens), types


def _k_blocks(shape: tuple, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a [rows, cols] tensor, every fp16 scale a small finite number."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALES[kind]:
        scales = rng.uniform(1e-3, 4e-3, size=(rows, cols // block)).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def _arch_metadata(w, arch: str, cfg, head_dim: int) -> dict:
    """The `<arch>.*` keys llama.cpp's converter writes beyond the shared ones; returns the extra tensors
    (Phi-3's LongRoPE factors)."""
    rope = cfg.rope_parameters
    if arch in ("llama", "qwen2", "qwen3"):
        w.add_rope_freq_base(float(rope["rope_theta"]))
        w.add_rope_dimension_count(head_dim)
        if arch == "qwen3":
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        return {}
    if arch == "gemma2":  # no RoPE key (llama.cpp's default base, 10000)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
        return {}
    if arch == "gemma3":  # the full layers' RoPE; the sliding layers' base is llama.cpp's fixed 10000
        full = rope.get("full_attention", rope)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(float(full["rope_theta"]))
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if "sliding_attention" in cfg.layer_types:
            w.add_sliding_window(cfg.sliding_window)
        if full.get("rope_type", "default") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(full["factor"]))
        return {}
    # phi3
    factor = rope.get("partial_rotary_factor", 1.0)
    rope_dims = int(factor * cfg.hidden_size) // cfg.num_attention_heads
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_sliding_window(cfg.sliding_window or 0)  # 0: none (Phi-4)
    if rope.get("rope_type", "default") not in ("longrope", "su"):
        return {}
    scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)) if scale > 1.0 else 1.0
    )
    return {
        "rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32),
    }


def write_tiny_gguf(
    path: str,
    family: str,
    model,
    types: dict | None = None,
    tokenizer: str = "gpt2",
    seed: int = 0,
    extra_tensors: dict | None = None,
    **metadata,
) -> str:
    """Write `model` (a tiny transformers model of `family`) as a GGUF file at `path`.

    `types`: GGUF tensor-name suffix (e.g. "attn_q.weight", "token_embd.weight") -> ggml type name; the rest
    is F32. `extra_tensors`: GGUF name -> float32 array, written as they are. `tokenizer`: "gpt2", "llama" or
    "gemma" (its vocabulary must be the model's vocab_size: build the model with `vocab_size=len(tokens)`).
    `metadata`: extra keys, name -> value, written as they are."""
    arch = ARCH[family]
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope_tensors = _arch_metadata(w, arch, cfg, head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer == "gpt2":
        tokens, merges, token_types = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)
    elif tokenizer == "gemma":  # what llama.cpp writes for Gemma's tokenizer.model
        tokens, scores, token_types = gemma_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        w.add_chat_template(TEMPLATE)
    else:
        tokens, scores, token_types = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if arch == "phi3":  # Phi-3's files name a pad token (transformers' Phi3Config default, 32000, is out of range)
            w.add_pad_token_id(0)
    for key, value in metadata.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    rng = np.random.default_rng(seed)
    types = types or {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or arch == "gemma2"):
            continue  # Gemma 2's converter drops lm_head (llama.cpp runs it tied)
        gname = gguf_name(name, arch)
        value = tensor.detach().to(torch.float32).numpy().copy()
        if arch in ("gemma2", "gemma3") and gname.endswith("norm.weight"):
            value = value + np.float32(1.0)
        if arch == "llama" and ".attn_q." in gname:
            value = permute(value, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            value = permute(value, cfg.num_key_value_heads)
        kind = next((t for suffix, t in types.items() if gname.endswith(suffix)), "F32")
        if kind == "F32":
            w.add_tensor(gname, value)
        elif kind == "F16":
            w.add_tensor(gname, value.astype(np.float16))
        elif kind in _K_SCALES:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, _k_blocks(value.shape, kind, rng), raw_dtype=qtype)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    for gname, value in {**rope_tensors, **(extra_tensors or {})}.items():
        w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


__all__ = [
    "write_tiny_gguf",
    "byte_level_vocab",
    "sentencepiece_vocab",
    "gemma_vocab",
    "TEMPLATE",
    "gguf_name",
    "permute",
]
