"""Weight-only int8 (and fp8's format): every family's weights within the int8 bound, experts included; the CPU's
int8 reduction equals the generic product; a trained tiny model keeps its greedy tokens and its held-out loss;
save/load without quantising again, read back by transformers' compressed-tensors loader (the oracle) and
served; a LoRA trains over an int8 base; graphs stay those of the plan; refusals in one sentence."""

from __future__ import annotations

import json
import os

import pytest
import torch

from staticformers import (
    AutoConfig,
    AutoModelForCausalLM,
    CompileConfig,
    LoraConfig,
    QuantizationConfig,
    ShapePlan,
    TorchAoConfig,
)
from staticformers.generation.engines import engine_for
from staticformers.checkpoints.compressed_tensors import QuantizationFormatError, pack_int8, unpack_int8
from staticformers.models import moe, quantization as q
from staticformers.models.moe import Experts
from staticformers.models.quantization import QuantLinear, dequantize, quantize_rows
import tolerances as tol

pytestmark = pytest.mark.usefixtures("one_thread")
INT8 = QuantizationConfig("int8_weight_only")


def originals(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_within_int8_bound(before: dict, model) -> int:
    """Every quantized weight within half a step (its row's scale / 2) of the original; returns how many."""
    checked = 0
    for name, m in model.named_modules():
        pairs = []
        if isinstance(m, QuantLinear):
            source = "model.model.embed_tokens.weight" if name == "lm_head" and f"{name}.weight" not in before else None
            pairs.append((before[source or f"{name}.weight"], m.weight, m.weight_scale))
        elif isinstance(m, Experts) and m.quantized:
            pairs += [
                (before[f"{name}.gate_up_proj"], m.gate_up_proj, m.gate_up_proj_scale),
                (before[f"{name}.down_proj"], m.down_proj, m.down_proj_scale),
            ]
        for w, qw, scale in pairs:
            assert qw.dtype == torch.int8 and scale.shape == (*w.shape[:-1], 1) and scale.dtype == w.dtype
            err = (w.float() - dequantize(qw, scale, torch.float32)).abs()
            assert (err <= scale.float() / 2 * (1 + 1e-6)).all(), name
            checked += 1
    return checked


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "qwen3-moe", "mixtral", "gemma3", "olmo2"])
def test_every_family_quantizes_within_the_int8_bound(tiny_checkpoints, family):
    path = tiny_checkpoints(family)
    ref = AutoModelForCausalLM.from_pretrained(path)
    before = originals(ref)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=TorchAoConfig("int8_weight_only"))
    n = check_within_int8_bound(before, model)
    sparse = sum(ref.config.layer_is_sparse(i) for i in range(ref.config.num_hidden_layers))
    assert n == 7 * ref.config.num_hidden_layers - sparse  # a sparse layer: 4 projections, 2 expert stacks
    # what stays exact: the embedding, the norms, a mixture's router, the head (default)
    exact = [k for k in before if "embed" in k or "norm" in k or ".mlp.gate.weight" in k or k == "lm_head.weight"]
    params = dict(model.named_parameters())
    assert all(torch.equal(params[k], before[k]) for k in exact if k in params)
    assert type(model.lm_head) is torch.nn.Linear
    from staticformers.backends.cpu import plain_projections

    assert plain_projections(model)  # the CPU keeps its measured formulations for an int8 model
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    # the product's error: sum over `in` of |x| * scale/2, relative to the logits' scale (loose, an int8 bound)
    tol.assert_close(model(ids).logits, ref(ids).logits, rel=0.1)


def test_fp8_format_round_trip_and_pack_round_trip():
    w = torch.randn(33, 70) * torch.logspace(-3, 1, 33).unsqueeze(1)
    qw, scale = quantize_rows(w, "fp8", torch.bfloat16)
    assert qw.dtype == torch.float8_e4m3fn and scale.shape == (33, 1)
    err = (w - dequantize(qw, scale, torch.float32)).abs()
    # e4m3: 3 mantissa bits (half an ulp is 2**-4 relative), subnormal steps of 2**-9 times the scale
    assert (err <= w.abs() * 2**-4 + scale.float() * 2**-10 + 1e-12).all()
    q8, _ = quantize_rows(w, "int8", torch.float32)
    packed = pack_int8(q8)
    assert packed.dtype == torch.int32 and packed.shape == (33, 18)
    assert torch.equal(unpack_int8(packed, (33, 70)), q8)


def test_fp8_is_refused_on_a_device_without_fp8_arithmetic(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"^fp8 weights need a device with fp8 arithmetic .* and cpu has none"):
        AutoModelForCausalLM.from_pretrained(
            tiny_checkpoints("qwen3"), quantization_config=QuantizationConfig("float8_weight_only")
        )


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (lambda: TorchAoConfig("int4_weight_only"), "not a weight-only type staticformers runs"),
        (lambda: QuantizationConfig(modules_to_not_convert="lm_head"), "must be a list of module names"),
    ],
)
def test_bad_configs_get_one_sentence(bad, pattern):
    with pytest.raises(ValueError, match=pattern):
        bad()


def test_the_cpus_int8_kernel_and_reduction_equal_the_generic_product():
    """The CPU's int8 projection (ATen's int8 kernel at inference, here in bf16; with a gradient wanted, the
    multiply-and-sum over the int8 rows times the row scales) against `QuantLinear.forward`, and gathered
    experts."""
    from staticformers.backends.cpu.formulations import CPUOps, int8_linear, project
    from staticformers.models.ops import PLAIN

    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48, bias=True), "int8")
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        bf16 = QuantLinear.from_linear(torch.nn.Linear(64, 48, bias=True).bfloat16(), "int8")
        xb = x.bfloat16()
        # bf16 both ways: the kernel and the widened product each round their output once (2**-9 relative)
        tol.assert_close(int8_linear(bf16, xb).float(), bf16(xb).float(), rel=2**-7)
    wanting = x.clone().requires_grad_()
    reduced = project(layer, wanting, "reduce")
    reduced.sum().backward()
    tol.assert_close(reduced.detach(), layer(x))
    assert wanting.grad is not None
    experts = Experts(4, 64, 32)
    experts.reset_parameters(0.05)
    experts.quantize("int8")
    rows, index = torch.randn(2, 1, 64), torch.tensor([3, 1])
    got = CPUOps("reduce", "reduce").expert_matmul(rows, experts.gate_up_proj, experts.gate_up_proj_scale, index=index)
    want = PLAIN.expert_matmul(rows, experts.gate_up_proj, experts.gate_up_proj_scale, index=index)
    tol.assert_close(got, want)


def test_the_cpus_int8_projection_is_the_kernel_in_bf16_for_few_float32_rows_and_the_widened_gemm_for_a_prompt():
    """float32 activations: up to `INT8_KERNEL_MAX_ROWS` rows ATen's int8 kernel runs in bf16, so each output is
    within bf16's rounding of the activations, the scales and the result (2**-9 relative each) of the sum of
    its terms' magnitudes; a prompt's rows run the widened weight's GEMM (plain, or oneDNN's), equal to the
    generic product in float32."""
    from staticformers.backends.cpu.formulations import INT8_KERNEL_MAX_ROWS, int8_kernel, project

    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48, bias=True), "int8")
    few, prompt = torch.randn(2, INT8_KERNEL_MAX_ROWS // 2, 64), torch.randn(2, INT8_KERNEL_MAX_ROWS, 64)
    with torch.no_grad():
        assert int8_kernel(layer, few) and not int8_kernel(layer, prompt)
        for how in (None, "reduce", "onednn"):
            got, want = project(layer, few, how), layer(few)
            magnitudes = few.abs() @ layer.dequantized().float().abs().t()
            err = (got - want).abs()
            assert (err <= 3 * 2**-9 * magnitudes + 1e-5).all(), float((err / magnitudes).max())
            assert float(err.max()) > 1e-6  # bf16 did round: the kernel ran in bf16, not float32
        for how in (None, "onednn"):
            tol.assert_close(project(layer, prompt, how), layer(prompt))
        # the float32 kernel is one opaque operator: it traces whole (its shape function), as graphs call it
        traced = torch.compile(lambda x: project(layer, x), backend="aot_eager", fullgraph=True, dynamic=False)
        tol.assert_close(traced(few), project(layer, few))


# ---------------------------------------------------------------------------------------------
# a trained tiny model
# ---------------------------------------------------------------------------------------------
def affine_rows(n: int, length: int, seed: int, noise: float = 0.1) -> torch.Tensor:
    """A task with an entropy floor: x[t] = (5 * x[t-1] + 3) mod 64, replaced by a random id (`noise` of the time)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, 64, (n,), generator=g)
    noise = torch.rand(n, length, generator=g) < noise
    random_ids = torch.randint(0, 64, (n, length), generator=g)
    for t in range(1, length):
        x[:, t] = torch.where(noise[:, t], random_ids[:, t], (5 * x[:, t - 1] + 3) % 64)
    return x


def tiny_config():
    return AutoConfig.for_model(
        "qwen3",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=320,
        initializer_range=0.2,
    )


def train(model, steps: int, lr: float = 1e-2, rows: int = 16, length: int = 32) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = affine_rows(rows, length, seed=step)
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


@pytest.fixture(scope="module")
def trained():
    """A tiny Qwen3 trained in fp32 for a few seconds on `affine_rows`, then held in bf16 (one thread: this
    module-wide fixture runs before the tests' own `one_thread`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_config(tiny_config(), seed=0)
        train(model, 60, rows=8, length=96)
    finally:
        torch.set_num_threads(threads)
    return model.to(torch.bfloat16)


def held_out_loss(model) -> float:
    batch = affine_rows(32, 32, seed=10_000)
    with torch.no_grad():
        return float(model(batch, labels=batch).loss)


def test_int8_keeps_the_greedy_tokens_and_the_held_out_loss_of_bf16(trained, tmp_path):
    trained.save_pretrained(tmp_path)
    int8 = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=INT8)
    base_loss, int8_loss = held_out_loss(trained), held_out_loss(int8)
    assert base_loss < 1.2  # trained: far below ln(64) = 4.2, near the noise's floor
    assert abs(int8_loss - base_loss) <= 0.01 * base_loss, (base_loss, int8_loss)
    prompts = affine_rows(4, 8, seed=20_000, noise=0.0)
    a = trained.generate(prompts, max_new_tokens=256, do_sample=False, disable_compile=True, eos_token_id=None)
    b = int8.generate(prompts, max_new_tokens=256, do_sample=False, disable_compile=True, eos_token_id=None)
    agree = float((a[:, 8:] == b[:, 8:]).float().mean())
    assert agree >= 0.95, agree


def test_a_lora_trains_over_an_int8_base():
    model = AutoModelForCausalLM.from_config(tiny_config(), seed=1)  # untrained: the adapter has work to do
    model.quantize(INT8)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.add_adapter(
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    losses = train(model, 40)
    assert losses[-1] < 0.6 * losses[0], losses
    after = {n.replace(".base_layer", ""): p for n, p in model.named_parameters() if "lora_" not in n}
    assert after.keys() == base.keys() and all(torch.equal(after[n], base[n]) for n in base)
    assert after["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    with pytest.raises(ValueError, match="quantized base"):
        model.merge_and_unload()


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def test_save_and_load_do_not_quantise_again_and_transformers_reads_the_files(tiny_checkpoints, tmp_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    import transformers

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3-moe"), quantization_config=INT8)
    model.save_pretrained(tmp_path)
    config = json.load(open(tmp_path / "config.json"))["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    for module in (q, moe):
        monkeypatch.setattr(module, "quantize_rows", lambda *a, **k: pytest.fail("quantized again"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    mine, theirs = dict(model.named_parameters()), dict(again.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.randint(3, 128, (2, 9))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    tol.assert_close(hf(ids).logits, again(ids).logits)
    with pytest.raises(ValueError, match="quantized already"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=INT8)
    from staticformers import DistributedConfig

    with pytest.raises(ValueError, match="quantized already"):  # tensor parallel: test_distributed_quantization.py
        AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=INT8, distributed_config=DistributedConfig(tp_size=2)
        )


def test_the_int_quantized_format_and_its_refusals_are_read(tiny_checkpoints, tmp_path):
    """compressed-tensors' `int-quantized` layout (int8 `weight`, a zero `weight_zero_point`) loads the same
    values; an int4 config is refused in one sentence."""
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"), quantization_config=INT8)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            stem = name[: -len("_packed")]
            out[stem] = unpack_int8(t, tuple(tensors[stem + "_shape"].tolist()))
            out[stem.replace(".weight", ".weight_zero_point")] = torch.zeros(t.shape[0], 1, dtype=torch.int8)
        elif not name.endswith(".weight_shape"):
            out[name] = t
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.load(open(tmp_path / "config.json"))
    raw["quantization_config"]["format"] = "int-quantized"
    json.dump(raw, open(tmp_path / "config.json", "w"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    raw["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    json.dump(raw, open(tmp_path / "config.json", "w"))
    with pytest.raises(QuantizationFormatError, match=r"asks for 4-bit int weights .* does not read"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------
# generation, graphs, serving
# ---------------------------------------------------------------------------------------------
def test_an_int8_model_compiles_the_plans_graphs_and_no_more(tiny_checkpoints):
    from torch._dynamo.utils import counters

    plan = ShapePlan(batch_sizes=[1, 2], prompt_lengths=[8, 16], kv_lengths=[32], max_model_len=32)
    config = CompileConfig(backend="eager")
    graphs = {}
    outs = {}
    for name, qc in (("fp32", None), ("int8", INT8)):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"), quantization_config=qc)
        engine_for(model, plan)
        counters.clear()
        outs[name] = [
            model.generate(
                torch.randint(3, 128, (b, n), generator=torch.Generator().manual_seed(b * n)),
                max_new_tokens=4,
                compile_config=config,
                eos_token_id=None,
            )
            for b, n in ((1, 5), (2, 12))
        ]
        graphs[name] = counters["stats"]["unique_graphs"]
        eager = [
            model.generate(o[:, :-4], max_new_tokens=4, disable_compile=True, eos_token_id=None) for o in outs[name]
        ]
        assert all(torch.equal(a, b) for a, b in zip(outs[name], eager))
    assert graphs["int8"] == graphs["fp32"] > 0


def test_a_quantized_folder_is_served(tmp_path):
    pytest.importorskip("openai")
    from served_greedy import assert_served_completion_is_greedy
    from staticformers import AutoTokenizer
    from tiny import build_hf_model
    from tokenizer_fixtures import build_qwen

    build_qwen(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    build_hf_model(
        "qwen3", vocab_size=len(tok), max_position_embeddings=128, eos_token_id=tok.eos_token_id
    ).save_pretrained(str(tmp_path))
    AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=INT8).save_pretrained(str(tmp_path / "q"))
    for f in os.listdir(tmp_path):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            os.link(tmp_path / f, tmp_path / "q" / f)
    folder = str(tmp_path / "q")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert_served_completion_is_greedy(model, tok, folder, "Hello there", 6)
