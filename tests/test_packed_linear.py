"""bf16 linears over weights oneDNN packed once (backends/cpu/packed_linear.py): the same results as the
module's own bf16 linear, a weight changed in place packed again, a freed weight's copy dropped, and
packing declined (with one notice) or turned off without changing a result."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from staticformers import AutoModelForCausalLM
from staticformers.backends.cpu import packed_linear as pl
from staticformers.backends.cpu.formulations import CPUOps

pytestmark = pytest.mark.skipif(
    not pl.packed_available(torch.bfloat16), reason="this CPU's oneDNN has no bf16 kernels to pack for"
)


def _layer(out=48, inp=64, bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(inp, out, bias=bias, dtype=torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_the_module(rows, bias):
    layer = _layer(bias=bias)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(x)
        got = pl.packed_linear(layer, x.view(rows, 1, 64)).view(rows, -1)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
    assert pl.packed_weight(layer.weight) is not None


def test_a_weight_changed_in_place_is_packed_again():
    layer = _layer()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        first = pl.packed_linear(layer, x)
        packed = pl.packed_weight(layer.weight)
        layer.weight.mul_(-1)
        second = pl.packed_linear(layer, x)
        assert pl.packed_weight(layer.weight) is not packed
        torch.testing.assert_close(second.float(), layer(x).float(), rtol=0.02, atol=0.02)
    assert not torch.allclose(first.float(), second.float())


def test_a_freed_weight_takes_its_packed_copy_with_it():
    layer = _layer(out=40, inp=72)
    with torch.no_grad():
        pl.packed_linear(layer, torch.randn(2, 72, dtype=torch.bfloat16))
    key = pl._key(layer.weight)
    assert key in pl._packed
    del layer
    gc.collect()
    assert key not in pl._packed


def test_packing_declined_for_memory_keeps_results_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(pl, "_room_for", lambda nbytes: False)
    monkeypatch.setitem(pl.STATS, "declined", 0)
    layers = [_layer(out=24 + i, seed=i) for i in range(2)]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        for layer in layers:
            torch.testing.assert_close(pl.packed_linear(layer, x).float(), layer(x).float(), rtol=0.02, atol=0.02)
            assert pl.packed_weight(layer.weight) is None
    notices = [r for r in caplog.records if "not packed" in r.getMessage()]
    assert len(notices) == 1 and "free memory" in notices[0].getMessage()


def test_packing_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(pl.ENV, "0")
    assert not pl.packed_available(torch.bfloat16)
    layer = _layer(out=20)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(pl.packed_linear(layer, x).float(), layer(x).float(), rtol=0.02, atol=0.02)
    assert pl.packed_weight(layer.weight) is None


def test_with_a_gradient_wanted_it_is_the_modules_own_linear():
    layer = _layer()
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    pl.packed_linear(layer, x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_a_bf16_model_decodes_the_same_tokens_with_packed_linears(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"), dtype=torch.bfloat16)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids, ops=CPUOps(None, None, None)).logits.float()
        got = model(input_ids=ids, ops=CPUOps(None, "packed", "packed")).logits.float()
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
