"""Qwen3.5 (text) and Qwen3-Next against transformers 5.23: the gated delta rule (chunked and recurrent forms, the
causal convolution, padded positions), Gated DeltaNet layers among gated full-attention ones, logits for prompts
shorter and longer than the DeltaNet chunk, greedy tokens over 64 new tokens at batch 1 and in batches whose
rows join and leave, the per-request state (its size independent of the prompt's length, asserted), bf16,
LoRA against peft, gradients, the checkpoint round trip, and what it refuses.

The tiny model (tests/tiny.py "qwen3_5"): three linear-attention layers (2 key heads of 16, 4 value heads of
8, kernel 4), then one gated full-attention layer with a quarter of each head rotating; "qwen3_5-moe" the same
with every MLP a mixture of 4 experts (top-2) beside a gated shared expert (its router logits, gradients and greedy
tokens in the files parametrized over MOE_FAMILIES: test_moe.py, test_moe_generation.py). "qwen3-next" (Qwen3-Next)
is "qwen3_5-moe" with the DeltaNet projections stored fused (`in_proj_qkvz`, `in_proj_ba`), layer 1's MLP dense, the
top-k weights not renormalised and attention biases: the logits, greedy tokens, joining rows, checkpoint round trip
and LoRA tests here run it too, and its fused projections, config and checkpoint checks have their own section."""

from __future__ import annotations


import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig
from staticformers.models.model_config import ModelConfig
from staticformers.models.ops import PLAIN
from family_checks import assert_bf16_logits_agree, assert_saved_as_loaded, hf_model, padded_batch
import tolerances as tol
from tiny import LINEAR_FAMILIES

transformers = pytest.importorskip("transformers")


_hf = hf_model


def _inputs(seed=1):
    """Left-padded rows: 70 tokens (past the chunk of 64), 60 and 30."""
    return padded_batch(70, (0, 10, 40), seed)


# ---------------------------------------------------------------------------------------------
# the gated delta rule
# ---------------------------------------------------------------------------------------------
def _delta_inputs(seed=0, b=2, s=37, key_heads=2, heads=4, dk=16, dv=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, s, key_heads, dk, generator=g),
        torch.randn(b, s, key_heads, dk, generator=g),
        torch.randn(b, s, heads, dv, generator=g),
        -torch.rand(b, s, heads, generator=g),
        torch.rand(b, s, heads, generator=g),
        torch.randn(b, heads, dk, dv, generator=g),
    )


def test_both_forms_equal_transformers_reference_functions():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    from staticformers.models.gated_delta import chunked_gated_delta, recurrent_gated_delta

    q, k, v, g, beta, state = _delta_inputs()
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want, want_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, **kw)
    got, got_state = chunked_gated_delta(q, k, v, g, beta, state, chunk_size=16)
    tol.assert_close(got, want)
    tol.assert_close(got_state, want_state)
    want, want_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    got, got_state = recurrent_gated_delta(q, k, v, g, beta, state)
    tol.assert_close(got, want)
    tol.assert_close(got_state, want_state)
    tol.assert_close(chunked_gated_delta(q, k, v, g, beta, state, chunk_size=16)[1], got_state)  # the forms agree


def test_positions_that_are_not_there_change_no_state():
    """A row padded after its 20 tokens, another padded before its last 25: states and outputs as if the
    padding were not there; the conv state is the last inputs up to each row's last real token (and, in a one-token
    step, the state of a row that does not count its token is left as it was)."""
    from staticformers.models.gated_delta import causal_conv, chunked_gated_delta, recurrent_gated_delta

    q, k, v, g, beta, state = _delta_inputs()
    valid = torch.ones(2, 37, dtype=torch.bool)
    valid[0, 20:] = False
    valid[1, :12] = False
    out, final = chunked_gated_delta(q, k, v, g, beta, state, valid, chunk_size=16)
    alone, alone_state = recurrent_gated_delta(q[:1, :20], k[:1, :20], v[:1, :20], g[:1, :20], beta[:1, :20], state[:1])
    tol.assert_close(final[:1], alone_state)
    tol.assert_close(out[:1, :20], alone)
    tail, tail_state = recurrent_gated_delta(q[1:, 12:], k[1:, 12:], v[1:, 12:], g[1:, 12:], beta[1:, 12:], state[1:])
    tol.assert_close(final[1:], tail_state)
    tol.assert_close(out[1:, 12:], tail)
    gx = torch.Generator().manual_seed(1)
    x, w, conv = (
        torch.randn(2, 12, 37, generator=gx),
        torch.randn(12, 4, generator=gx),
        torch.randn(2, 12, 3, generator=gx),
    )
    y, new = causal_conv(x, w, conv, valid)
    y0, new0 = causal_conv(x[:1, :, :20], w, conv[:1])
    torch.testing.assert_close(new[:1], new0)
    torch.testing.assert_close(y[:1, :, :20], y0)
    torch.testing.assert_close(new[1:], x[1:, :, -3:])  # the row's last three inputs
    # one token per row (a decode step): the row that counts it moves its window on, the other keeps its own
    step = torch.tensor([[True], [False]])
    y1, new1 = causal_conv(x[:, :, :1], w, conv, step)
    y1_alone, new1_alone = causal_conv(x[:1, :, :1], w, conv[:1])
    torch.testing.assert_close(new1[:1], new1_alone)
    torch.testing.assert_close(y1[:1], y1_alone)
    torch.testing.assert_close(new1[1:], conv[1:])


# ---------------------------------------------------------------------------------------------
# the configuration
# ---------------------------------------------------------------------------------------------
def test_config_defaults_round_trip_and_refusals(tiny_checkpoints):
    from staticformers.models.config_checks import ConfigError

    raw = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    ours, ref = ModelConfig.from_dict(raw), transformers.Qwen3_5TextConfig(**raw)
    assert (
        ours.layer_types
        == ref.layer_types
        == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    )
    for key in (
        "linear_num_key_heads",
        "linear_key_head_dim",
        "linear_num_value_heads",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "head_dim",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"] == 0.25
    config = ModelConfig.from_pretrained(tiny_checkpoints("qwen3_5"))
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(
        ConfigError,
        match=r"layer_types ends with a 'linear_attention' layer: staticformers runs "
        r"hybrid models whose last layer is full attention",
    ):
        ModelConfig.from_dict({**raw, "layer_types": ["full_attention"] * 7 + ["linear_attention"]})
    with pytest.raises(ConfigError, match=r"linear_num_value_heads=6 is not a multiple of linear_num_key_heads=4"):
        ModelConfig.from_dict({**raw, "linear_num_key_heads": 4, "linear_num_value_heads": 6})


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_logits_parameters_and_a_state_of_fixed_size(tiny_checkpoints, family):
    """Left-padded rows longer and shorter than the chunk: logits equal transformers' (Qwen3.5 and Qwen3.5-MoE, whose
    every MLP routes to experts beside a gated shared expert). A linear layer's state is the same size whatever
    the cache's length; only the full-attention layer grows with it."""
    from staticformers.models.kv_cache import KVCache, bytes_per_position, state_bytes_per_row

    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    assert ours.num_parameters() == ref.num_parameters() == ours.config.num_parameters
    mlps = {"qwen3_5": ["dense"] * 4, "qwen3_5-moe": ["moe"] * 4, "qwen3-next": ["moe", "dense", "moe", "moe"]}[family]
    assert [layer.kind for layer in ours.model.layers] == [(None, m, "linear") for m in mlps[:3]] + [(None, mlps[3])]
    ids, mask = _inputs()
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        want = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    tol.assert_close(got, want)
    c = ours.config
    short, long = KVCache.for_model(ours, 2, 64), KVCache.for_model(ours, 2, 4096)
    for i in range(3):
        assert short.keys[i].shape == long.keys[i].shape == (2, 2 * 32 + 32, 3)  # the conv's last 3 inputs
        assert short.values[i].shape == long.values[i].shape == (2, 4, 16, 8) and long.values[i].dtype == torch.float32
    state = 3 * ((2 * 32 + 32) * 3 * 4 + 4 * 16 * 8 * 4)
    assert state_bytes_per_row(c, torch.float32) == state
    assert bytes_per_position(c, torch.float32) == 2 * 2 * 16 * 4  # the one full-attention layer's keys and values
    assert KVCache.bytes_for(ours, 2, 4096) - KVCache.bytes_for(ours, 2, 64) == 2 * (4096 - 64) * 2 * 2 * 16 * 4
    assert long.nbytes == KVCache.bytes_for(ours, 2, 4096)


def test_bf16_logits_close_and_top1_agrees(tiny_checkpoints):
    path = tiny_checkpoints("qwen3_5")
    assert_bf16_logits_agree(path, *_inputs())


def test_gradients_as_close_to_float64_as_transformers(tiny_checkpoints):
    """The loss equals transformers'; every gradient is as close to transformers' float64 gradient as its float32
    one is (within twice its error, or 1e-5 of the parameter's gradient scale, or float32's epsilon of the model's
    largest gradient): some parameters' gradients (the decay's) are sums that cancel, which float32 rounds
    differently in either order and on either vector width."""
    path = tiny_checkpoints("qwen3_5")
    ours, ref, exact = AutoModelForCausalLM.from_pretrained(path), _hf(path), _hf(path, torch.float64)
    ids, _ = _inputs(seed=2)  # unpadded: a padded row's fully masked queries are opened differently (unused)
    losses = []
    for model in (ours, ref, exact):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach()))
    assert losses[0] == pytest.approx(losses[1], rel=tol.FP32_REORDERED)
    from staticformers.checkpoints.names import CheckpointNames

    theirs, want = dict(ref.named_parameters()), dict(exact.named_parameters())
    # in transformers' names: in_proj_qkv's and conv1d's parts (held apart, linear_attention.py) joined
    grads = CheckpointNames(fused=ours.config.family.fused_names).to_hub(
        {n: p.grad for n, p in ours.named_parameters()}
    )
    assert set(grads) == set(want)
    # a gradient that is a sum cancelling to far below its terms carries their rounding: float32's epsilon of the
    # model's largest gradient (on an AVX2-only CPU the decay's gradients in layer 2 are 2.2x transformers' error, at a
    # fifth of this floor; zeroing the smallest gradient, layer 0's dt_bias, would be 16x it)
    floor = torch.finfo(torch.float32).eps * max(float(p.grad.abs().max()) for p in want.values())
    for name, grad in grads.items():
        e = want[name].grad
        ours_err = float((grad.double() - e).abs().max())
        their_err = float((theirs[name].grad.double() - e).abs().max())
        assert ours_err <= 2 * their_err + max(1e-5 * float(e.abs().max()), floor), (name, ours_err, their_err)
    assert float(ours.model.layers[0].linear_attn.A_log.grad.abs().max()) > 0


# ---------------------------------------------------------------------------------------------
# generation through the engine
# ---------------------------------------------------------------------------------------------
# Qwen3.5-MoE's greedy tokens: test_moe_generation.py, which also runs Qwen3-Next's compiled regions (so its steps
# are eager here, which saves their compilation)
STEPS = [("qwen3_5", True), ("qwen3-next", False)]


@pytest.mark.parametrize("family, compiled", STEPS)
def test_greedy_tokens_equal_transformers(tiny_checkpoints, family, compiled):
    """64 new tokens at batch 1, prompts shorter and longer than the chunk, through Dynamo's graphs per layer
    region (or eager steps); a left-padded mixed batch."""
    from staticformers import ShapePlan
    from staticformers.generation.engines import engine_for

    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    engine_for(ours, ShapePlan(batch_sizes=[1, 4], prompt_lengths=[16, 80], kv_lengths=[160], max_model_len=160))
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    said = set()
    for n in (9, 70):
        one = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n))
        want = ref.generate(one, max_new_tokens=64, **kw)
        run = {"compile_config": CompileConfig(backend="aot_eager")} if compiled else {"disable_compile": True}
        assert torch.equal(ours.generate(one, max_new_tokens=64, **run, **kw), want), n
        said |= set(want[0, n:].tolist())
    assert len(said) > 3  # the model says something, not one token over and over
    ids = torch.randint(3, 128, (3, 13), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :7] = 0, 0
    kw.update(attention_mask=mask, max_new_tokens=16)
    assert torch.equal(ours.generate(ids, disable_compile=True, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("family, compiled", STEPS)
def test_rows_join_and_leave_with_their_own_state(tiny_checkpoints, family, compiled):
    """Requests join a running batch at different steps (their states inserted into free slots, the batch moving
    to a larger bucket) and leave at different lengths: each equals transformers' greedy tokens alone."""
    from loop_driver import run_loop
    from staticformers import ShapePlan
    from staticformers.generation.engines import compile_settings, engine_for
    from staticformers.generation.generation_config import GenerationConfig
    from staticformers.generation.loop import GenerationLoop, GenerationRequest

    path = tiny_checkpoints(family)
    model, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    engine = engine_for(
        model, ShapePlan(batch_sizes=[1, 2, 4], prompt_lengths=[16, 80], kv_lengths=[128], max_model_len=128)
    )
    settings = (
        compile_settings(model, GenerationConfig(), CompileConfig(backend="eager"))
        if compiled
        else compile_settings(model, GenerationConfig(disable_compile=True))
    )
    g = torch.Generator().manual_seed(7)
    prompts = {
        name: torch.randint(3, 128, (n,), generator=g).tolist()
        for name, n in (("a", 12), ("b", 70), ("c", 5), ("d", 33))
    }
    new = {"a": 20, "b": 6, "c": 14, "d": 9}
    loop = GenerationLoop(engine, settings)
    out = run_loop(
        loop,
        {
            0: [GenerationRequest(prompts["a"], new["a"], request_id="a")],
            3: [
                GenerationRequest(prompts["b"], new["b"], request_id="b"),
                GenerationRequest(prompts["c"], new["c"], request_id="c"),
            ],
            9: [GenerationRequest(prompts["d"], new["d"], request_id="d")],
        },
    )
    for name, prompt in prompts.items():
        want = ref.generate(
            torch.tensor([prompt]), max_new_tokens=new[name], do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert out[name] == want, name


# ---------------------------------------------------------------------------------------------
# checkpoints and adapters
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3-next"])
def test_save_loads_in_transformers_with_the_same_logits(tiny_checkpoints, tmp_path, family):
    saved, original = assert_saved_as_loaded(tiny_checkpoints(family), tmp_path, *_inputs())
    keys = (
        "layer_types",
        "linear_num_key_heads",
        "linear_key_head_dim",
        "linear_num_value_heads",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "head_dim",
        "model_type",
    )
    if family == "qwen3-next":  # the keys Qwen3.5-MoE has no use for: its layers are all sparse, always renormalised
        keys += (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "attention_bias",
        )
    for key in keys:
        assert saved[key] == original[key], key
    assert saved["rope_parameters"]["partial_rotary_factor"] == 0.25


TARGETS = {
    "qwen3_5": ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "v_proj", "o_proj"],
    "qwen3-next": ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "v_proj", "o_proj"],
}  # PEFT's names


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3-next"])
def test_lora_equals_peft_both_ways(tiny_checkpoints, tmp_path, family):
    from peft_both_ways import assert_lora_equals_peft_both_ways

    ids, mask = _inputs()
    assert_lora_equals_peft_both_ways(tiny_checkpoints(family), family, TARGETS[family], tmp_path, ids, mask)


def test_compiled_training_steps_as_eager_with_a_region_for_the_linear_layers(tiny_checkpoints, tmp_path):
    """The Trainer: compiled regions (the linear layers' and the full layer's, the head) train as eager does, and
    the linear layers' decay parameters learn."""
    from staticformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(1, 128, (int(n),), generator=g).tolist()}
        for n in torch.randint(3, 30, (16,), generator=g)
    ]
    runs = {}
    for compiled in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3_5"))
        before = model.model.layers[0].linear_attn.A_log.detach().clone()
        args = TrainingArguments(
            output_dir=str(tmp_path / str(compiled)),
            max_length=32,
            per_device_train_batch_size=4,
            max_steps=3,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            learning_rate=2e-3,
            seed=0,
            torch_compile=compiled,
            torch_compile_backend="aot_eager" if compiled else None,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        runs[compiled] = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
        if compiled:
            assert sorted(f.name for f in trainer.train_step.functions.values()) == [
                "head_loss_train",
                "layer_forward_train",
                "layer_forward_train_linear",
            ]
        assert not torch.equal(model.model.layers[0].linear_attn.A_log.detach(), before)
    assert len(runs[True]) == 3 and runs[True] == pytest.approx(runs[False], rel=tol.FP32_TRAINED)


# ---------------------------------------------------------------------------------------------
# Qwen3-Next: the fused projections, its config, its checkpoints' multi-token-prediction head
# ---------------------------------------------------------------------------------------------
def test_fused_projections_reorder_as_transformers_does():
    """transformers' layer's weights load into ours by their own names (`in_proj_qkvz`, `in_proj_ba`; its `conv1d`
    into our three parts through the family's checkpoint names), and our reordered projections are transformers'
    `fix_query_key_value_ordering` (2 value heads per key head)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from staticformers.checkpoints.names import names_for
    from staticformers.models.fused_delta_net import FusedGatedDeltaNet
    from tiny import hf_config

    hf = hf_config("qwen3-next")
    torch.manual_seed(0)
    theirs = Qwen3NextGatedDeltaNet(hf, 0)
    for p in theirs.parameters():
        torch.nn.init.normal_(p)
    config = ModelConfig.from_dict(hf.to_dict())
    ours = FusedGatedDeltaNet(config, 0)
    at = "model.layers.0.linear_attn."
    read = {at + k: v for k, v in theirs.state_dict().items()}
    names = names_for(config)
    layout = names.layout({at + k: tuple(v.shape) for k, v in ours.state_dict().items()}, read)
    held = names.assemble(layout, read)
    back = names.to_hub(held)  # and back under transformers' names, as saving writes them
    assert set(back) == set(read) and all(torch.equal(back[k], read[k]) for k in read)
    ours.load_state_dict({k[len(at) :]: v for k, v in held.items()})
    assert torch.equal(ours.conv_weight(), theirs.conv1d.weight)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        q, k, v, z, b, a = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(x), theirs.in_proj_ba(x))
        mixed, got_z, got_b, got_a = ours.projections(x, PLAIN)
    torch.testing.assert_close(mixed, torch.cat([t.reshape(2, 5, -1) for t in (q, k, v)], -1), rtol=0, atol=0)
    torch.testing.assert_close(got_z, z.reshape(2, 5, -1), rtol=0, atol=0)
    torch.testing.assert_close((got_b, got_a), (b, a), rtol=0, atol=0)
    assert not hasattr(ours, "in_proj_qkv") and sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for p in theirs.parameters()
    )
    torch.manual_seed(3)
    ours.reset_parameters()  # transformers' init (`_init_weights`): dt_bias ones, A_log = log U(0.01, 16)
    torch.manual_seed(3)
    assert torch.equal(ours.A_log.detach(), torch.empty(4).uniform_(0.01, 16).log_())
    assert torch.equal(ours.dt_bias.detach(), torch.ones(4))


def test_qwen3_next_config_defaults_dense_layers_round_trip_and_refusals():
    """Without the optional keys, transformers' defaults (2 KV heads, head_dim 256, 512 experts top-10 renormalised,
    a quarter of each head rotating, every fourth layer full); the sparse layers follow decoder_sparse_step and
    mlp_only_layers as in transformers; what we write, transformers reads the same; a bad value is one sentence."""
    from staticformers.models.config_checks import ConfigError

    raw = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
    }
    ours, ref = ModelConfig.from_dict(raw), transformers.Qwen3NextConfig(**raw)
    for key in (
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "linear_num_key_heads",
        "linear_key_head_dim",
        "linear_num_value_heads",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "layer_types",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"] == 0.25
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    mixed = ModelConfig.from_dict(
        {**raw, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": False, "full_attention_interval": 2}
    )
    assert [mixed.layer_is_sparse(i) for i in range(8)] == [False, True, False, False, False, True, False, True]
    back = transformers.Qwen3NextConfig(**{k: v for k, v in mixed.to_dict().items() if k != "architectures"})
    for key in (
        "decoder_sparse_step",
        "mlp_only_layers",
        "norm_topk_prob",
        "layer_types",
        "num_key_value_heads",
        "shared_expert_intermediate_size",
    ):
        assert getattr(back, key) == getattr(mixed, key), key
    assert ModelConfig.from_dict(mixed.to_dict()) == mixed
    with pytest.raises(
        ConfigError,
        match=r"config.json: linear_num_value_heads=6 is not a multiple of "
        r"linear_num_key_heads=4: each key head serves as many value heads\.$",
    ):
        ModelConfig.from_dict({**raw, "linear_num_key_heads": 4, "linear_num_value_heads": 6})
    with pytest.raises(
        ConfigError,
        match=r"layer_types ends with a 'linear_attention' layer: .* \(as Qwen3\.5's and "
        r"Qwen3-Next's are\)\.$",
    ):
        ModelConfig.from_dict({**raw, "full_attention_interval": 3})  # layers 2 and 5 full, 7 linear
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[8\] must be a list of layer indices from 0 to 7\.$"):
        ModelConfig.from_dict({**raw, "mlp_only_layers": [8]})
    with pytest.raises(
        ConfigError,
        match=r"hidden_act='gelu_pytorch_tanh': Qwen3NextForCausalLM's experts compute "
        r"SiLU only: use \"silu\"\.$",
    ):
        ModelConfig.from_dict({**raw, "hidden_act": "gelu_pytorch_tanh"})  # (also the DeltaNet convolution's)


def test_qwen3_next_checkpoints_multi_token_prediction_head_is_skipped_as_transformers_does(tiny_checkpoints, tmp_path):
    """The Hub's Qwen3-Next files also hold `mtp.*` (a multi-token-prediction head transformers does not build and
    skips): they load here too, with the same logits; any other tensor the model does not use is still refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from staticformers.models.pretrained import CheckpointError

    path = tiny_checkpoints("qwen3-next")
    tensors = load_file(f"{path}/model.safetensors")
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    extra = {"mtp.fc.weight": torch.ones(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)}
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids, mask = _inputs()
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path))(input_ids=ids, attention_mask=mask).logits
        want = AutoModelForCausalLM.from_pretrained(path)(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, want)
    save_file(
        {**tensors, "model.extra.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"}
    )
    with pytest.raises(
        CheckpointError,
        match=r"has 1 weight\(s\) this Qwen3NextForCausalLM does not use: "
        r"model\.extra\.weight",
    ):
        AutoModelForCausalLM.from_pretrained(str(tmp_path))
