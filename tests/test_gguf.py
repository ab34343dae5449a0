"""GGUF files in: tiny llama, qwen2, qwen3, gemma2, gemma3 and phi3 files written with gguf.GGUFWriter as
llama.cpp's converter writes them (tests/gguf_files.py), in F32 and every ggml type we dequantise, loaded by
staticformers and by transformers (`gguf_file=`): the same weights, logits and greedy tokens; what
transformers' GGUF loader leaves at its config class's defaults (Gemma's soft caps and query_pre_attn_scalar,
Gemma 3's linear RoPE, Phi-3's partial RoPE, LongRoPE and sliding window) read from the file, checked against
the transformers model the file was written from and our load of its safetensors checkpoint; the tokenizer
rebuilt from `tokenizer.ggml.*` giving transformers' ids and text (byte-level BPE, SentencePiece-style, and
the Gemma and Phi-3 forms of SentencePiece); Q8_0 kept as our int8 when asked; and one sentence for each file
we refuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import byte_level_vocab, gemma_vocab, sentencepiece_vocab, write_tiny_gguf  # noqa: E402
from tiny import build_hf_model  # noqa: E402
from tolerances import EPS32, assert_close  # noqa: E402

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from staticformers.checkpoints.gguf_config import config_dict  # noqa: E402
from staticformers.checkpoints.gguf_file import GGUFError, open_gguf  # noqa: E402
from staticformers.models.quantization import QuantizationConfig, QuantLinear  # noqa: E402

STRINGS = [
    "Hello world",
    " leading space",
    "def f(x):\n    return x * 2  # twice\n",
    "café naïve 日本語 🤗",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 1234567 and 3.14",
    "   several   spaces\t\ttabs",
    "",
    "I'm sure they'll",
    "a  b    c\n\n  d",
]

# (name, family, {GGUF name suffix: ggml type}, tokenizer, extra config): every type we dequantise appears;
# K-quants need rows of 256 (intermediate 256 for ffn_down, hidden 256 for the others); transformers reads no
# head_dim from a qwen3 GGUF (it keeps Qwen3Config's 128), so the qwen3 files use 128
CASES = [
    ("llama-f32", "llama", {}, "gpt2", {}),
    (
        "llama-tied-q8",
        "llama-tied",
        {"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "token_embd.weight": "Q8_0"},
        "gpt2",
        {},
    ),
    (
        "qwen2-mixed",
        "qwen2",
        {
            "attn_q.weight": "Q8_0",
            "ffn_up.weight": "Q4_0",
            "ffn_gate.weight": "Q4_1",
            "token_embd.weight": "F16",
            "attn_v.weight": "Q5_1",
        },
        "gpt2",
        {},
    ),
    (
        "qwen3-kquant",
        "qwen3-untied",
        {"ffn_down.weight": "Q4_K", "attn_k.weight": "BF16", "attn_v.weight": "Q5_0", "output.weight": "Q8_0"},
        "gpt2",
        dict(intermediate_size=256, head_dim=128),
    ),
    (
        "llama-spm-kquant",
        "llama",
        {"ffn_down.weight": "Q6_K", "ffn_up.weight": "Q5_K", "attn_q.weight": "Q4_K", "attn_output.weight": "Q4_1"},
        "llama",
        dict(intermediate_size=256, hidden_size=256),
    ),
]
# Gemma 2, Gemma 3 and Phi-3 as transformers' GGUF loader reads them right (what it reads is its oracle): it
# reads neither query_pre_attn_scalar nor Gemma 2's soft caps nor Gemma 3's RoPE scaling (its config class's
# defaults stay: 256, 50 and 30, none), so these use head_dim 256 and those values; Gemma 3 has llama.cpp's
# 6 layers (5 sliding, 1 full); Phi-3 rotates whole heads. Gemma's norms are stored as 1 + w, Phi-3's q/k/v
# and gate/up fused. What transformers leaves out is tested in FILE_ONLY.
_GEMMA2 = dict(
    tie_word_embeddings=True,
    head_dim=256,
    query_pre_attn_scalar=256,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
)
_GEMMA3 = dict(num_hidden_layers=6, layer_types=None, head_dim=256, query_pre_attn_scalar=256, rope_parameters=None)
_Q8 = {
    "attn_q.weight": "Q8_0",
    "attn_output.weight": "Q8_0",
    "ffn_gate.weight": "Q8_0",
    "ffn_down.weight": "Q8_0",
    "token_embd.weight": "Q8_0",
}
CASES += [
    ("gemma2-f32", "gemma2", {}, "gemma", _GEMMA2),
    ("gemma2-q8", "gemma2", _Q8, "gpt2", _GEMMA2),
    ("gemma3-f32", "gemma3", {}, "gpt2", _GEMMA3),
    ("gemma3-q8", "gemma3", _Q8, "gemma", _GEMMA3),
    ("phi3-f32", "phi3", {}, "llama", {}),
    (
        "phi3-q8",
        "phi3",
        {"attn_qkv.weight": "Q8_0", "ffn_up.weight": "Q8_0", "output.weight": "Q8_0", "token_embd.weight": "Q8_0"},
        "gpt2",
        {},
    ),
]
# (name, family, extra config): what the file states and transformers' GGUF loader leaves at its config
# class's defaults, so its oracle is the transformers model the file was written from (and our load of that
# model's safetensors checkpoint for the config and weights). query_pre_attn_scalar is head_dim, as llama.cpp
# reads a Gemma file.
FILE_ONLY = [
    ("gemma2-caps", "gemma2", dict(tie_word_embeddings=True, query_pre_attn_scalar=16)),  # caps 0.5 and 3.0, window 4
    ("gemma3-linear", "gemma3", dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16)),  # x4 on full
    ("phi3-window", "phi3", dict(sliding_window=5)),
    ("phi4-longrope", "phi4-longrope", {}),  # 0.75 of each head rotates; LongRoPE switching at 64 positions
]


@pytest.fixture(scope="module")
def vocab_sizes():
    return {"gpt2": len(byte_level_vocab()[0]), "llama": len(sentencepiece_vocab()[0]), "gemma": len(gemma_vocab()[0])}


@pytest.fixture(scope="module")
def files(tmp_path_factory, vocab_sizes):
    """name -> (folder, file name, the transformers model it was written from)."""
    folder = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, family, types, tok, extra in CASES:
        hf = build_hf_model(family, vocab_size=vocab_sizes[tok], **extra)
        write_tiny_gguf(str(folder / f"{name}.gguf"), family, hf, types, tok)
        out[name] = (str(folder), f"{name}.gguf", hf)
    return out


def _both(files, name, dtype=torch.float32):
    folder, file, _ = files[name]
    ours = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype).eval()
    return ours, theirs


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


_FUSED = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)


def _joined(ours: dict, theirs: dict) -> dict:
    """Our state dict with the split projections joined where transformers holds them fused (Phi-3)."""
    out = dict(ours)
    for key in theirs:
        for fused, parts in _FUSED:
            if f".{fused}." in key:
                out[key] = torch.cat([out.pop(key.replace(fused, part)) for part in parts])
    return out


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_weights_and_logits_equal_transformers_loading_the_same_file(files, name):
    ours, theirs = _both(files, name)
    sb = theirs.state_dict()
    sa = _joined(ours.state_dict(), sb)
    assert set(sa) == set(sb)
    for key in sb:  # the same dequantisation (elementwise: at most one rounding apart)
        torch.testing.assert_close(sa[key], sb[key], rtol=2 * EPS32, atol=0, msg=key)
    ids = torch.randint(0, ours.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    assert_close(_logits(ours, ids), _logits(theirs, ids))


def test_llama_q_and_k_rows_are_unpermuted(files):
    """The file stores llama's q/k rows interleaved; loaded, they are the model's own rotate-half rows."""
    ours, _ = _both(files, "llama-f32")
    hf = files["llama-f32"][2]
    for proj in ("q_proj", "k_proj"):
        assert torch.equal(
            getattr(ours.model.layers[0].self_attn, proj).weight, getattr(hf.model.layers[0].self_attn, proj).weight
        )


def test_config_from_metadata(files):
    folder, file, hf = files["qwen3-kquant"]
    ours = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    c = ours.config
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (
        "Qwen3ForCausalLM",
        hf.config.hidden_size,
        2,
        2,
        128,
    )
    assert not c.tie_word_embeddings and ours.dtype == torch.float32
    folder, file, _ = files["llama-tied-q8"]
    tied = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    assert tied.config.tie_word_embeddings and tied.lm_head.weight is tied.model.embed_tokens.weight


def _greedy(ours, theirs, ids):
    a = ours.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, disable_compile=True)
    b = theirs.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert a.tolist() == b.tolist() and a.shape[1] == ids.shape[1] + 8


@pytest.mark.parametrize("name", ["qwen2-mixed", "gemma2-q8", "gemma3-q8", "phi3-q8"])
def test_greedy_tokens_equal_transformers(files, name):
    _greedy(*_both(files, name), torch.tensor([[5, 17, 42, 99, 7]]))


def test_gemma_and_phi3_config_from_metadata(files):
    """What the metadata gives beyond the shared keys: head_dim from key_length, the caps, the sliding window
    and llama.cpp's layer pattern, Gemma 3's two RoPEs (the file's base on the full layers, 10000 on the
    sliding ones), Phi-3's head_dim from hidden / heads and its original context."""
    c = AutoModelForCausalLM.from_pretrained(files["gemma2-q8"][0], gguf_file=files["gemma2-q8"][1]).config
    assert (
        c.architecture,
        c.head_dim,
        c.query_pre_attn_scalar,
        c.attn_logit_softcapping,
        c.final_logit_softcapping,
        c.sliding_window,
        c.layer_types,
        c.tie_word_embeddings,
        c.rope_theta,
    ) == (
        "Gemma2ForCausalLM",
        256,
        256,
        50.0,
        30.0,
        4,
        ["sliding_attention", "full_attention", "sliding_attention"],
        True,
        10000.0,
    )
    c = AutoModelForCausalLM.from_pretrained(files["gemma3-q8"][0], gguf_file=files["gemma3-q8"][1]).config
    assert (
        c.architecture,
        c.model_type,
        c.head_dim,
        c.sliding_window,
        c.rope_theta,
        c.rope_scaling,
        c.rope_local["rope_theta"],
        c.final_logit_softcapping,
    ) == ("Gemma3ForCausalLM", "gemma3_text", 256, 5, 1000000.0, None, 10000.0, None)
    assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    c = AutoModelForCausalLM.from_pretrained(files["phi3-q8"][0], gguf_file=files["phi3-q8"][1]).config
    assert (
        c.architecture,
        c.head_dim,
        c.partial_rotary_factor,
        c.rope_scaling,
        c.sliding_window,
        c.tie_word_embeddings,
    ) == ("Phi3ForCausalLM", 16, 1.0, None, None, False)
    folder, file, _ = files["phi3-q8"]
    assert config_dict(open_gguf(f"{folder}/{file}"))["original_max_position_embeddings"] == 4096


_COMPARED = (
    "head_dim",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
    "layer_types",
    "rope_theta",
    "rope_local",
    "partial_rotary_factor",
    "tie_word_embeddings",
    "rms_norm_eps",
    "max_position_embeddings",
    "num_key_value_heads",
)


@pytest.mark.parametrize("name", [c[0] for c in FILE_ONLY])
def test_what_transformers_gguf_loader_leaves_out_is_read_from_the_file(tmp_path, vocab_sizes, name):
    """transformers' GGUF loader reads none of this (it loads these files wrongly); we read the file: the config
    and weights of our load of the model's safetensors checkpoint (Gemma's norms within the rounding of the
    file's 1 + w), the logits of the transformers model the file was written from over 11 and 80 positions
    (LongRoPE's short and long factors), and its greedy tokens."""
    _, family, extra = next(c for c in FILE_ONLY if c[0] == name)
    hf = build_hf_model(family, vocab_size=vocab_sizes["gpt2"], **extra)
    write_tiny_gguf(str(tmp_path / f"{name}.gguf"), family, hf)
    hf.save_pretrained(str(tmp_path / "st"))
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{name}.gguf")
    st = AutoModelForCausalLM.from_pretrained(str(tmp_path / "st"))
    for key in _COMPARED:  # the file's floats are float32 (rms_norm_eps 1e-6 is 9.999999975e-07)
        a, b = getattr(ours.config, key), getattr(st.config, key)
        assert (np.float32(a) == np.float32(b)) if isinstance(b, float) else a == b, key
    a, b = ours.config.rope_scaling or {}, st.config.rope_scaling or {}  # LongRoPE's factors went through float32
    assert a.keys() == b.keys() and all(
        a[k] == b[k] if isinstance(b[k], str) else np.array_equal(np.float32(a[k]), np.float32(b[k])) for k in a
    ), (a, b)
    sa, sb = ours.state_dict(), st.state_dict()
    assert set(sa) == set(sb)
    for key in sb:
        torch.testing.assert_close(sa[key], sb[key], rtol=2 * EPS32, atol=EPS32, msg=key)
    ids = torch.randint(0, ours.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(0))
    assert_close(_logits(ours, ids[:, :11]), _logits(hf, ids[:, :11]))
    assert_close(_logits(ours, ids), _logits(hf, ids))
    _greedy(ours, hf, ids[:1, :70] if family == "phi4-longrope" else ids[:1, :5])  # past the switch in both


def test_gemma_27b_query_scale_and_the_files_own_pattern_and_swa_base(tmp_path):
    """GGUF carries no query_pre_attn_scalar: head_dim, but hidden / heads for the 27B models (46 layers of
    Gemma 2, 62 of Gemma 3), as llama.cpp reads them; a Gemma 3 file may state its sliding layers' RoPE base
    and pattern (newer llama.cpp reads both); without a sliding window every Gemma 3 layer is full."""
    common = {"embedding_length": 4608, "attention.head_count": 32, "attention.key_length": 128}
    path = _write_bare(
        tmp_path / "g2.gguf", "gemma2", **{f"gemma2.{k}": v for k, v in {**common, "block_count": 46}.items()}
    )
    assert config_dict(open_gguf(path))["query_pre_attn_scalar"] == 144
    path = _write_bare(
        tmp_path / "g2b.gguf", "gemma2", **{f"gemma2.{k}": v for k, v in {**common, "block_count": 42}.items()}
    )
    assert config_dict(open_gguf(path))["query_pre_attn_scalar"] == 128
    path = _write_bare(
        tmp_path / "g3.gguf",
        "gemma3",
        **{
            f"gemma3.{k}": v
            for k, v in {
                **common,
                "block_count": 62,
                "attention.sliding_window": 1024,
                "attention.sliding_window_pattern": 4,
                "rope.freq_base_swa": 50000.0,
            }.items()
        },
    )
    d = config_dict(open_gguf(path))
    assert d["query_pre_attn_scalar"] == 144 and d["sliding_window"] == 1024
    assert d["layer_types"][:8] == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + [
        "full_attention"
    ]
    assert d["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 50000.0}
    path = _write_bare(
        tmp_path / "g3b.gguf", "gemma3", **{f"gemma3.{k}": v for k, v in {**common, "block_count": 4}.items()}
    )
    d = config_dict(open_gguf(path))
    assert d["sliding_window"] is None and d["layer_types"] == ["full_attention"] * 4


def test_what_a_gemma3_or_phi3_file_cannot_say_is_one_sentence(tmp_path):
    common = {"embedding_length": 64, "attention.head_count": 4, "block_count": 2}
    path = _write_bare(
        tmp_path / "y.gguf",
        "gemma3",
        **{f"gemma3.{k}": v for k, v in common.items()},
        **{"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 8.0},
    )
    with pytest.raises(
        GGUFError,
        match=r"RoPE scaling 'yarn' .* reads only as 'linear' from GGUF: use the model's "
        r"safetensors checkpoint",
    ):
        config_dict(open_gguf(path))
    path = _write_bare(
        tmp_path / "p.gguf",
        "phi3",
        [("rope_factors_long.weight", np.ones(8, np.float32), None)],
        **{f"phi3.{k}": v for k, v in {**common, "rope.scaling.original_context_length": 64}.items()},
    )
    with pytest.raises(
        GGUFError,
        match=r"carries LongRoPE factors \(rope_factors_long.weight\) but no "
        r"rope_factors_short.weight: the file is incomplete",
    ):
        config_dict(open_gguf(path))


def test_a_phi3_attention_factor_unlike_longropes_is_named_in_a_warning(tmp_path, vocab_sizes, caplog):
    """A converter that took a Phi-3 for YaRN writes YaRN's attention factor (0.1 ln(s) + 1); we scale by
    LongRoPE's, as transformers does with the safetensors checkpoint, and say so."""
    hf = build_hf_model("phi4-longrope", vocab_size=vocab_sizes["gpt2"])
    write_tiny_gguf(str(tmp_path / "p.gguf"), "phi4-longrope", hf)
    with caplog.at_level("WARNING", logger="staticformers"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="p.gguf")
    assert "attn_factor" not in caplog.text
    write_tiny_gguf(str(tmp_path / "y.gguf"), "phi4-longrope", hf, **{"phi3.rope.scaling.attn_factor": 1.2})
    with caplog.at_level("WARNING", logger="staticformers"):
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="y.gguf")
    assert "rope.scaling.attn_factor = 1.2, not LongRoPE's 1.22474 for 512 / 64 positions" in caplog.text
    ids = torch.tensor([[1, 2, 3, 4]])
    assert_close(_logits(model, ids), _logits(hf, ids))


def test_dtype_is_asked_or_the_files_own(files):
    folder, file, _ = files["qwen2-mixed"]
    assert AutoModelForCausalLM.from_pretrained(folder, gguf_file=file).dtype == torch.float16  # F16 embedding
    bf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype="bfloat16")
    assert bf.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["qwen2-mixed", "llama-spm-kquant", "gemma3-q8", "phi3-f32"])
def test_tokenizer_equals_transformers_gguf_tokenizer(files, name):
    """Byte-level BPE, SentencePiece-style, and the two forms transformers builds by architecture: Gemma's
    (no prefix space, its runs of spaces, merges in token order) and Phi-3's (the prefix space a normalizer)."""
    folder, file, _ = files[name]
    ours = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
    for text in STRINGS:
        a, b = ours(text)["input_ids"], theirs(text)["input_ids"]
        assert a == b, text
        assert ours.decode(a) == theirs.decode(b), text
        assert ours.decode(a, skip_special_tokens=True) == theirs.decode(b, skip_special_tokens=True), text
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.unk_token,
        theirs.pad_token,
    )
    assert len(ours) == len(theirs)


def test_chat_template_from_the_file_renders_as_transformers(files):
    folder, file, _ = files["qwen2-mixed"]
    ours = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    a, b = (
        ours.apply_chat_template(chat, add_generation_prompt=True),
        theirs.apply_chat_template(chat, add_generation_prompt=True),
    )
    assert (a if isinstance(a, list) else a["input_ids"]) == (b if isinstance(b, list) else b["input_ids"])


def test_q8_0_asked_as_int8_is_requantised_per_row_within_half_a_step(files):
    """Q8_0 holds int8 values with one fp16 scale per 32; our int8 has one scale per row, so it cannot hold
    them exactly (the file's blocks have different scales): each row is requantised, within half a per-row
    step of the Q8_0 values, and the error is measured here."""
    folder, file, _ = files["llama-tied-q8"]
    plain = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    q = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, quantization_config=QuantizationConfig("int8_weight_only")
    )
    layer = q.model.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantLinear) and layer.weight.dtype == torch.int8
    q8 = plain.model.layers[0].self_attn.q_proj.weight
    err = (layer.dequantized() - q8).abs()
    assert (err <= layer.weight_scale * (0.5 + 1e-3)).all()
    assert err.max() > 0  # not exact: the blocks' scales differ within a row
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    rel = (_logits(q, ids) - _logits(plain, ids)).norm() / _logits(plain, ids).norm()
    assert rel < 0.05


def _write_bare(path, arch="llama", tensors=(), **keys):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32 if isinstance(value, float) else w.add_string)(
            key, value
        )
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_an_unsupported_architecture_is_one_sentence(tmp_path):
    _write_bare(tmp_path / "g.gguf", "starcoder2", [("token_embd.weight", np.zeros((4, 8), np.float32), None)])
    with pytest.raises(GGUFError, match=r"'starcoder2' model .* does not load from GGUF .*safetensors"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="g.gguf")


def test_a_mixture_of_experts_is_one_sentence(tmp_path):
    path = _write_bare(
        tmp_path / "m.gguf",
        "llama",
        [("token_embd.weight", np.zeros((4, 8), np.float32), None)],
        **{"llama.expert_count": 8},
    )
    with pytest.raises(GGUFError, match="mixture of experts .*expert_count = 8"):
        AutoModelForCausalLM.from_pretrained(path, gguf_file=path)


def test_an_unsupported_tensor_type_is_one_sentence_naming_it(files, tmp_path, vocab_sizes):
    hf = build_hf_model("llama", vocab_size=vocab_sizes["gpt2"])
    path = write_tiny_gguf(str(tmp_path / "iq.gguf"), "llama", hf)
    # the same file with one tensor as IQ4_NL blocks (a type we do not dequantise)
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, kind)
    for t in r.tensors:
        if t.name == "blk.0.ffn_up.weight":
            raw = np.random.default_rng(0).integers(0, 256, (128, 2 * 18), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(t.name, np.array(t.data).reshape([int(n) for n in reversed(t.shape.tolist())]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        GGUFError,
        match=r"blk\.0\.ffn_up\.weight as IQ4_NL, a ggml type staticformers does not "
        r"dequantise .*use a GGUF of one of those types",
    ):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="iq2.gguf")


def test_a_missing_or_broken_file_is_one_sentence(tmp_path):
    from staticformers.checkpoints.hub import CheckpointNotFoundError

    with pytest.raises((CheckpointNotFoundError, GGUFError), match="nope.gguf"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="nope.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match="is not a GGUF file .*re-download"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="bad.gguf")


def test_an_unsupported_tokenizer_or_none_is_one_sentence(tmp_path):
    _write_bare(tmp_path / "none.gguf", "llama", [("token_embd.weight", np.zeros((4, 8), np.float32), None)])
    with pytest.raises(GGUFError, match="has no tokenizer.ggml.tokens: it carries no tokenizer; load the tokenizer"):
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="none.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((3, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="states tokenizer model 'bert' .*load the tokenizer from the model's Hub repo"):
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="bert.gguf")


def test_gguf_with_distributed_config_is_refused_in_one_sentence(files):
    folder, file, _ = files["llama-f32"]
    with pytest.raises(ValueError, match="GGUF file .* distributed_config is not supported"):
        AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, distributed_config=object())


def test_llama3_rope_factors_are_named_in_a_warning_and_the_rest_loads(tmp_path, vocab_sizes, caplog):
    """Llama 3.1+ files carry rope_freqs.weight; transformers' GGUF loader ignores it, and so do we, saying so."""
    hf = build_hf_model("llama", vocab_size=vocab_sizes["gpt2"])
    write_tiny_gguf(str(tmp_path / "l3.gguf"), "llama", hf, extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with caplog.at_level("WARNING", logger="staticformers"):
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="l3.gguf")
    assert "rope_freqs.weight" in caplog.text and "plain RoPE" in caplog.text
    ids = torch.tensor([[1, 2, 3, 4]])
    assert_close(_logits(model, ids), _logits(hf, ids))
