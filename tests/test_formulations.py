"""The CPU backend's formulations (backends/cpu/formulations.py) give the plain path's results: the decode
formulations (reductions, grouped matmuls) for every family with rows of different lengths and a
sliding window, and the blocked causal attention (training in bf16) against SDPA with and without masks."""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from staticformers import AutoModelForCausalLM
from staticformers.backends.cpu import plain_projections
from staticformers.backends.cpu.onednn import onednn_available
from staticformers.backends.cpu.packed_linear import packed_available
from staticformers.backends.cpu.formulations import (
    PLAIN_CPU,
    CPUOps,
    attend,
    attend_blocks,
    decode_formulation,
    gemm_kernel,
    prefill_formulation,
)
from staticformers.models.block_kv_cache import BlockKVCache, KVBlocks
from staticformers.models.kv_cache import KVCache
from staticformers.models.decoder import packed_segments

FORMS = [
    ("reduce", "reduce", "reduce"),
    ("reduce", None, None),
    ("matmul", None, None),
    ("matmul", None, "reduce"),
    (None, None, "reduce"),
    (None, "onednn", "onednn"),
    ("reduce", "onednn", "reduce"),
]


def run(model, ids, mask, kv_len, form, cache=None):
    """Each row's prompt (the tokens its mask keeps) written at positions 0..n-1 of its cache row (a static cache
    of `kv_len` positions unless `cache` is given), then three decode steps at each row's own position; the
    logits of every step."""
    b = ids.shape[0]
    ops = form if isinstance(form, CPUOps) else CPUOps(*form) if form is not None else PLAIN_CPU
    cache = cache if cache is not None else KVCache.for_model(model, b, kv_len)
    lengths = mask.sum(-1)
    prompt = torch.zeros_like(ids)
    for i in range(b):
        prompt[i, : lengths[i]] = ids[i][mask[i]]
    pos = torch.arange(ids.shape[1]).expand(b, -1).contiguous()
    logits = model(input_ids=prompt, position_ids=pos, kv_cache=cache, ops=ops).logits
    out = [logits[torch.arange(b), lengths - 1]]
    at = lengths.view(b, 1).clone()
    for _ in range(3):
        token = out[-1].argmax(-1, keepdim=True)
        out.append(model(input_ids=token, position_ids=at, kv_cache=cache, ops=ops).logits[:, -1])
        at = at + 1
    return torch.stack(out)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral-window"])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f[0] or 'plain'}-linears-{f[1]}-head-{f[2]}")
def test_formulation_matches_plain_path(tiny_checkpoints, family, form):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :4] = False  # shorter rows
    mask[2, 2:] = False
    with torch.no_grad():
        want = run(model, ids, mask, 16, None)
        got = run(model, ids, mask, 16, form)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_decode_reductions_read_a_block_cache_as_the_plain_path_does(tiny_checkpoints):
    """Past batch 8 a decode step over a block cache attends by fused reductions (`decode_formulation(...,
    blocks=True)`), which read each row's blocks through the table in place instead of gathering them for SDPA:
    rows of different lengths, their blocks scattered over the pool, give the static cache's plain logits."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :4] = False
    mask[2, 2:] = False
    cache = BlockKVCache(KVBlocks.for_model(model, 16, 4), 3, 16)
    cache.write_table({0: [5, 2, 9, 1], 1: [3, 7, 4, 8], 2: [10, 12, 11, 6]})
    ops = decode_formulation(16, torch.float32, None, blocks=True)
    assert ops.attention_kind == "reduce"
    with torch.no_grad():
        want = run(model, ids, mask, 16, None)
        got = run(model, ids, mask, 16, ops, cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_formulation_in_bf16_is_close(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"), dtype=torch.bfloat16)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        want = run(model, ids, mask, 16, None).float()
        got = run(model, ids, mask, 16, decode_formulation(2, torch.bfloat16)).float()
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


def test_policy_per_shape():
    def form(ops):
        return ops.attention_kind, ops.linears, ops.head_linear

    # one query per row over a static cache: the decode attention kernel (`decode_attention.py`); over a block
    # cache, fused reductions that read the blocks in place
    assert form(decode_formulation(1, torch.float32, "onednn")) == ("kernel", "reduce", "reduce")
    assert form(decode_formulation(1, torch.float32, "onednn", blocks=True)) == ("reduce", "reduce", "reduce")
    # bf16 with 1-8 rows: the streaming kernel for every projection and the head (`gemv.py`)
    assert form(decode_formulation(1, torch.bfloat16)) == ("kernel", "stream", "stream")
    assert form(decode_formulation(8, torch.bfloat16, blocks=True)) == ("reduce", "stream", "stream")
    # fp32 GEMMs with 2-8 rows are slow for the 32,000-row head: a reduction there
    assert form(decode_formulation(8, torch.float32, "onednn")) == (None, None, "reduce")  # MKL's sgemm at 2-8 rows
    assert form(decode_formulation(2, torch.bfloat16)) == ("kernel", "stream", "stream")
    assert form(decode_formulation(8, torch.bfloat16)) == ("kernel", "stream", "stream")
    assert form(decode_formulation(16, torch.float32, "onednn")) == (None, "onednn", "onednn")
    # on block caches the reductions read the rows' blocks in place; SDPA would take a gathered copy
    assert form(decode_formulation(16, torch.float32, "onednn", blocks=True)) == ("reduce", "onednn", "onednn")
    assert form(decode_formulation(16, torch.bfloat16)) == (None, None, None)
    assert form(prefill_formulation(1, torch.bfloat16)) == ("matmul", None, "stream")
    assert form(prefill_formulation(1, torch.float32, "onednn")) == (None, "onednn", "reduce")
    assert form(prefill_formulation(8, torch.bfloat16)) == (None, None, "stream")
    assert form(prefill_formulation(16, torch.bfloat16)) == (None, None, None)
    assert form(prefill_formulation(16, torch.float32, "onednn")) == (None, "onednn", "onednn")
    assert decode_formulation(1, torch.float32) == CPUOps("kernel", "reduce", "reduce")  # compared by key


def test_onednn_gemm_for_float32_packed_for_bf16_on_the_cpu():
    want = "onednn" if onednn_available() else None
    assert gemm_kernel(torch.float32) == want
    assert gemm_kernel(torch.float16) is None


def test_bf16_gemms_widen_where_the_cpu_has_no_bf16_products(monkeypatch):
    """Without AVX512_BF16 or AMX (or with STATICFORMERS_WIDEN_BF16=1), a bf16 GEMM runs as float32 products: the
    widened operands' exact products summed in float32, rounded once, i.e. the float32 GEMM's result to the bit, and
    within bf16's rounding of the native bf16 GEMM; int8 layers widen their weight to float32 too, a wanted gradient the
    layer's own call. STATICFORMERS_WIDEN_BF16=0 keeps the packed or plain GEMM."""
    from staticformers.backends.cpu import formulations as f
    from staticformers.models.quantization import QuantLinear

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    monkeypatch.delenv(f.WIDEN_ENV, raising=False)
    assert f.widens_bf16() == (not native)
    monkeypatch.setenv(f.WIDEN_ENV, "0")
    assert gemm_kernel(torch.bfloat16) == ("packed" if packed_available(torch.bfloat16) else None)
    monkeypatch.setenv(f.WIDEN_ENV, "1")
    assert gemm_kernel(torch.bfloat16) == "widen" and gemm_kernel(torch.float32) != "widen"
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40).to(torch.bfloat16)
    x = torch.randn(3, 7, 96).to(torch.bfloat16)
    with torch.no_grad():
        got = f.project(layer, x, "widen")
        exact = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        assert got.dtype == torch.bfloat16 and torch.equal(got, exact.to(torch.bfloat16))
        torch.testing.assert_close(got, layer(x), rtol=2**-7, atol=2**-7 * float(exact.abs().max()))
        q = QuantLinear.from_linear(torch.nn.Linear(96, 40).to(torch.bfloat16), "int8")
        rows = x.reshape(-1, 96)
        got = f.project(q, rows, "widen")  # the int8 weight widened to float32 with the rows, the sums rounded once
        assert torch.equal(got, f.widened_linear(q, rows, torch.float32))
        assert not torch.equal(got, f.widened_linear(q, rows))  # bf16 products round each sum before the scale
        sums = torch.nn.functional.linear(rows.double(), q.weight.double()) * q.weight_scale.view(-1).double()
        exact = sums + q.bias.double()  # the bias adds in bf16 after the one rounding: a second rounding
        assert ((got.double() - exact).abs() <= 2**-7 * (sums.abs() + q.bias.double().abs()) + 1e-6).all()
    x.requires_grad_(True)
    assert f.project(layer, x, "widen").grad_fn is not None  # the layer's own call, differentiable


@pytest.mark.parametrize("kind", ["matmul", None, "reduce"])
@pytest.mark.parametrize("extra", ["plain", "softcap", "sinks", "mask"])
def test_widened_formulations_attend_over_float32_operands(kind, extra):
    """With `"widen"` linears, a bf16 attention over several queries a row (a prompt, chunk or verification) is
    the same formulation's float32 attention over the widened operands, rounded once: to the bit. One query a
    row keeps the bf16 formulation's own path, and so does a wanted gradient."""
    torch.manual_seed(0)
    b, h, kvh, s, d = 2, 4, 2, 40, 16
    q = torch.randn(b, h, s, d).to(torch.bfloat16)
    k, v = (torch.randn(b, kvh, s, d).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone() if extra == "mask" else None
    kw = {"softcap": {"softcap": 5.0}, "sinks": {"sinks": torch.randn(h).to(torch.bfloat16)}}.get(extra, {})
    widened, own = CPUOps(kind, "widen", "widen"), CPUOps(kind, None, None)
    with torch.no_grad():
        got = widened.attention(q, k, v, mask, 0.25, **kw)
        exact = own.attention(q.float(), k.float(), v.float(), mask, 0.25, **kw)
        assert got.dtype == torch.bfloat16 and torch.equal(got, exact.to(torch.bfloat16))
        assert not torch.equal(got, own.attention(q, k, v, mask, 0.25, **kw))  # the bf16 matmuls round otherwise
        one = (q[:, :, -1:], k, v, None, 0.25)
        assert torch.equal(widened.attention(*one, **kw), own.attention(*one, **kw))
    q.requires_grad_(True)
    assert torch.equal(widened.attention(q, k, v, mask, 0.25, **kw), own.attention(q, k, v, mask, 0.25, **kw))


@pytest.mark.parametrize("case", ["causal", "packed", "window", "uneven"])
def test_blocked_attention_matches_sdpa(case):
    torch.manual_seed(0)
    s = 200 if case == "uneven" else 256
    q = torch.randn(2, 4, s, 16, dtype=torch.float32)
    k, v = torch.randn(2, 2, s, 16, dtype=torch.float32), torch.randn(2, 2, s, 16, dtype=torch.float32)
    mask = None
    pos = torch.arange(s)
    causal = pos[None, :] <= pos[:, None]
    if case == "packed":
        ids = torch.cat([torch.arange(100), torch.arange(s - 100)]).expand(2, s)
        seg = packed_segments(ids)
        mask = causal & (seg[:, None, :, None] == seg[:, None, None, :])
    elif case == "window":
        mask = (causal & (pos[:, None] - pos[None, :] < 40)).expand(2, 1, s, s)
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask if mask is not None else causal, scale=0.25, enable_gqa=True
    )
    got = attend_blocks(q, k, v, mask, 0.25, block=64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_causal_attention_on_cpu_uses_blocks_and_is_close():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 256, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = torch.randn(1, 2, 256, 16, dtype=torch.bfloat16), torch.randn(1, 2, 256, 16, dtype=torch.bfloat16)
    got = attend(q, k, v, None, 0.25)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02)
    got.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _ops(engine, kind, batch, settings):
    return engine.steps.ops(kind, batch, settings)


def test_frozen_graphs_keep_plain_gemms_for_inductor_to_pack(tiny_checkpoints):
    """Under inductor freezing the GEMMs stay `F.linear` (inductor packs frozen weights for oneDNN
    itself); otherwise float32 GEMMs on the CPU take oneDNN's operator."""
    from staticformers.generation.engine import CompileSettings, Engine

    engine = Engine(AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3")))
    plain = CompileSettings(backend="inductor")
    frozen = CompileSettings(backend="inductor", options=(("freezing", True),))
    assert _ops(engine, "prefill", 4, frozen) == CPUOps(None, None, "reduce")
    assert _ops(engine, "prefill", 4, plain).linears == gemm_kernel(torch.float32)
    assert _ops(engine, "decode", 16, frozen) == CPUOps(None, None, None)


def test_wrapped_or_hooked_projections_keep_the_plain_path(tiny_checkpoints):
    """Reductions and oneDNN read a projection's weight directly: a forward hook or a Linear subclass
    (LoRA, quantisation) must keep the module's own forward."""
    from staticformers.generation.engine import CompileSettings, Engine

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine, settings = Engine(model), CompileSettings(backend="inductor")
    assert plain_projections(model) and _ops(engine, "decode", 1, settings) != PLAIN_CPU
    handle = model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: o * 2)
    assert not plain_projections(model) and _ops(Engine(model), "decode", 1, settings) == PLAIN_CPU
    handle.remove()

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model.model.layers[0].self_attn.o_proj = Scaled(64, 64, bias=False)  # a new module: the engine resets
    engine.check_weights()
    assert not plain_projections(model) and _ops(engine, "prefill", 4, settings) == PLAIN_CPU
