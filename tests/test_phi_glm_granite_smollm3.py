"""Phi-3/Phi-4-mini, GLM-4, Granite and SmolLM3 against transformers 5.23 (tiny random models, tests/tiny.py).

Logits for every family are in test_modeling.py, bf16 logits and greedy tokens in test_on_device.py, greedy
single prompts in test_generation.py. Here: what is particular to these families (LongRoPE's factor choice,
the fused names on disk, the config keys that round-trip, the refusals), and greedy tokens of left-padded
mixed batches through the engine, eager and compiled (Dynamo's eager backend).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import engine_for
from staticformers.models.config_checks import ConfigError
from staticformers.models.kv_cache import KVCache
from staticformers.models.model_config import ModelConfig
import tolerances as tol

transformers = pytest.importorskip("transformers")

NEW = ["phi3", "phi4-longrope", "glm4", "granite", "smollm3"]
PLAN = ShapePlan(max_model_len=64, max_batch_size=4, min_prompt_length=8, min_kv_length=64)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _left_padded(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, 128, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------
# greedy tokens of mixed batches
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", NEW)
def test_greedy_mixed_batch_compiled_and_batch_1_equal_transformers(tiny_checkpoints, family):
    """A left-padded batch of 5 rows (a bucket of 4, then 1), 16 new tokens through the engine's compiled
    regions (Dynamo's eager backend), and one row alone, 24 new tokens through its eager steps: transformers'
    greedy tokens (test_generation.py runs single prompts of every family at the bucket edges)."""
    path = tiny_checkpoints(family)
    hf, ours = _hf(path), AutoModelForCausalLM.from_pretrained(path)
    engine_for(ours, PLAN)
    ids, mask = _left_padded([5, 20, 13, 1, 9], seed=2)
    want = hf.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=None
    )
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(ours.generate(input_ids=ids, compile_config=CompileConfig(backend="eager"), **kw), want)
    one = ids[1:2]
    want_one = hf.generate(
        input_ids=one,
        attention_mask=torch.ones_like(one),
        do_sample=False,
        max_new_tokens=24,
        pad_token_id=0,
        eos_token_id=None,
    )
    got = ours.generate(one, max_new_tokens=24, do_sample=False, eos_token_id=None, disable_compile=True)
    assert torch.equal(got, want_one)


# ---------------------------------------------------------------------------------------------
# LongRoPE
# ---------------------------------------------------------------------------------------------
def test_longrope_long_factors_beyond_the_original_context(tiny_checkpoints):
    """phi4-longrope switches at 64 positions: a forward over 80 tokens runs the long factors in transformers
    and here (no cache: the sequence decides), a forward over 12 the short ones; the two sets differ."""
    path = tiny_checkpoints("phi4-longrope")
    hf, ours = _hf(path), AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(3, 128, (2, 80), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        long_ours, long_ref = ours(input_ids=ids).logits, hf(input_ids=ids).logits
        short_ours, short_ref = ours(input_ids=ids[:, :12]).logits, hf(input_ids=ids[:, :12]).logits
    tol.assert_close(long_ours, long_ref)
    tol.assert_close(short_ours, short_ref)
    assert not torch.allclose(long_ours[:, :12], short_ours, atol=1e-3)


def test_longrope_in_the_engine_chooses_by_the_cache_length(tiny_checkpoints):
    """A cache of at most 64 positions (the original context) runs the short factors: transformers' tokens.
    A cache of 128 runs the long ones from the first token: a prompt of 70 gets transformers' tokens (it is
    past the switch there too), and a prompt of 10 gets the logits transformers computes at those 10
    positions inside a sequence longer than 64 (long factors), not its short-factor logits."""
    path = tiny_checkpoints("phi4-longrope")
    hf, ours = _hf(path), AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(6)
    long_prompt = torch.randint(3, 128, (1, 70), generator=g)
    short_prompt = long_prompt[:, :10]
    engine_for(ours, ShapePlan(max_model_len=128, max_batch_size=1, prompt_lengths=(16, 128), kv_lengths=(64, 128)))
    want = hf.generate(
        input_ids=long_prompt,
        attention_mask=torch.ones_like(long_prompt),
        do_sample=False,
        max_new_tokens=16,
        eos_token_id=None,
        pad_token_id=0,
    )
    got = ours.generate(long_prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, disable_compile=True)
    assert torch.equal(got, want)
    short_want = hf.generate(
        input_ids=short_prompt,
        attention_mask=torch.ones_like(short_prompt),
        do_sample=False,
        max_new_tokens=16,
        eos_token_id=None,
        pad_token_id=0,
    )
    got = ours.generate(short_prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, disable_compile=True)
    assert torch.equal(got, short_want)  # 26 positions: the cache of 64, short factors as in transformers

    cache = KVCache.for_model(ours, batch=1, max_length=128)  # a forward through a cache of 128 positions
    with torch.no_grad():
        through_cache = ours(input_ids=short_prompt, position_ids=torch.arange(10)[None], kv_cache=cache).logits
        inside_long = hf(input_ids=long_prompt).logits[:, :10]
        short = hf(input_ids=short_prompt).logits
    tol.assert_close(through_cache, inside_long)
    assert not torch.allclose(through_cache, short, atol=1e-3)


def test_phi3_sliding_window_applies_to_every_layer(tiny_checkpoints):
    """Phi-3-mini's configs set `sliding_window` (2047), which transformers applies to every layer."""
    path = tiny_checkpoints("phi3", sliding_window=5)
    hf, ours = _hf(path), AutoModelForCausalLM.from_pretrained(path)
    assert all(layer.self_attn.window == 5 for layer in ours.model.layers)
    ids, mask = _left_padded([12, 8, 3], seed=8)
    with torch.no_grad():
        real = mask.bool()
        tol.assert_close(
            ours(input_ids=ids, attention_mask=mask).logits[real], hf(input_ids=ids, attention_mask=mask).logits[real]
        )
        tol.assert_close(ours(input_ids=ids[:1]).logits, hf(input_ids=ids[:1]).logits)


# ---------------------------------------------------------------------------------------------
# saving: transformers loads what we write
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", NEW)
def test_save_then_transformers_loads_the_same_logits(tiny_checkpoints, tmp_path, family):
    from safetensors import safe_open

    path = tiny_checkpoints(family)
    ours = AutoModelForCausalLM.from_pretrained(path)
    ours.save_pretrained(str(tmp_path))
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert saved == set(f.keys())  # the Hub's names: Phi-3's qkv_proj and gate_up_proj fused again
    if family.startswith("phi"):
        assert "model.layers.0.self_attn.qkv_proj.weight" in saved and "model.layers.0.mlp.gate_up_proj.weight" in saved
        assert not any(".q_proj." in n or ".gate_proj." in n for n in saved)
    ids, mask = _left_padded([12, 7, 3], seed=7)
    ref, again = _hf(str(tmp_path)), AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        want = ours(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        tol.assert_close(ref(input_ids=ids, attention_mask=mask).logits[real], want[real])
        assert torch.equal(again(input_ids=ids, attention_mask=mask).logits, want)
    written = json.load(open(os.path.join(tmp_path, "config.json")))
    original = json.load(open(os.path.join(path, "config.json")))
    for key, value in original.items():  # every key transformers wrote comes back with its value
        if key in ("transformers_version", "dtype"):
            continue
        assert written.get(key) == value, (key, written.get(key), value)


def test_unknown_keys_are_kept_and_old_spellings_read():
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    glm = ModelConfig.from_dict(
        {
            **base,
            "architectures": ["Glm4ForCausalLM"],
            "head_dim": 16,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "my_key": [1, 2],
        }
    )
    assert glm.rotary_dim == 8 and glm.attention_bias  # GLM-4's defaults: half the head rotates, q/k/v biased
    out = glm.to_dict()
    assert out["my_key"] == [1, 2] and out["rope_parameters"]["partial_rotary_factor"] == 0.5
    smol = ModelConfig.from_dict(
        {
            **base,
            "architectures": ["SmolLM3ForCausalLM"],
            "num_hidden_layers": 4,
            "no_rope_layer_interval": 2,
            "use_sliding_window": True,
            "sliding_window": 8,
        }
    )
    assert smol.no_rope_layers == [1, 0, 1, 0]
    assert smol.layer_types == ["full_attention", "sliding_attention"] * 2  # transformers' rule
    assert [smol.layer_uses_rope(i) for i in range(4)] == [True, False, True, False]
    granite = ModelConfig.from_dict({**base, "architectures": ["GraniteForCausalLM"], "logits_scaling": 8})
    assert granite.logits_scaling == 8.0 and granite.attention_multiplier == 1.0
    llama = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"], "logits_scaling": 8})
    assert llama.logits_scaling == 1.0 and llama.to_dict()["logits_scaling"] == 8  # not Llama's key: kept as is


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 5,
                    "long_factor": [1.0] * 8,
                }
            },
            r"'short_factor' as a list of 8 positive numbers",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [1.0] * 7 + [-1.0],
                }
            },
            r"'long_factor' as a list of 8",
        ),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 must be at most 1"),
        ({"partial_rotary_factor": 0.1}, r"rotates 1 dims: it must give an even number"),
    ],
)
def test_bad_phi3_configs_get_one_sentence(change, message):
    raw = dict(
        architectures=["Phi3ForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        **change,
    )
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_phi3_older_rope_type_names_mean_longrope():
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for old in ("su", "yarn"):
        config = ModelConfig.from_dict(
            dict(
                architectures=["Phi3ForCausalLM"],
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=512,
                original_max_position_embeddings=64,
                rope_scaling={"type": old, **factors},
            )
        )
        assert config.rope_type == "longrope" and config.rope_scaling["original_max_position_embeddings"] == 64


def test_bad_smollm3_and_granite_configs_get_one_sentence():
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    with pytest.raises(ConfigError, match=r"no_rope_layers must list 0 or 1 for each of the 2 layers"):
        ModelConfig.from_dict({**base, "architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1, 0, 1]})
    with pytest.raises(ConfigError, match=r"logits_scaling"):
        ModelConfig.from_dict({**base, "architectures": ["GraniteForCausalLM"], "logits_scaling": 0})


def test_layers_without_rope_are_their_own_kind(tiny_checkpoints):
    """SmolLM3's layers 1 and 3 skip RoPE: a compiled layer region is shared by kind, so they must differ."""
    from staticformers.compilation.regions import region_name

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("smollm3"))
    kinds = [layer.kind for layer in model.model.layers]
    assert kinds[0] == kinds[2] and kinds[1] == kinds[3] and kinds[0] != kinds[1]
    assert region_name("layer", kinds[1]) == "layer_window6_norope"


# ---------------------------------------------------------------------------------------------
# int8 and the server, on Phi-3 (fused names on disk)
# ---------------------------------------------------------------------------------------------
def test_phi3_int8_saves_fused_loads_in_transformers_and_is_served(tmp_path):
    """int8 weights of the split parts are saved as compressed-tensors' packed `qkv_proj` / `gate_up_proj`
    (values and per-row scales concatenated), load back bit for bit, and transformers reads them with our
    logits; the folder is served through the openai client with the engine's tokens."""
    pytest.importorskip("openai")
    from served_greedy import assert_served_completion_is_greedy

    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open

    from staticformers import AutoTokenizer, TorchAoConfig
    from staticformers.models.quantization import QuantLinear
    from tiny import save_served

    folder = save_served("phi3", tmp_path / "base", positions=128)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=TorchAoConfig("int8_weight_only"))
    assert isinstance(model.model.layers[0].self_attn.k_proj, QuantLinear)
    saved = tmp_path / "q"
    model.save_pretrained(str(saved))
    tok.save_pretrained(str(saved))
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {
        "model.layers.0.self_attn.qkv_proj.weight_packed",
        "model.layers.0.self_attn.qkv_proj.weight_scale",
        "model.layers.0.mlp.gate_up_proj.weight_packed",
    } <= names
    assert not any(".q_proj." in n or ".up_proj." in n for n in names)
    again = AutoModelForCausalLM.from_pretrained(str(saved))
    mine, theirs = dict(model.named_parameters()), dict(again.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tol.assert_close(_hf(str(saved))(ids).logits, again(ids).logits)
    assert_served_completion_is_greedy(again, tok, str(saved), "Hello there", 6)
