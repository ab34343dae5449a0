"""gpt-oss against transformers 5.23: what the family adds to the one decoder (attention sinks, alternating
sliding/full layers, YaRN without truncation, the biased router and experts with the clamped SwiGLU, the
RMSNorm weight applied in float32), bf16 logits, greedy tokens through the compiled engine, the checkpoint
round trip, MXFP4 expert checkpoints (dequantised, or to our int8), and what it refuses.

The tiny model (tests/tiny.py "gpt-oss"): 3 layers (sliding, full, sliding) with a window of 4 over prompts
of up to 13 tokens, 4 experts top-2, every bias and sink randomised. Its logits, router logits, gradients and
left-padded greedy batches are also proven by the files parametrized over FAMILIES / MOE_FAMILIES
(test_modeling.py, test_moe.py, test_moe_generation.py, test_generation.py, test_on_device.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig
from staticformers.checkpoints import mxfp4
from staticformers.models.model_config import ModelConfig
from family_checks import (
    assert_bf16_logits_agree,
    assert_saved_as_loaded,
    chunked_and_prefix_cached_run,
    hf_model,
    padded_batch,
)
import tolerances as tol

transformers = pytest.importorskip("transformers")


_hf = hf_model


def _inputs(seq=12, seed=1):
    return padded_batch(seq, (0, 4, 7), seed)


# ---------------------------------------------------------------------------------------------
# the architecture
# ---------------------------------------------------------------------------------------------
def test_config_defaults_follow_transformers():
    """A config.json without layer_types or rope_parameters: gpt-oss's own (alternating, YaRN factor 32
    without truncation, theta 150000), as transformers' GptOssConfig fills them in."""
    raw = {
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
    }
    ours = ModelConfig.from_dict(raw)
    ref = transformers.GptOssConfig(**raw)
    assert ours.layer_types == ref.layer_types == ["sliding_attention", "full_attention"] * 2
    assert ours.head_dim == ref.head_dim == 64 and ours.sliding_window == ref.sliding_window == 128
    assert ours.rope_theta == ref.rope_parameters["rope_theta"] == 150000.0
    assert {k: v for k, v in ours.rope_scaling.items()} == {
        k: v for k, v in ref.rope_parameters.items() if k != "rope_theta"
    }
    assert ours.qkv_bias and ours.o_bias and (ours.swiglu_alpha, ours.swiglu_limit) == (1.702, 7.0)
    # a file that names its own RoPE keeps it (no YaRN keys of the default leak in)
    own = ModelConfig.from_dict({**raw, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert own.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_layers_windows_sinks_and_parameters(tiny_checkpoints):
    path = tiny_checkpoints("gpt-oss")
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    assert [layer.kind for layer in ours.model.layers] == [
        (4, "moe", "sinks"),
        (None, "moe", "sinks"),
        (4, "moe", "sinks"),
    ]
    assert ours.num_parameters() == ref.num_parameters() == ours.config.num_parameters
    ids = _inputs()[0][:1]
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        for layer in ours.model.layers:  # without sinks (logit -inf: the column weighs nothing) the logits move
            layer.self_attn.sinks.data.fill_(float("-inf"))
        assert (ours(input_ids=ids).logits - want).abs().max() > 1e-2
    ours = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in ours.model.layers:  # the window: positions past 4 see more keys without it
            layer.self_attn.window = None
        ours.model.windows = {None}
        full = ours(input_ids=ids).logits
    torch.testing.assert_close(full[0, :4], want[0, :4])
    assert (full[0, 4:] - want[0, 4:]).abs().max() > 1e-2


def test_bf16_logits_close_and_top1_agrees(tiny_checkpoints):
    path = tiny_checkpoints("gpt-oss")
    assert_bf16_logits_agree(path, *_inputs())


# ---------------------------------------------------------------------------------------------
# generation through the engine
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["aot_eager"])  # "eager": test_moe_generation.py
def test_greedy_tokens_equal_transformers(tiny_checkpoints, backend):
    """Batch 1 (24 new tokens: past the window, over full and sliding layers) and a left-padded mixed batch,
    compiled, equal to transformers' greedy tokens."""
    from staticformers import ShapePlan
    from staticformers.generation.engines import engine_for

    path = tiny_checkpoints("gpt-oss")
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    engine_for(ours, ShapePlan(batch_sizes=[1, 4], prompt_lengths=[16], kv_lengths=[48], max_model_len=48))
    config = CompileConfig(backend=backend)
    one = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    want = ref.generate(one, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = ours.generate(
        one, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0, compile_config=config
    )
    assert torch.equal(got, want)
    assert len(set(want[0, 9:].tolist())) > 4  # a model that says something, not one token over and over
    ids, mask = _inputs(seq=13, seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(ids, compile_config=config, **kw), ref.generate(ids, **kw))


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
def test_save_loads_in_transformers_with_the_same_logits(tiny_checkpoints, tmp_path):
    """Ours saves transformers' layout (stacked experts transposed, `mlp.router`, `self_attn.sinks`)."""
    saved, original = assert_saved_as_loaded(tiny_checkpoints("gpt-oss"), tmp_path, *_inputs())
    for key in (
        "layer_types",
        "sliding_window",
        "swiglu_alpha",
        "swiglu_limit",
        "attention_bias",
        "num_local_experts",
        "intermediate_size",
        "head_dim",
    ):
        assert saved[key] == original[key], key
    assert saved["rope_parameters"] == original["rope_parameters"]


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own MXFP4 packing of `[E, rows, cols]`: per 32 values, the exponent that brings the largest
    under 6, each value rounded to the nearest e2m1 magnitude, its sign in the nibble's top bit, two nibbles
    a byte (the even value low)."""
    e, r, c = w.shape
    groups = w.float().reshape(e, r, c // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100) / 6.0))
    scaled = groups / torch.exp2(exp)
    nibble = (scaled.abs().unsqueeze(-1) - FP4).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp.squeeze(-1) + 127).to(torch.uint8)


@pytest.fixture
def mxfp4_checkpoint(tiny_checkpoints, tmp_path):
    """The tiny gpt-oss with its experts as MXFP4 blocks and scales (what the Hub's gpt-oss holds)."""
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoints("gpt-oss")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantises_bit_equal_to_transformers(mxfp4_checkpoint, dtype):
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(os.path.join(mxfp4_checkpoint, "model.safetensors"))
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = (tensors[f"model.layers.1.mlp.experts.{proj}_{p}"] for p in ("blocks", "scales"))
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # transformers' [E, cols, rows]
        assert torch.equal(mxfp4.dequantize(blocks, scales, dtype).transpose(1, 2), want)
    # every exponent and every nibble, both signs (zeros, subnormal scales and large ones included)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(1, 256, 1).reshape(1, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16).contiguous()
    scales[..., 0] = 0
    got = mxfp4.dequantize(blocks, scales, dtype)
    assert torch.equal(got.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_mxfp4_checkpoint_loads_as_transformers_loads_it(mxfp4_checkpoint, tmp_path_factory):
    ours = AutoModelForCausalLM.from_pretrained(str(mxfp4_checkpoint))
    ref = _hf(str(mxfp4_checkpoint))  # transformers dequantises MXFP4 on the CPU
    for name, p in ref.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mine = dict(ours.named_parameters())[name]
            assert torch.equal(mine.transpose(1, 2), p), name
    assert "quantization_config" not in ours.config.extra  # the model holds no MXFP4: it saves plain
    ids, mask = _inputs()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        tol.assert_close(ours(input_ids=ids, attention_mask=mask).logits[mask.bool()], want)
    saved = tmp_path_factory.mktemp("dequantised")
    ours.save_pretrained(saved)
    assert "quantization_config" not in json.load(open(os.path.join(saved, "config.json")))
    with torch.no_grad():
        tol.assert_close(_hf(str(saved))(input_ids=ids, attention_mask=mask).logits[mask.bool()], want)


def test_int8_from_mxfp4(mxfp4_checkpoint):
    """`quantization_config` at load: the dequantised experts become our int8 (per row), biases kept; the
    same model as quantising the dequantised one in memory."""
    from staticformers import QuantizationConfig
    from staticformers.models.quantization import quantize_model

    ours = AutoModelForCausalLM.from_pretrained(str(mxfp4_checkpoint), quantization_config=QuantizationConfig())
    plain = AutoModelForCausalLM.from_pretrained(str(mxfp4_checkpoint))
    ids, mask = _inputs()
    with torch.no_grad():
        dequantised = plain(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        quantize_model(plain, QuantizationConfig())
        want = plain(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        got = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    experts = ours.model.layers[0].mlp.experts
    assert experts.quantized == "int8" and experts.gate_up_proj.dtype == torch.int8
    assert experts.gate_up_proj_bias.dtype == torch.float32
    assert torch.equal(got, want) and not torch.equal(got, dequantised)


def _edit(folder, change):
    from safetensors.torch import load_file, save_file

    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_bad_mxfp4_tensors_get_one_sentence(mxfp4_checkpoint):
    from staticformers.models.pretrained import CheckpointError

    name = "model.layers.2.mlp.experts.down_proj"
    _edit(mxfp4_checkpoint, lambda t: t.__setitem__(name + "_scales", t[name + "_scales"][:, :32].contiguous()))
    with pytest.raises(
        CheckpointError,
        match=r"down_proj_blocks \[4, 64, 1, 16\] and .*down_proj_scales \[4, 32, 1\] "
        r"in model.safetensors do not pair up",
    ):
        AutoModelForCausalLM.from_pretrained(str(mxfp4_checkpoint))
    _edit(mxfp4_checkpoint, lambda t: t.pop(name + "_scales"))
    with pytest.raises(
        CheckpointError,
        match=r"holds model\.layers\.2\.mlp\.experts\.down_proj_blocks but no "
        r".*down_proj_scales",
    ):
        AutoModelForCausalLM.from_pretrained(str(mxfp4_checkpoint))


def test_mxfp4_blocks_of_another_model_are_named(mxfp4_checkpoint):
    from staticformers.models.pretrained import CheckpointError

    name = "model.layers.0.mlp.experts.gate_up_proj"

    def halve(t):
        t[name + "_blocks"] = t[name + "_blocks"][:, :, :1].contiguous()
        t[name + "_scales"] = t[name + "_scales"][:, :, :1].contiguous()

    _edit(mxfp4_checkpoint, halve)
    with pytest.raises(
        CheckpointError,
        match=r"gate_up_proj_blocks in model.safetensors dequantises to \[4, 64, 32\], "
        r"but config.json implies \[4, 64, 64\]",
    ):
        AutoModelForCausalLM.from_pretrained(str(mxfp4_checkpoint))


# ---------------------------------------------------------------------------------------------
# partitioned (the runs themselves: tests/test_distributed_families.py)
# ---------------------------------------------------------------------------------------------
def test_tensor_parallel_shards_the_sinks_and_expert_parallel_takes_the_biases(tiny_checkpoints):
    from staticformers.distributed.distributed_config import DistributedConfig, DistributedConfigError
    from staticformers.distributed.parallelize import default_tp_plan

    config = ModelConfig.from_pretrained(tiny_checkpoints("gpt-oss"))
    DistributedConfig(tp_size=2).check_model(config)
    DistributedConfig(fsdp_size=2, ep_size=2).check_model(config)
    assert default_tp_plan(config)["model.layers.*.self_attn"] == "sinks"
    with pytest.raises(DistributedConfigError, match=r"num_attention_heads=4 is not divisible by tp_size=8"):
        DistributedConfig(tp_size=8).check_model(config)


def test_cpu_formulations_take_the_sinks():
    """The CPU's grouped-matmul and decode-reduction attentions equal the plain sink path."""
    from staticformers.backends.cpu.formulations import CPUOps
    from staticformers.models.attention_sinks import attention_with_sinks

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 5, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
    )
    sinks = torch.randn(4, generator=g) * 3
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    want = attention_with_sinks(q, k, v, mask, 0.25, sinks)
    for ops in (CPUOps(), CPUOps("matmul")):
        tol.assert_close(ops.attention(q, k, v, mask, 0.25, sinks=sinks), want)
    one = attention_with_sinks(q[:, :, :1], k, v, mask[:, :, :1], 0.25, sinks)
    tol.assert_close(CPUOps("reduce").attention(q[:, :, :1], k, v, mask[:, :, :1], 0.25, sinks=sinks), one)
    assert not torch.allclose(one, attention_with_sinks(q[:, :, :1], k, v, mask[:, :, :1], 0.25, sinks - 5))


# ---------------------------------------------------------------------------------------------
# LoRA on the attention projections, both ways with peft
# ---------------------------------------------------------------------------------------------
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # what peft targets on gpt-oss (its experts are Parameters)


def test_lora_equals_peft_both_ways(tiny_checkpoints, tmp_path):
    from peft_both_ways import assert_lora_equals_peft_both_ways

    ids, mask = _inputs()
    assert_lora_equals_peft_both_ways(tiny_checkpoints("gpt-oss"), "gpt-oss", ATTENTION, tmp_path, ids, mask)


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def test_compiled_training_steps_as_eager_with_a_region_per_layer_kind(tiny_checkpoints, tmp_path):
    """The Trainer with the load-balancing loss: compiled regions (the sliding and the full layer's, the head)
    train as eager does, and the sinks, the router's bias and the experts' biases learn."""
    from staticformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(1, 128, (int(n),), generator=g).tolist()}
        for n in torch.randint(3, 30, (24,), generator=g)
    ]
    runs = {}
    for compiled in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("gpt-oss"))
        model.config.output_router_logits = True
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
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
            names = sorted(f.name for f in trainer.train_step.functions.values())
            assert names == [
                "head_loss_train",
                "layer_forward_routed_train_moe_sinks",
                "layer_forward_routed_train_window4_moe_sinks",
            ]
        for name in (
            "model.layers.0.self_attn.sinks",
            "model.layers.0.mlp.gate.bias",
            "model.layers.0.mlp.experts.gate_up_proj_bias",
            "model.layers.0.mlp.experts.down_proj_bias",
        ):
            assert not torch.equal(model.state_dict()[name], before[name]), name
    assert len(runs[True]) == 3 and runs[True] == pytest.approx(runs[False], rel=tol.FP32_TRAINED)


# ---------------------------------------------------------------------------------------------
# chunked prefill and prefix caching (the extend step over the cache, sinks and windows included)
# ---------------------------------------------------------------------------------------------
def test_chunked_prefill_and_prefix_caching_equal_transformers(tiny_checkpoints):
    chunked_and_prefix_cached_run(tiny_checkpoints("gpt-oss"))
