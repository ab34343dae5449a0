"""GGUF files in: tiny llama, qwen2 and qwen3 files written with gguf.GGUFWriter (tests/gguf_files.py), in F32
and every ggml type we dequantise, loaded by staticformers and by transformers (`gguf_file=`): the same
weights, logits and greedy tokens; the tokenizer rebuilt from `tokenizer.ggml.*` giving transformers' ids and
text (byte-level BPE and SentencePiece-style); Q8_0 kept as our int8 when asked; and one sentence for each
file we refuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import byte_level_vocab, sentencepiece_vocab, write_tiny_gguf  # noqa: E402
from tiny import build_hf_model  # noqa: E402
from tolerances import EPS32, assert_close  # noqa: E402

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from staticformers.checkpoints.gguf_file import GGUFError  # noqa: E402
from staticformers.models.quantization import QuantizationConfig, QuantLinear  # noqa: E402

STRINGS = ["Hello world", " leading space", "def f(x):\n    return x * 2  # twice\n", "café naïve 日本語 🤗",
           "<|im_start|>user\nhi<|im_end|>", "numbers 1234567 and 3.14", "   several   spaces\t\ttabs", "",
           "I'm sure they'll"]

# (name, family, {GGUF name suffix: ggml type}, tokenizer, extra config): every type we dequantise appears;
# K-quants need rows of 256 (intermediate 256 for ffn_down, hidden 256 for the others); transformers reads no
# head_dim from a qwen3 GGUF (it keeps Qwen3Config's 128), so the qwen3 files use 128
CASES = [
    ("llama-f32", "llama", {}, "gpt2", {}),
    ("llama-tied-q8", "llama-tied", {"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "token_embd.weight": "Q8_0"},
     "gpt2", {}),
    ("qwen2-mixed", "qwen2", {"attn_q.weight": "Q8_0", "ffn_up.weight": "Q4_0", "ffn_gate.weight": "Q4_1",
                              "token_embd.weight": "F16", "attn_v.weight": "Q5_1"}, "gpt2", {}),
    ("qwen3-kquant", "qwen3-untied", {"ffn_down.weight": "Q4_K", "attn_k.weight": "BF16", "attn_v.weight": "Q5_0",
                                      "output.weight": "Q8_0"}, "gpt2", dict(intermediate_size=256, head_dim=128)),
    ("llama-spm-kquant", "llama", {"ffn_down.weight": "Q6_K", "ffn_up.weight": "Q5_K", "attn_q.weight": "Q4_K",
                                   "attn_output.weight": "Q4_1"}, "llama", dict(intermediate_size=256, hidden_size=256)),
]


@pytest.fixture(scope="module")
def vocab_sizes():
    return {"gpt2": len(byte_level_vocab()[0]), "llama": len(sentencepiece_vocab()[0])}


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


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_weights_and_logits_equal_transformers_loading_the_same_file(files, name):
    ours, theirs = _both(files, name)
    sa, sb = ours.state_dict(), theirs.state_dict()
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
        assert torch.equal(getattr(ours.model.layers[0].self_attn, proj).weight,
                           getattr(hf.model.layers[0].self_attn, proj).weight)


def test_config_from_metadata(files):
    folder, file, hf = files["qwen3-kquant"]
    ours = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    c = ours.config
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == \
        ("Qwen3ForCausalLM", hf.config.hidden_size, 2, 2, 128)
    assert not c.tie_word_embeddings and ours.dtype == torch.float32
    folder, file, _ = files["llama-tied-q8"]
    tied = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    assert tied.config.tie_word_embeddings and tied.lm_head.weight is tied.model.embed_tokens.weight


def test_greedy_tokens_equal_transformers(files):
    ours, theirs = _both(files, "qwen2-mixed")
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    a = ours.generate(ids, max_new_tokens=8, do_sample=False)
    b = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
    assert a.tolist() == b[:, : a.shape[1]].tolist() and a.shape[1] == ids.shape[1] + 8


def test_dtype_is_asked_or_the_files_own(files):
    folder, file, _ = files["qwen2-mixed"]
    assert AutoModelForCausalLM.from_pretrained(folder, gguf_file=file).dtype == torch.float16  # F16 embedding
    bf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype="bfloat16")
    assert bf.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["qwen2-mixed", "llama-spm-kquant"])
def test_tokenizer_equals_transformers_gguf_tokenizer(files, name):
    folder, file, _ = files[name]
    ours = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
    for text in STRINGS:
        a, b = ours(text)["input_ids"], theirs(text)["input_ids"]
        assert a == b, text
        assert ours.decode(a) == theirs.decode(b), text
        assert ours.decode(a, skip_special_tokens=True) == theirs.decode(b, skip_special_tokens=True), text
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == \
        (theirs.bos_token, theirs.eos_token, theirs.unk_token, theirs.pad_token)
    assert len(ours) == len(theirs)


def test_chat_template_from_the_file_renders_as_transformers(files):
    folder, file, _ = files["qwen2-mixed"]
    ours = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    a, b = ours.apply_chat_template(chat, add_generation_prompt=True), \
        theirs.apply_chat_template(chat, add_generation_prompt=True)
    assert (a if isinstance(a, list) else a["input_ids"]) == (b if isinstance(b, list) else b["input_ids"])


def test_q8_0_asked_as_int8_is_requantised_per_row_within_half_a_step(files):
    """Q8_0 holds int8 values with one fp16 scale per 32; our int8 has one scale per row, so it cannot hold
    them exactly (the file's blocks have different scales): each row is requantised, within half a per-row
    step of the Q8_0 values, and the error is measured here."""
    folder, file, _ = files["llama-tied-q8"]
    plain = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    q = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file,
                                             quantization_config=QuantizationConfig("int8_weight_only"))
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
        (w.add_uint32 if isinstance(value, int) else w.add_string)(key, value)
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_an_unsupported_architecture_is_one_sentence(tmp_path):
    path = _write_bare(tmp_path / "g.gguf", "gemma3", [("token_embd.weight", np.zeros((4, 8), np.float32), None)])
    with pytest.raises(GGUFError, match=r"'gemma3' model .* does not load from GGUF .*safetensors"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="g.gguf")


def test_a_mixture_of_experts_is_one_sentence(tmp_path):
    path = _write_bare(tmp_path / "m.gguf", "llama", [("token_embd.weight", np.zeros((4, 8), np.float32), None)],
                       **{"llama.expert_count": 8})
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
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight as IQ4_NL, a ggml type staticformers does not "
                                        r"dequantise .*use a GGUF of one of those types"):
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
