"""gemv.py's `bf16_mlp_block`, a decoder layer's MLP half in one call, and the formulation that picks it
(`CPUOps.mlp_block`): the kernel against the same math rounded where the kernel says it rounds (rows 1 to 8,
widths off the vector size), a tiny model's logits with the block against the layer's own ops, one call a layer,
the layers and inputs it leaves to the ops (Granite's residual multiplier, Gemma's sandwich norms, a mixture of
experts, LoRA, hooks, float32, too many rows, a wanted gradient), a traced graph calling it whole, and bad input
refused in one sentence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from staticformers import AutoModelForCausalLM
from staticformers.backends.cpu import formulations as f
from staticformers.backends.cpu import gemv as g
from staticformers.models.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread", "kernel")
STREAM = f.CPUOps("kernel", "stream", "stream")


@pytest.fixture(scope="module")
def kernel():
    """Built (or read from inductor's cache) when a test of this file runs, not when it is collected."""
    if not g.loaded():
        pytest.skip("the streaming kernels cannot be built here (no C++ compiler, or no AVX2/AVX-512 for inductor)")


def bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to bfloat16 and back (round to nearest even, as the kernel rounds)."""
    return t.bfloat16().float()


def reference(x, attn, norm, eps, gate, up, down):
    """The block's math in float32, rounded to bfloat16 where the kernel says it rounds."""
    x, attn, norm, gate, up, down = (t.float() for t in (x, attn, norm, gate, up, down))
    r = bf16(x + attn)
    h = bf16(norm * bf16(r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)))
    gs, us = bf16(h @ gate.t()), bf16(h @ up.t())
    a = bf16(F.silu(gs) * us)
    return bf16(r + bf16(a @ down.t()))


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("hidden, inner", [(64, 128), (100, 72)])
def test_the_kernel_is_the_mlp_half_rounded_where_it_says(rows, hidden, inner):
    """Against the same math with the same roundings: the only freedom is the order of float32 sums (the norm's
    squares, each projection's products), which can move a rounded intermediate by one bfloat16 step. So each
    output is within 2**-6 of the largest magnitude among its terms (the residual and the down projection),
    and almost all outputs are the reference's exactly."""
    torch.manual_seed(rows * hidden)
    x, attn = torch.randn(rows, hidden).bfloat16(), torch.randn(rows, hidden).bfloat16()
    norm = (1 + 0.1 * torch.randn(hidden)).bfloat16()
    gate, up = (
        (torch.randn(inner, hidden) / hidden**0.5).bfloat16(),
        (torch.randn(inner, hidden) / hidden**0.5).bfloat16(),
    )
    down = (torch.randn(hidden, inner) / inner**0.5).bfloat16()
    out = g.bf16_mlp_block(x, attn, norm, 1e-6, gate, up, down)
    want = reference(x, attn, norm, 1e-6, gate, up, down)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, hidden)
    scale = want.abs().amax() + 1
    assert ((out.float() - want).abs() <= 2**-6 * scale).all()
    assert (out.float() == want).float().mean() >= 0.9


def test_the_threads_split_of_the_activation_changes_no_bit():
    """Past a few rows' worth of values, SiLU(gate) * up is split between the threads: 1 and 3 threads agree, and
    both are the reference's."""
    torch.manual_seed(9)
    x, attn = torch.randn(8, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    norm = torch.ones(64).bfloat16()
    gate, up, down = (
        torch.randn(1536, 64).bfloat16(),
        torch.randn(1536, 64).bfloat16(),
        torch.randn(64, 1536).bfloat16(),
    )
    alone = g.bf16_mlp_block(x, attn, norm, 1e-5, gate, up, down)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        split = g.bf16_mlp_block(x, attn, norm, 1e-5, gate, up, down)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, split)
    want = reference(x, attn, norm, 1e-5, gate, up, down)
    assert (split.float() == want).float().mean() >= 0.9


def decode(model, ops, steps=3):
    """A 5-token prompt in one row's cache, then `steps` decode steps: every step's logits."""
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (1, 5))
    cache = KVCache.for_model(model, 1, 32)
    with torch.no_grad():
        logits = [model(input_ids=ids, position_ids=torch.arange(5).view(1, 5), kv_cache=cache, ops=ops).logits[:, -1]]
        for step in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            at = torch.tensor([[5 + step]])
            logits.append(model(input_ids=token, position_ids=at, kv_cache=cache, ops=ops).logits[:, -1])
    return torch.stack(logits)


def count_blocks(monkeypatch) -> list:
    calls: list = []
    real = f.bf16_mlp_block

    def counting(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(f, "bf16_mlp_block", counting)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window"])
def test_a_model_runs_each_layers_mlp_half_in_one_call_and_gives_the_ops_logits(tiny_checkpoints, family, monkeypatch):
    """With `"stream"` linears, every layer's MLP half is one call, at the prompt (5 rows) and at each decode step
    (1 row); the logits are the layer's own ops' (the same formulation with the block refused) within bf16's
    rounding of a 2-layer model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family), dtype=torch.bfloat16)
    layers = model.config.num_hidden_layers
    calls = count_blocks(monkeypatch)
    fused = decode(model, STREAM)
    assert calls == [5] * layers + [1] * layers * 3
    monkeypatch.setattr(f, "mlp_block_runs", lambda *a: False)
    plain = decode(model, STREAM)
    assert len(calls) == 4 * layers
    torch.testing.assert_close(fused.float(), plain.float(), rtol=2**-6, atol=0.05)


@pytest.mark.parametrize("family", ["granite", "gemma2", "mixtral"])
def test_layers_whose_mlp_half_is_not_the_blocks_math_run_their_own_ops(tiny_checkpoints, family, monkeypatch):
    """Granite scales each sub-layer's output, Gemma norms it again (sandwich), a mixture of experts routes: none
    of them calls the block."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family), dtype=torch.bfloat16)
    calls = count_blocks(monkeypatch)
    decode(model, STREAM, steps=1)
    assert calls == []


def test_inputs_and_modules_the_kernel_does_not_take_run_the_ops(tiny_checkpoints, monkeypatch):
    """The formulation says None (the layer runs its ops) for float32, more rows than the kernel streams, a
    wanted gradient, a hooked MLP, a LoRA projection, a bias, and linears other than `"stream"`."""
    from staticformers.adapters.lora import LoraLinear

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"), dtype=torch.bfloat16)
    layer = model.model.layers[0]
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert STREAM.mlp_block(norm, mlp, x, x) is not None
        assert f.CPUOps("kernel", "reduce", "reduce").mlp_block(norm, mlp, x, x) is None
        assert STREAM.mlp_block(norm, mlp, x, x.float()) is None
        rows = torch.randn(f.BF16_GEMV_MAX_ROWS + 1, 1, 64, dtype=torch.bfloat16)
        assert STREAM.mlp_block(norm, mlp, rows, rows) is None
    with torch.enable_grad():
        wanted = x.clone().requires_grad_()
        assert STREAM.mlp_block(norm, mlp, wanted, wanted) is None
        assert STREAM.mlp_block(norm, mlp, x, wanted) is None  # the attention's output alone wants one
        assert mlp.gate_proj.weight.requires_grad and STREAM.mlp_block(norm, mlp, x, x) is None  # a weight wants one
        for p in (*norm.parameters(), *mlp.parameters()):
            p.requires_grad_(False)
        assert STREAM.mlp_block(norm, mlp, x, x) is not None  # nothing wants one
    with torch.no_grad():
        handle = mlp.register_forward_hook(lambda m, i, o: o)
        assert STREAM.mlp_block(norm, mlp, x, x) is None
        handle.remove()
        real = mlp.up_proj
        mlp.up_proj = LoraLinear(real)
        assert STREAM.mlp_block(norm, mlp, x, x) is None
        mlp.up_proj = real
        real.bias = torch.nn.Parameter(torch.zeros(real.out_features, dtype=torch.bfloat16))
        assert STREAM.mlp_block(norm, mlp, x, x) is None


def test_a_traced_graph_calls_the_block_whole():
    torch.manual_seed(3)
    x = torch.randn(2, 64).bfloat16()
    norm = torch.ones(64).bfloat16()
    gate, up, down = torch.randn(96, 64).bfloat16(), torch.randn(96, 64).bfloat16(), torch.randn(64, 96).bfloat16()

    def block(x):
        return g.bf16_mlp_block(x, x, norm, 1e-5, gate, up, down)

    torch._dynamo.reset()
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(block, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), block(x))
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.staticformers.bf16_mlp_block]


def test_bad_input_is_refused_in_one_sentence():
    x = torch.randn(2, 64).bfloat16()
    norm = torch.ones(64).bfloat16()
    gate, up, down = torch.randn(96, 64).bfloat16(), torch.randn(96, 64).bfloat16(), torch.randn(64, 96).bfloat16()
    cases = [
        ((x, x[:1], norm, 1e-5, gate, up, down), "x and attn must be bfloat16"),
        ((x.float(), x.float(), norm, 1e-5, gate, up, down), "x and attn must be bfloat16"),
        ((x, x, norm[:32], 1e-5, gate, up, down), "norm must be bfloat16"),
        ((x, x, norm, 1e-5, gate, up[:90], down), "gate and up must be"),
        ((x, x, norm, 1e-5, gate, up, down.t()), "gate and up must be"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message) as err:
            g.bf16_mlp_block(*args)
        assert "\n" not in str(err.value).strip().splitlines()[0]
