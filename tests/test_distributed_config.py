"""DistributedConfig: every refused layout gets one sentence, checked in this process (no torchrun)."""

from __future__ import annotations

import pytest
import torch

from staticformers import DistributedConfig
from staticformers.models.model_config import ModelConfig
from staticformers.distributed.distributed_config import DistributedConfigError
from staticformers.distributed.parallelize import _matches, apply_tp, resolve_tp_plan

TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture
def torchrun_env(monkeypatch):
    """Pretend to be rank 0 of a torchrun job of `world` processes."""

    def set_world(world: int):
        for k, v in TORCHRUN_ENV.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("WORLD_SIZE", str(world))

    return set_world


@pytest.fixture
def plain_env(monkeypatch):
    for k in (*TORCHRUN_ENV, "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


def qwen3(**kw) -> ModelConfig:
    base = dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return ModelConfig.from_dict({**base, **kw})


def test_fsdp_size_fills_the_rest_of_the_world(torchrun_env):
    torchrun_env(8)
    layout = DistributedConfig(tp_size=2).resolved()
    assert (layout.dp_replicate_size, layout.fsdp_size, layout.tp_size) == (1, 4, 2)
    assert layout.dp_size == 4
    assert DistributedConfig(tp_size=2, dp_replicate_size=2).resolved().fsdp_size == 2


def test_sizes_must_multiply_to_world_size(torchrun_env):
    torchrun_env(4)
    with pytest.raises(DistributedConfigError, match=r"2 \* 4 \* 2 = 16 ranks, but torchrun started WORLD_SIZE=4"):
        DistributedConfig(tp_size=2, fsdp_size=4, dp_replicate_size=2).resolved()
    with pytest.raises(
        DistributedConfigError, match="WORLD_SIZE=4 is not divisible by tp_size \\* dp_replicate_size = 3"
    ):
        DistributedConfig(tp_size=3).resolved()


def test_more_than_one_rank_outside_torchrun_is_refused(plain_env):
    with pytest.raises(
        DistributedConfigError,
        match=r"asks for 4 processes, but this one runs alone .*"
        r"`torchrun --nproc_per_node=4",
    ):
        DistributedConfig(tp_size=2, fsdp_size=2).resolved()


def test_world_size_without_torchrun_variables_is_refused(plain_env, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        DistributedConfigError, match="RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT is not: launch with torchrun"
    ):
        DistributedConfig(tp_size=2).resolved()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"tp_size": 0}, "tp_size=0"),
        ({"fsdp_size": 1.5}, "fsdp_size=1.5"),
        ({"dp_replicate_size": True}, "dp_replicate_size=True"),
        ({"tp_plan": "colwise"}, 'neither "auto" nor a dict'),
        ({"tp_plan": {"lm_head": "diagonal"}}, "'diagonal' is not a style"),
        ({"fsdp_mixed_precision": "int8"}, "fsdp_mixed_precision='int8'"),
    ],
)
def test_bad_values_are_refused(kwargs, words):
    with pytest.raises(DistributedConfigError, match=words.replace("(", r"\(")):
        DistributedConfig(**kwargs)


def test_mixed_precision_spellings():
    assert DistributedConfig().param_dtype is None
    assert DistributedConfig(fsdp_mixed_precision=True).param_dtype is torch.bfloat16
    assert DistributedConfig(fsdp_mixed_precision="float16").param_dtype is torch.float16


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 2}, "num_attention_heads=6 is not divisible by tp_size=4"),
        ({}, "num_key_value_heads=2 is not divisible by tp_size=4"),
        ({"num_key_value_heads": 4, "intermediate_size": 130}, "intermediate_size=130 is not divisible by tp_size=4"),
    ],
)
def test_model_shapes_tp_cannot_split_are_refused(kw, words):
    with pytest.raises(DistributedConfigError, match=words):
        DistributedConfig(tp_size=4).check_model(qwen3(**kw))


def hybrid(architecture: str, **kw) -> ModelConfig:
    """A Qwen3.5 / Qwen3-Next config: three Gated DeltaNet layers (2 key heads, 4 value heads), one full layer."""
    base = dict(
        architectures=[architecture],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_num_value_heads=4,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    if architecture != "Qwen3_5ForCausalLM":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return ModelConfig.from_dict({**base, **kw})


def test_linear_attention_key_heads_tp_cannot_split_are_refused():
    config = hybrid("Qwen3_5ForCausalLM", num_key_value_heads=4, linear_num_key_heads=2, linear_num_value_heads=4)
    DistributedConfig(tp_size=2).check_model(config)
    with pytest.raises(
        DistributedConfigError,
        match=r"^Qwen3_5ForCausalLM cannot be split 4 ways: "
        r"linear_num_key_heads=2 is not divisible by tp_size=4; choose a "
        r"tp_size that divides them",
    ):
        DistributedConfig(tp_size=4).check_model(config)


@pytest.mark.parametrize("architecture", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"])
def test_hybrid_plans_split_every_linear_attention_module(architecture):
    """The auto plan's rules each match modules of the model (`_matches` refuses one that matches none), and every
    parameter of a Gated DeltaNet layer is in one of them."""
    from staticformers.models.decoder import CausalLM

    config = hybrid(architecture)
    with torch.device("meta"):
        model = CausalLM(config)
    chosen = _matches(resolve_tp_plan(config, DistributedConfig(tp_size=2)), model)
    layer = "model.layers.0.linear_attn"
    for name, _ in model.get_submodule(layer).named_parameters():
        module = f"{layer}.{name.rpartition('.')[0]}".rstrip(".")
        assert module in chosen, name
    fused = architecture == "Qwen3NextForCausalLM"
    assert chosen[f"{layer}.in_proj_qkvz" if fused else f"{layer}.in_proj_qkv.k"] == "colwise"
    assert (chosen[f"{layer}.conv1d.v"], chosen[layer], chosen[f"{layer}.out_proj"]) == (
        "channels",
        "value_heads",
        "rowwise",
    )


@pytest.mark.parametrize("architecture", ["Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"])
def test_a_linear_attention_layer_cut_as_the_plan_says_sums_to_the_whole(architecture):
    """Two ranks' shares of a Gated DeltaNet layer (3 value heads of 8 per key head of 16, so the query, key and value
    parts differ in size), each parameter cut as its rule's style says (colwise and the per-head styles by rows,
    rowwise by columns, the gated norm whole), read their head counts from their tensors: their outputs (out_proj's
    partial sums) add up to the whole layer's."""
    import copy

    from torch import nn

    from staticformers.models.decoder import CausalLM

    config = hybrid(architecture, linear_num_value_heads=6)
    torch.manual_seed(0)
    model = CausalLM(config)
    whole = model.model.layers[0].linear_attn
    with torch.no_grad():
        for p in (whole.A_log, whole.dt_bias, whole.norm.weight):
            p.normal_()
    chosen = _matches(resolve_tp_plan(config, DistributedConfig(tp_size=2)), model)
    at = "model.layers.0.linear_attn"
    dims = {"colwise": 0, "channels": 0, "value_heads": 0, "rowwise": 1}
    x = torch.randn(2, 5, 64)
    total = 0
    for rank in range(2):
        share = copy.deepcopy(whole)
        for name, style in chosen.items():
            if name != at and not name.startswith(at + "."):
                continue
            module = share.get_submodule(name[len(at) + 1 :])
            for key, p in list(module.named_parameters(recurse=False)):
                if style in dims:
                    module._parameters[key] = nn.Parameter(p.detach().chunk(2, dims[style])[rank].clone())
        assert share.conv_weight().shape[0] == whole.conv_weight().shape[0] // 2
        total = total + share(x)
    torch.testing.assert_close(total, whole(x))


def test_vocabulary_tp_does_not_divide(caplog):
    config = qwen3(num_key_value_heads=4, vocab_size=130)
    DistributedConfig(tp_size=4).check_model(config)  # auto plan: keeps them whole
    plan = resolve_tp_plan(config, DistributedConfig(tp_size=4))
    assert plan["model.embed_tokens"] == plan["lm_head"] == "replicate"
    assert "vocab_size=130 is not divisible by tp_size=4" in caplog.text
    with pytest.raises(DistributedConfigError, match="splits the vocabulary, but vocab_size=130"):
        DistributedConfig(tp_size=4, tp_plan={"lm_head": "vocab", "model.embed_tokens": "vocab"}).check_model(config)


def test_family_plans():
    from staticformers.distributed.parallelize import default_tp_plan

    plan = default_tp_plan(qwen3())
    assert plan["model.layers.*.self_attn.q_norm"] == "heads"
    assert plan["model.layers.*.self_attn.o_proj"] == plan["model.layers.*.mlp.down_proj"] == "rowwise"
    llama = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    assert not any(style == "heads" for style in default_tp_plan(llama).values())


def test_plan_rules_must_match_modules_and_tied_weights_share_a_style():
    from staticformers.models.decoder import CausalLM

    with torch.device("meta"):
        model = CausalLM(qwen3())
    with pytest.raises(DistributedConfigError, match="rule 'model.layers.*.attn.q' matches no module"):
        _matches({"model.layers.*.attn.q": "colwise"}, model)
    with pytest.raises(DistributedConfigError, match="share one weight .* give both the same"):
        apply_tp(model, None, {"model.embed_tokens": "vocab", "lm_head": "replicate"})


def test_from_pretrained_refuses_many_ranks_in_a_plain_process(plain_env, tiny_checkpoints):
    from staticformers import AutoModelForCausalLM

    with pytest.raises(DistributedConfigError, match="not started by torchrun"):
        AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"), distributed_config=DistributedConfig(tp_size=2))


def test_one_rank_config_in_a_plain_process_loads_whole(plain_env, tiny_checkpoints):
    from staticformers import AutoModelForCausalLM

    path = tiny_checkpoints("qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig())
    plain = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_the_sinks_style_on_a_module_without_sinks_is_one_sentence():
    from torch import nn

    from staticformers.distributed.parallelize import HeadsParameter

    with pytest.raises(
        DistributedConfigError,
        match=r"tp_plan style 'sinks' shards a module's per-head `sinks`, but "
        r"the Linear it was given has none: give it to attention modules",
    ):
        HeadsParameter("sinks")._apply(nn.Linear(2, 2), None)
