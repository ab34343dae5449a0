"""Tiny GGUF files for tests, written with `gguf.GGUFWriter` from a tiny transformers model (tests/tiny.py).

Each file carries what llama.cpp's converter writes: the config under `<arch>.*` keys, a tokenizer under
`tokenizer.ggml.*` (a byte-level BPE or a SentencePiece-style one, trained here on a few sentences), a chat
template, and the tensors under llama.cpp's names with llama's q/k rows permuted, in the asked ggml types
(quantized with `gguf.quants.quantize`; the K-quants, which it cannot quantize, as random blocks with finite
scales). Nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")

ARCH = {"llama": "llama", "llama-tied": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3-untied": "qwen3"}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ["Hello world, this is a tiny tokenizer for GGUF tests.", "def f(x):\n    return x * 2  # twice\n",
        "The quick brown fox jumps over the lazy dog 1234567890 times.", "café naïve über straße"] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# offsets of a K-quant block's fp16 scale(s), in bytes
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, leaf = rest.rpartition(".")
    return f"blk.{layer}.{_TO_GGUF[module]}.{leaf}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(size: int = 320) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE trained on TEXT, the special tokens first."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
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


def _k_blocks(shape: tuple, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a [rows, cols] tensor, every fp16 scale a small finite number."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALES[kind]:
        scales = rng.uniform(1e-3, 4e-3, size=(rows, cols // block)).astype(np.float16)
        data[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def write_tiny_gguf(path: str, family: str, model, types: dict | None = None, tokenizer: str = "gpt2",
                    seed: int = 0, extra_tensors: dict | None = None, **metadata) -> str:
    """Write `model` (a tiny transformers model of `family`) as a GGUF file at `path`.

    `types`: GGUF tensor-name suffix (e.g. "attn_q.weight", "token_embd.weight") -> ggml type name; the rest
    is F32. `extra_tensors`: GGUF name -> float32 array, written as they are. `tokenizer`: "gpt2" or "llama" (its vocabulary must be the model's vocab_size: build the model
    with `vocab_size=len(tokens)`). `metadata`: extra keys, name -> value, written as they are."""
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
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
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
    else:
        tokens, scores, token_types = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
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
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = gguf_name(name)
        value = tensor.detach().to(torch.float32).numpy().copy()
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
    for gname, value in (extra_tensors or {}).items():
        w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


__all__ = ["write_tiny_gguf", "byte_level_vocab", "sentencepiece_vocab", "TEMPLATE", "gguf_name", "permute"]
