"""gemv.py's `bf16_attend_project`, a decode step's attention and output projection in one call, and the formulation
that picks it (`CPUOps.attention_projection`): the same bits as the attention kernel and the streaming projection
called apart (GQA, a mask, rows 1 to 8), a tiny model's decode steps with one call a layer and the same logits as
the two calls, what it leaves to the two calls (float32, softcaps, sinks, a bias, a hook, more rows than the kernel
streams, a wanted gradient, other formulations), a traced graph calling it whole, and bad input refused in one
sentence."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM
from staticformers.backends.cpu import formulations as f
from staticformers.backends.cpu import gemv as g
from staticformers.backends.cpu.decode_attention import decode_attention, loaded as attention_loaded
from staticformers.models.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread", "kernels")
STREAM = f.CPUOps("kernel", "stream", "stream")


@pytest.fixture(scope="module")
def kernels():
    """Built (or read from inductor's cache) when a test of this file runs, not when it is collected."""
    if not (g.loaded() and attention_loaded()):
        pytest.skip("the CPU kernels cannot be built here (no C++ compiler, or no AVX2/AVX-512 for inductor)")


def inputs(rows: int, heads=6, kv_heads=2, d=32, length=40, out=48, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(rows, heads, 1, d).bfloat16()
    k, v = torch.randn(rows, kv_heads, length, d).bfloat16(), torch.randn(rows, kv_heads, length, d).bfloat16()
    mask = torch.rand(rows, 1, 1, length) < 0.7
    o = (torch.randn(out, heads * d) / (heads * d) ** 0.5).bfloat16()
    return q, k, v, mask, o


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("masked", [True, False])
def test_the_call_is_the_attention_then_the_projection_bit_for_bit(rows, masked):
    q, k, v, mask, o = inputs(rows, seed=rows)
    mask = mask if masked else None
    heads = decode_attention(q, k, v, mask, 0.2)
    apart = g.bf16_gemv(heads.transpose(1, 2).reshape(rows, -1), [o])[0]
    together = g.bf16_attend_project(q, k, v, mask, 0.2, o)
    assert together.shape == (rows, o.shape[0]) and together.dtype == torch.bfloat16
    assert torch.equal(together, apart)


def decode(model, ops, steps=3):
    """A 5-token prompt in one row's cache, then `steps` decode steps: every decode step's logits."""
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (1, 5))
    cache = KVCache.for_model(model, 1, 32)
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(5).view(1, 5), kv_cache=cache, ops=ops).logits[:, -1]
        for step in range(steps):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, position_ids=torch.tensor([[5 + step]]), kv_cache=cache, ops=ops).logits
            logits = logits[:, -1]
            out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window"])
def test_each_decode_step_attends_and_projects_in_one_call_a_layer(tiny_checkpoints, family, monkeypatch):
    """One call a layer at each decode step (the prompt's 5 queries a row take the attention and projection
    apart), and the same logits as the formulation with the call refused, bit for bit: the same kernels run."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family), dtype=torch.bfloat16)
    calls: list = []
    real = f.bf16_attend_project

    def counting(q, *rest):
        calls.append(q.shape[0])
        return real(q, *rest)

    monkeypatch.setattr(f, "bf16_attend_project", counting)
    together = decode(model, STREAM)
    assert calls == [1] * model.config.num_hidden_layers * 3
    monkeypatch.setattr(f, "streams_alone", lambda *a: False)
    apart = decode(model, STREAM)
    assert len(calls) == model.config.num_hidden_layers * 3
    assert torch.equal(together, apart)


def test_what_the_call_does_not_take_runs_apart():
    q, k, v, mask, _ = inputs(2)
    o = torch.nn.Linear(192, 48, bias=False).bfloat16()
    with torch.no_grad():
        assert STREAM.attention_projection(o, q, k, v, mask, 0.2) is not None
        assert f.CPUOps("reduce", "stream", "stream").attention_projection(o, q, k, v, mask, 0.2) is None
        assert f.CPUOps("kernel", "reduce", "reduce").attention_projection(o, q, k, v, mask, 0.2) is None
        assert STREAM.attention_projection(o, q, k, v, mask, 0.2, softcap=30.0) is None
        assert STREAM.attention_projection(o, q, k, v, mask, 0.2, sinks=torch.zeros(6)) is None
        assert STREAM.attention_projection(o, q.float(), k.float(), v.float(), mask, 0.2) is None
        many = inputs(f.BF16_GEMV_MAX_ROWS + 1)
        assert STREAM.attention_projection(o, *many[:4], 0.2) is None
        handle = o.register_forward_hook(lambda m, i, out: out)
        assert STREAM.attention_projection(o, q, k, v, mask, 0.2) is None
        handle.remove()
        biased = torch.nn.Linear(192, 48).bfloat16()
        assert STREAM.attention_projection(biased, q, k, v, mask, 0.2) is None
    with torch.enable_grad():
        wanted = q.clone().requires_grad_()
        assert STREAM.attention_projection(o, wanted, k, v, mask, 0.2) is None


def test_a_traced_graph_calls_it_whole():
    q, k, v, mask, o = inputs(2)

    def step(q):
        return g.bf16_attend_project(q, k, v, mask, 0.2, o)

    torch._dynamo.reset()
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    assert torch.equal(compiled(q), step(q))
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.staticformers.bf16_attend_project]


def test_bad_input_is_refused_in_one_sentence():
    q, k, v, mask, o = inputs(2)
    cases = [
        ((q.float(), k, v, mask, 0.2, o), "q must be bfloat16"),
        ((q[:, :, :0], k, v, mask, 0.2, o), "q must be bfloat16"),
        ((q, k, v, mask, 0.2, o[:, :100]), "o must be"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message) as err:
            g.bf16_attend_project(*args)
        assert "\n" not in str(err.value).strip().splitlines()[0]
