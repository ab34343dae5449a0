"""DeepSeek-V3 against transformers 5.23: multi-head latent attention (q LoRA or one q_proj, kv LoRA, RoPE on a
decoupled part, interleaved or not, YaRN with mscale_all_dim), the group-limited sigmoid routing with its
correction bias and scaling, the shared experts, the first dense layers; the latent cache (its bytes per token
are the latent's, asserted), greedy tokens through the engine, chunked prefill, prefix caching, the checkpoint
round trip, LoRA against peft, int8, the tensor-parallel plan, and what it refuses.

The tiny models (tests/tiny.py "deepseek-v3", "deepseek-v3-plain") keep every switch on between them. Their
logits, greedy tokens and speculative decoding are also proven by the files parametrized over FAMILIES
(test_modeling.py, test_generation.py, test_speculative.py), and the first one's router logits, gradients and
left-padded greedy batches by those over MOE_FAMILIES (test_moe.py, test_moe_generation.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig
from staticformers.models.model_config import ModelConfig
from family_checks import (
    assert_bf16_logits_agree,
    assert_saved_as_loaded,
    chunked_and_prefix_cached_run,
    hf_model,
    padded_batch,
)
import tolerances as tol
from tiny import DEEPSEEK_FAMILIES

transformers = pytest.importorskip("transformers")


_hf = hf_model


def _inputs(seq=12, seed=1):
    return padded_batch(seq, (0, 4, 7), seed)


# ---------------------------------------------------------------------------------------------
# the configuration
# ---------------------------------------------------------------------------------------------
def test_config_defaults_and_round_trip_follow_transformers(tiny_checkpoints):
    raw = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
    }
    ours, ref = ModelConfig.from_dict(raw), transformers.DeepseekV3Config(**raw)
    for key in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "n_shared_experts",
        "first_k_dense_replace",
        "norm_topk_prob",
        "rope_interleave",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "head_dim",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.num_experts == ref.n_routed_experts == 256
    assert [ours.layer_is_sparse(i) for i in range(4)] == [False, False, False, True]  # first_k_dense_replace=3
    config = ModelConfig.from_pretrained(tiny_checkpoints("deepseek-v3"))
    again = ModelConfig.from_dict(config.to_dict())
    assert again == config
    assert transformers.DeepseekV3Config(**config.to_dict()).to_dict()["n_routed_experts"] == 8


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"n_group": 3}, r"n_routed_experts=8 is not a multiple of n_group=3"),
        ({"topk_group": 5}, r"topk_group=5 is more than n_group=4"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 is more than the 4 experts of the topk_group=2 groups"),
        ({"n_group": 8, "topk_group": 2}, r"n_group=8 leaves fewer than 2 experts per group"),
        ({"qk_rope_head_dim": 15}, r"qk_rope_head_dim=15 is odd"),
        ({"first_k_dense_replace": 9}, r"first_k_dense_replace=9 is more than the 3 layers"),
        ({"kv_lora_rank": 0}, r"kv_lora_rank"),
    ],
)
def test_a_bad_key_is_one_sentence(tiny_checkpoints, bad, message):
    from staticformers.models.config_checks import ConfigError

    raw = json.load(open(os.path.join(tiny_checkpoints("deepseek-v3"), "config.json")))
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**raw, **bad})


# ---------------------------------------------------------------------------------------------
# the architecture
# ---------------------------------------------------------------------------------------------
def test_grouped_routing_equals_transformers_router():
    """`route_grouped` against transformers' DeepseekV3TopkRouter on logits that make the groups matter."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from staticformers.models.moe import route_grouped

    config = transformers.DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    x = torch.randn(64, 16, generator=g)
    logits, want_w, want_e = router(x)
    w, e = route_grouped(logits, router.e_score_correction_bias, 4, 4, 2, True, 2.5)
    order, want_order = e.sort(-1), want_e.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices))
    # the groups matter: without the limit some token would pick another expert
    free, _ = route_grouped(logits, router.e_score_correction_bias, 4, 1, 1, True, 2.5)[1].sort(-1), None
    assert not torch.equal(free.values, order.values)


@pytest.mark.parametrize("family", DEEPSEEK_FAMILIES)
def test_logits_parameters_and_the_latent_cache(tiny_checkpoints, family):
    """Logits of a left-padded batch equal transformers'; the parameter count; the cache holds the latent
    (`kv_lora_rank + qk_rope_head_dim` values a position and layer), not `heads * (key + value)` dims."""
    from staticformers.models.kv_cache import KVCache, bytes_per_position

    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    assert ours.num_parameters() == ref.num_parameters() == ours.config.num_parameters
    ids, mask = _inputs()
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        want = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    tol.assert_close(got, want)
    c = ours.config
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    cache = KVCache.for_model(ours, batch=2, max_length=64)
    assert cache.nbytes == 2 * 64 * c.num_hidden_layers * latent * 4 == KVCache.bytes_for(ours, 2, 64)
    assert bytes_per_position(c, torch.float32) == c.num_hidden_layers * latent * 4
    expanded = (
        c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 4
    )
    assert bytes_per_position(c, torch.float32) < expanded / 2
    assert cache.values == [] and [tuple(k.shape) for k in cache.keys] == [(2, 1, 64, latent)] * c.num_hidden_layers


def test_bf16_logits_close_and_top1_agrees(tiny_checkpoints):
    path = tiny_checkpoints("deepseek-v3")
    gate = AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16").model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    assert_bf16_logits_agree(path, *_inputs())


# ---------------------------------------------------------------------------------------------
# generation through the engine
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, backend", [("deepseek-v3", "aot_eager"), ("deepseek-v3-plain", "eager")])
def test_greedy_tokens_equal_transformers(tiny_checkpoints, family, backend):
    """Batch 1 (64 new tokens, through Dynamo's graphs) and a left-padded mixed batch (uncompiled; compiled:
    test_moe_generation.py), equal to transformers'."""
    from staticformers import ShapePlan
    from staticformers.generation.engines import engine_for

    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    engine_for(ours, ShapePlan(batch_sizes=[1, 4], prompt_lengths=[16], kv_lengths=[96], max_model_len=96))
    one = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    want = ref.generate(one, max_new_tokens=64, **kw)
    assert torch.equal(ours.generate(one, max_new_tokens=64, compile_config=CompileConfig(backend=backend), **kw), want)
    assert len(set(want[0, 9:].tolist())) > 3  # a model that says something, not one token over and over
    ids, mask = _inputs(seq=13, seed=5)
    kw.update(attention_mask=mask, max_new_tokens=16)
    assert torch.equal(ours.generate(ids, disable_compile=True, **kw), ref.generate(ids, **kw))


def test_chunked_prefill_and_prefix_caching_equal_transformers(tiny_checkpoints):
    """Rows that join and leave: a long prompt prefilled in chunks of 16 through the extend step over the latent
    cache, a second one whose first 40 tokens come from the prefix cache (the latent's blocks)."""
    loop = chunked_and_prefix_cached_run(tiny_checkpoints("deepseek-v3"))
    assert loop.prefix.values == [] and loop.prefix.keys[0].shape[-1] == 32 + 16  # the pool holds latents


# ---------------------------------------------------------------------------------------------
# checkpoints, adapters, int8
# ---------------------------------------------------------------------------------------------
def test_save_loads_in_transformers_with_the_same_logits(tiny_checkpoints, tmp_path):
    """Ours saves the Hub's layout (one tensor per expert, the correction bias in float32), bit-equal."""
    from safetensors import safe_open

    saved, original = assert_saved_as_loaded(tiny_checkpoints("deepseek-v3"), tmp_path, *_inputs())
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as b:
        assert b.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    for key in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "n_shared_experts",
        "first_k_dense_replace",
        "n_routed_experts",
        "rope_interleave",
        "rope_parameters",
    ):
        assert saved[key] == original[key], key


LATENT = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]


def test_lora_equals_peft_both_ways_and_kv_b_proj_is_refused(tiny_checkpoints, tmp_path):
    from peft_both_ways import assert_lora_equals_peft_both_ways
    from staticformers import LoraConfig
    from staticformers.adapters.lora_config import AdapterConfigError

    path = tiny_checkpoints("deepseek-v3")
    ids, mask = _inputs()
    assert_lora_equals_peft_both_ways(path, "deepseek-v3", LATENT, tmp_path, ids, mask)
    with pytest.raises(
        AdapterConfigError,
        match=r"selects model\.layers\.0\.self_attn\.kv_b_proj, which latent "
        r"attention never runs as a projection .* exclude_modules=\['kv_b_proj'\]",
    ):
        AutoModelForCausalLM.from_pretrained(path).add_adapter(LoraConfig(r=4, target_modules="all-linear"))
    mine = AutoModelForCausalLM.from_pretrained(path)
    mine.add_adapter(LoraConfig(r=4, target_modules="all-linear", exclude_modules=["kv_b_proj"]))


def test_int8_weights_greedy_equals_its_dequantised_model(tiny_checkpoints):
    """int8 weights (kv_b_proj's absorbed through its dequantised matrix): the engine's greedy tokens equal
    those of the same model with every int8 weight dequantised back to float32."""
    from staticformers import QuantizationConfig
    from staticformers.models.quantization import QuantLinear

    path = tiny_checkpoints("deepseek-v3")
    q = AutoModelForCausalLM.from_pretrained(path, quantization_config=QuantizationConfig("int8_weight_only"))
    assert isinstance(q.model.layers[0].self_attn.kv_b_proj, QuantLinear)
    ref = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for name, module in q.named_modules():
            if isinstance(module, QuantLinear):
                ref.get_submodule(name).weight.copy_(module.dequantized())
            elif getattr(module, "quantized", None):
                for w in ("gate_up_proj", "down_proj"):
                    getattr(ref.get_submodule(name), w).copy_(
                        getattr(module, w).float() * getattr(module, w + "_scale")
                    )
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    kw = dict(
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        compile_config=CompileConfig(backend="eager"),
    )
    assert torch.equal(q.generate(ids, **kw), ref.generate(ids, **kw))


def test_the_tensor_parallel_plan_splits_the_heads_and_keeps_the_latent_whole(tiny_checkpoints):
    """The runs themselves: tests/test_distributed_families.py (TP=2 and EP=2 against one process)."""
    from staticformers.distributed.distributed_config import DistributedConfig, DistributedConfigError
    from staticformers.distributed.parallelize import default_tp_plan
    from staticformers.models.kv_cache import layout

    config = ModelConfig.from_pretrained(tiny_checkpoints("deepseek-v3"))
    DistributedConfig(tp_size=2).check_model(config)
    DistributedConfig(fsdp_size=2, ep_size=2).check_model(config)
    plan = default_tp_plan(config)
    assert {k.rsplit(".", 1)[-1]: v for k, v in plan.items() if ".self_attn." in k} == {
        "q_b_proj": "colwise",
        "kv_b_proj": "colwise",
        "shared_latent": "latent",
        "o_proj": "rowwise",
    }
    assert layout(config, tp=2) == layout(config) == (1, 32 + 16, 32)  # every rank caches the whole latent
    with pytest.raises(DistributedConfigError, match=r"num_attention_heads=4 is not divisible by tp_size=8"):
        DistributedConfig(tp_size=8).check_model(config)
