"""The CPU copies a model's weights into one block of huge pages before its first step (backends/cpu/weight_arena.py):
every parameter in the block, in module order, on a cache line, tied ones still tied, the outputs unchanged; left
alone where it is switched off, where a weight is not a whole tensor of its own, or where memory is short; done
once per model, and again after the model is converted."""

from __future__ import annotations

import os

import pytest
import torch

from staticformers import AutoModelForCausalLM, ShapePlan
from staticformers.backends.cpu import weight_arena
from staticformers.backends.cpu.weight_arena import HUGE_PAGE, arrange_weights, arranged
from staticformers.generation.engines import engine_for

PLAN = ShapePlan(max_model_len=64, max_batch_size=2, min_prompt_length=8, min_kv_length=32)


def pointers(model) -> list[int]:
    return [p.data_ptr() for p in model.parameters()]


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def ids():
    torch.manual_seed(0)
    return torch.randint(3, 128, (2, 9))


def test_every_weight_in_one_block_in_module_order_outputs_unchanged(tiny_checkpoints, ids):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"), dtype=torch.bfloat16)
    params = list(model.parameters())
    before = logits(model, ids)
    assert arrange_weights(model) and arranged(model)
    block = getattr(model, weight_arena.ATTR)
    start = block.data_ptr() + (-block.data_ptr()) % HUGE_PAGE
    ptrs = pointers(model)
    assert ptrs[0] == start and ptrs == sorted(ptrs) and len(set(ptrs)) == len(ptrs)
    assert all(p % 64 == 0 for p in ptrs)
    assert all(a + p.numel() * p.element_size() <= b for a, b, p in zip(ptrs, ptrs[1:], params))
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # the same Parameter objects
    assert torch.equal(logits(model, ids), before)
    assert not arrange_weights(model) and pointers(model) == ptrs  # once per model


def test_tied_weights_stay_tied(tiny_checkpoints, ids):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama-tied"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    norm = model.model.norm
    twin = torch.nn.Parameter(norm.weight.data)  # a second Parameter over the same storage
    model.model.twin = torch.nn.Module()
    model.model.twin.weight = twin
    before = logits(model, ids)
    assert arrange_weights(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert twin.data_ptr() == norm.weight.data_ptr() and arranged(model)
    assert torch.equal(logits(model, ids), before)


def test_left_alone_when_switched_off_shared_or_short_of_memory(tiny_checkpoints, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    ptrs = pointers(model)
    monkeypatch.setenv("STATICFORMERS_WEIGHT_ARENA", "0")
    assert not arrange_weights(model) and pointers(model) == ptrs and not arranged(model)
    monkeypatch.delenv("STATICFORMERS_WEIGHT_ARENA")
    assert not arrange_weights(model, available=1024) and pointers(model) == ptrs
    norm = model.model.norm.weight
    norm.data = torch.cat([norm.data, norm.data])[: norm.numel()]  # a view of a larger tensor
    ptrs = pointers(model)
    assert not arrange_weights(model) and pointers(model) == ptrs and not arranged(model)


def test_the_block_is_advised_huge_pages_where_linux_has_them():
    whole, block, advised = weight_arena.huge_page_block(3 * HUGE_PAGE + 100)
    assert block.data_ptr() % HUGE_PAGE == 0 and block.numel() == 3 * HUGE_PAGE + 100
    assert block.data_ptr() + 4 * HUGE_PAGE <= whole.data_ptr() + whole.numel()  # the advice's whole pages
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert advised


def test_the_engine_arranges_once_and_again_after_a_conversion(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    ids = torch.randint(3, 128, (1, 8))
    engine = engine_for(model, PLAN)
    assert arranged(model)
    first = model.generate(ids, max_new_tokens=4, do_sample=False, disable_compile=True, eos_token_id=None)
    graphs = dict(engine.graphs)
    assert graphs
    engine.check_weights()  # the arrangement is no change of weights: nothing is dropped
    assert engine.graphs == graphs
    old = getattr(model, weight_arena.ATTR)
    model.to(torch.bfloat16)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, disable_compile=True, eos_token_id=None)
    assert arranged(model) and getattr(model, weight_arena.ATTR) is not old
    assert out.shape == first.shape
