"""decode_attention.py: the CPU's decode attention kernel against float64 SDPA (float32 and bf16, grouped KV heads,
head sizes and lengths past the vector width, a strided cache slice, no mask), a row with nothing to attend, the
threads' split and the KV head's query heads run together (the same bits), the formulation that routes to it (static caches only; soft caps and sinks keep the reductions),
and bad input refused in one sentence."""

from __future__ import annotations

import pytest
import torch

from staticformers.backends.cpu import decode_attention as da
from staticformers.backends.cpu import formulations as f
from staticformers.models.ops import sdpa

pytestmark = pytest.mark.usefixtures("kernel")


@pytest.fixture(scope="module")
def kernel():
    if not da.loaded():
        pytest.skip("the decode attention kernel cannot be built here (no C++ compiler, or no AVX2/AVX-512)")


def inputs(dtype, b=3, h=6, kvh=2, length=100, d=40, seed=0):
    """q, k, v and a mask in which every row may attend at least one position; k and v slices of a longer cache."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    cache = torch.randn(2, b, kvh, length + 28, d, generator=g).to(dtype)
    k, v = cache[0, :, :, :length], cache[1, :, :, :length]
    mask = torch.rand(b, 1, 1, length, generator=g) > 0.4
    mask[:, :, :, 0] = True
    return q, k, v, mask


def check(out, q, k, v, mask, scale):
    """Within float32 sums of `length` terms of the float64 result, plus the output's rounding in bf16."""
    want = sdpa(q.double(), k.double(), v.double(), mask, scale)
    slack = 2**-8 if out.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(out.double(), want, rtol=slack + 1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, length", [(40, 100), (64, 256), (8, 5)])
def test_the_kernel_is_sdpa_in_float32(dtype, d, length):
    q, k, v, mask = inputs(dtype, d=d, length=length)
    assert k.stride(2) == d and k.stride(1) == (length + 28) * d  # a slice: positions contiguous, rows apart
    assert da.runs(q, k, v, mask)
    out = da.decode_attention(q, k, v, mask, 0.3)
    assert out.shape == (3, 6, 1, d) and out.dtype == dtype
    check(out, q, k, v, mask, 0.3)
    check(da.decode_attention(q, k, v, None, 0.3), q, k, v, None, 0.3)


def test_a_row_with_nothing_to_attend_gets_zeros_and_the_others_their_own():
    q, k, v, mask = inputs(torch.float32)
    mask[1] = False
    out = da.decode_attention(q, k, v, mask, 0.3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for row in (0, 2):
        check(out[row : row + 1], q[row : row + 1], k[row : row + 1], v[row : row + 1], mask[row : row + 1], 0.3)


@pytest.mark.parametrize("d", [40, 64])
def test_the_threads_split_and_the_grouped_heads_change_nothing(d):
    """At d=64 (whole vectors) one thread runs a task per KV head with its 3 query heads together, and 5 threads a
    task per query head (8 KV heads' tasks are too few for them, and 3 heads split only into 1s); at d=40 every
    thread count runs a task per query head: the same bits either way."""
    q, k, v, mask = inputs(torch.bfloat16, b=4, h=6, kvh=2, length=300, d=d)
    threads = torch.get_num_threads()
    outs = []
    for n in (1, 3, 5):
        torch.set_num_threads(n)
        try:
            outs.append(da.decode_attention(q, k, v, mask, 0.125))
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    check(outs[0], q, k, v, mask, 0.125)


def test_the_kernel_formulation_routes_one_query_per_row_to_it(monkeypatch):
    """`"kernel"` runs it for one query per row; a soft cap, sinks, several queries and `"reduce"` do not."""
    calls = []
    real = f.decode_attention
    monkeypatch.setattr(f, "decode_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v, mask = inputs(torch.float32)
    ops = f.CPUOps("kernel")
    check(ops.attention(q, k, v, mask, 0.3), q, k, v, mask, 0.3)
    assert calls == [1]
    torch.testing.assert_close(
        ops.attention(q, k, v, mask, 0.3, softcap=5.0), f.attend_decode(q, k, v, mask, 0.3, 5.0), rtol=0, atol=0
    )
    sinks = torch.zeros(6)
    ops.attention(q, k, v, mask, 0.3, sinks=sinks)
    f.CPUOps("reduce").attention(q, k, v, mask, 0.3)
    several = torch.randn(3, 6, 4, 40)
    ops.attention(several, k, v, mask.expand(3, 1, 4, 100), 0.3)
    assert calls == [1]


def test_bad_input_is_refused_in_one_sentence():
    q, k, v, mask = inputs(torch.float32)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        da.decode_attention(q, k.bfloat16(), v, mask, 0.3)
    with pytest.raises(RuntimeError, match=r"q must be \[batch, heads, 1, dim\]"):
        da.decode_attention(q.expand(3, 6, 2, 40), k, v, mask, 0.3)
    with pytest.raises(RuntimeError, match="heads a multiple of kv_heads"):
        da.decode_attention(q[:, :5], k, v, mask, 0.3)
    with pytest.raises(RuntimeError, match=r"mask must be bool \[batch, 1, 1, positions\]"):
        da.decode_attention(q, k, v, mask.float(), 0.3)
