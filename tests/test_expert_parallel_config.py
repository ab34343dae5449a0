"""DistributedConfig's expert-parallel rules (transformers'), each wrong combination refused with one
sentence, and the MoE config keys of config.json (both spellings, refusals, transformers loads ours)."""

from __future__ import annotations

import pytest

from staticformers import DistributedConfig
from staticformers.models.model_config import ModelConfig
from staticformers.models.config_checks import ConfigError
from staticformers.distributed.distributed_config import DistributedConfigError
from staticformers.distributed.parallelize import default_tp_plan

TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def qwen3_moe(**kw) -> ModelConfig:
    base = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
    )
    return ModelConfig.from_dict({**base, **kw})


def mixtral(**kw) -> ModelConfig:
    base = dict(
        architectures=["MixtralForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return ModelConfig.from_dict({**base, **kw})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"tp_size": 2, "fsdp_size": 2, "ep_size": 3}, "ep_size=3 is not a multiple of tp_size=2"),
        ({"fsdp_size": 2, "ep_size": 4}, "ep_size=4 does not divide fsdp_size \\* tp_size = 2"),
        ({"ep_size": 0}, "ep_size=0"),
        ({"ep_size": 2, "ep_implementation": "all_to_all"}, 'depend on the routing .* use "auto"'),
        ({"ep_size": 2, "ep_implementation": "fast"}, "ep_implementation='fast' is not one of"),
        ({"tp_size": 2, "ep_size": 4, "fsdp_size": 4, "ep_implementation": "all_reduce"}, "needs ep_size == tp_size"),
        ({"ep_size": 2, "ep_plan": {"model.layers.*.mlp.experts": "grouped_gemm"}}, "leave ep_plan=None"),
    ],
)
def test_wrong_expert_parallel_layouts_are_refused(kwargs, words):
    with pytest.raises(DistributedConfigError, match=words):
        DistributedConfig(**kwargs)


def test_efsdp_and_the_rule_against_the_resolved_world(monkeypatch):
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WORLD_SIZE", "8")
    layout = DistributedConfig(tp_size=2, ep_size=4).resolved()  # fsdp 4: 8 ranks, experts over 4, sharded over 2
    assert (layout.fsdp_size, layout.ep_size, layout.efsdp_size) == (4, 4, 2)
    assert DistributedConfig(fsdp_size=8, ep_size=8).resolved().efsdp_size == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedConfigError, match="ep_size=4 does not divide fsdp_size \\* tp_size = 2"):
        DistributedConfig(ep_size=4).resolved()  # fsdp_size filled in from the world, then checked


def test_models_expert_parallelism_cannot_split_are_refused():
    with pytest.raises(DistributedConfigError, match="8 experts per sparse layer, which ep_size=3 does not divide"):
        DistributedConfig(fsdp_size=3, ep_size=3).check_model(qwen3_moe())
    dense = ModelConfig.from_dict(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
    )
    with pytest.raises(DistributedConfigError, match="has none: drop ep_size"):
        DistributedConfig(fsdp_size=2, ep_size=2).check_model(dense)
    DistributedConfig(fsdp_size=4, ep_size=4).check_model(qwen3_moe())
    # tp checks the dense MLP's width only where a layer has one; Mixtral has none
    DistributedConfig(tp_size=2).check_model(mixtral(intermediate_size=97))
    with pytest.raises(DistributedConfigError, match="intermediate_size=97 is not divisible by tp_size=2"):
        DistributedConfig(tp_size=2).check_model(qwen3_moe(intermediate_size=97))


def test_the_tp_plan_has_dense_mlp_rules_only_where_a_layer_has_a_dense_mlp():
    assert "model.layers.*.mlp.gate_proj" in default_tp_plan(qwen3_moe())
    assert not any(".mlp." in k for k in default_tp_plan(mixtral()))


# ---------------------------------------------------------------------------------------------
# the MoE keys of config.json
# ---------------------------------------------------------------------------------------------
def test_both_count_spellings_and_the_layers_that_route():
    a = qwen3_moe()
    b = qwen3_moe(num_experts=None, num_local_experts=8)
    assert a.num_experts == b.num_experts == 8
    assert [a.layer_is_sparse(i) for i in range(3)] == [True, False, True]
    assert [qwen3_moe(mlp_only_layers=[], decoder_sparse_step=2).layer_is_sparse(i) for i in range(3)] == [
        False,
        True,
        False,
    ]
    m = mixtral()
    assert m.num_experts == 4 and m.moe_intermediate_size == 96 and m.norm_topk_prob  # Mixtral always renormalises
    assert m.rms_norm_eps == 1e-5 and m.rope_theta == 1e6  # Mixtral's defaults
    assert not m.qkv_bias and not mixtral(attention_bias=True).qkv_bias  # Mixtral's projections have no bias


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is more than the 8 experts"),
        ({"num_experts": 0}, "num_experts=0 must be a positive integer"),
        ({"mlp_only_layers": [5]}, "mlp_only_layers=\\[5\\] must be a list of layer indices from 0 to 2"),
        ({"router_aux_loss_coef": -1}, "router_aux_loss_coef=-1 must be a finite number"),
        ({"decoder_sparse_step": "2"}, "decoder_sparse_step='2' must be a positive integer"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes' must be true or false"),
    ],
)
def test_bad_moe_values_are_refused(kw, words):
    with pytest.raises(ConfigError, match=words):
        qwen3_moe(**kw)


@pytest.mark.parametrize("make", [qwen3_moe, mixtral])
def test_transformers_reads_what_we_write(make, tmp_path):
    import transformers

    ours = make(output_router_logits=True, router_aux_loss_coef=0.2)
    ours.save_pretrained(str(tmp_path))
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert theirs.num_experts == ours.num_experts and theirs.num_experts_per_tok == 2
    assert theirs.output_router_logits and theirs.router_aux_loss_coef == 0.2
    assert ModelConfig.from_json_file(str(tmp_path / "config.json")).to_dict() == ours.to_dict()
    if make is qwen3_moe:
        assert theirs.mlp_only_layers == [1] and theirs.moe_intermediate_size == 32 and theirs.norm_topk_prob is False
