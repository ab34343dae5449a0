"""The extend step: `[B, T]` tokens per row over the static cache, each row at its own positions, the
logits kept at `n` positions; what speculative verification and chunked prefill run. Its logits equal
the model's own forward over the whole sequence (itself checked against transformers in
test_modeling.py), rows that do not take part are left as they were, and its graphs are the plan's."""

import pytest
import torch

from staticformers import AutoModelForCausalLM, ShapePlan
from staticformers.compilation.compiler import ShapePlanViolation
from staticformers.generation.engine import CompileSettings, Engine
from staticformers.generation.plan import PlanError
import tolerances as tol

PLAN = ShapePlan(
    batch_sizes=[2], prompt_lengths=[8, 16], kv_lengths=[32], max_model_len=32, extend_widths=[(4, 4), (4, 1)]
)


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")


def _full_logits(model, ids: list) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    "family,regional", [("qwen3", True), ("qwen3", False), ("mistral-window", True), ("qwen3-moe", True)]
)
def test_extend_matches_the_full_forward_and_leaves_other_rows_alone(tiny_checkpoints, strict, family, regional):
    """Row 0 extends its prompt by 4 tokens (every position kept, then only the last); row 1 takes part
    at positions past its length, and its next decode step is still the full forward's."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    engine = Engine(model, PLAN)
    settings = CompileSettings(backend="eager", regional=regional)
    gen = torch.Generator().manual_seed(0)
    p0, p1 = torch.randint(3, 128, (6,), generator=gen).tolist(), torch.randint(3, 128, (9,), generator=gen).tolist()
    new = torch.randint(3, 128, (4,), generator=gen).tolist()
    cache = engine.cache(2, 32)
    with torch.no_grad():
        engine.prefill(settings, [p0, p1], cache, [0, 1])
        tokens = torch.tensor([new, [7, 7, 7, 7]])
        positions = torch.tensor([[6, 7, 8, 9], [9, 10, 11, 12]])
        argmax, logits = engine.extend(settings, cache, tokens, positions, torch.arange(4).repeat(2, 1))
    full0 = _full_logits(model, p0 + new)
    assert logits.shape == (2, 4, 128) and argmax.shape == (2, 4)
    tol.assert_close(logits[0], full0[6:10])
    assert torch.equal(argmax[0], logits[0].argmax(-1))

    # the same extension again, keeping its last position only (the cache's positions are rewritten)
    with torch.no_grad():
        argmax, last = engine.extend(settings, cache, tokens, positions, torch.tensor([[3], [0]]))
        tol.assert_close(last[0, 0], full0[9])
        # row 1 was given positions 9..12: its decode at position 9 writes before attending, as always
        nxt = 11
        _, decoded = engine.decode(settings, cache, torch.tensor([[new[-1]], [nxt]]), torch.tensor([[10], [9]]))
    tol.assert_close(decoded[1], _full_logits(model, p1 + [nxt])[9])
    tol.assert_close(decoded[0], _full_logits(model, p0 + new + [new[-1]])[10])


def test_extend_graphs_are_the_plans_and_an_undeclared_width_is_refused(tiny_checkpoints, strict):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = Engine(model, PLAN)
    settings = CompileSettings(backend="eager", regional=True)
    rows = engine.precompile(settings)
    extend_rows = [r for r in rows if r["kind"] == "extend"]
    assert [tuple(r["shape"]) for r in extend_rows] == [(2, 4, 32, 1), (2, 4, 32, 4)]
    assert all(r["graphs"] > 0 for r in extend_rows)
    before = engine.graph_count()
    cache = engine.cache(2, 32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            tokens = torch.randint(3, 128, (2, 4), generator=gen)
            start = torch.randint(0, 20, (2, 1), generator=gen)
            engine.extend(settings, cache, tokens, start + torch.arange(4), torch.arange(4).repeat(2, 1))
            engine.extend(settings, cache, tokens, start + torch.arange(4), torch.tensor([[3], [3]]))
    assert engine.graph_count() == before
    with pytest.raises(ShapePlanViolation, match="extend widths"), torch.no_grad():
        engine.extend(
            settings,
            cache,
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2, 1, dtype=torch.long),
        )


def test_the_plan_declares_prints_and_checks_extend_widths():
    plan = ShapePlan(
        batch_sizes=[1, 2], prompt_lengths=[8], kv_lengths=[16, 32], max_model_len=32, extend_widths=[(5, 5)]
    )
    assert plan.extend_shapes() == [(1, 16, 5, 5), (1, 32, 5, 5), (2, 16, 5, 5), (2, 32, 5, 5)]
    assert plan.num_shapes == 2 + 4 + 4
    assert "extend widths   5 keep 5" in str(plan)
    wider = plan.with_extend_widths((16, 1))
    assert wider.extend_widths == ((5, 5), (16, 1)) and wider.kv_lengths == plan.kv_lengths
    assert plan.with_extend_widths((5, 5)) is plan and wider != plan
    assert ShapePlan(max_model_len=64).bind(512).extend_widths == ()
    assert ShapePlan(extend_widths=[(3, 1)]).bind(512).extend_widths == ((3, 1),)
    with pytest.raises(PlanError, match="kept positions"):
        ShapePlan(max_model_len=32, extend_widths=[(2, 3)])
    with pytest.raises(PlanError, match="a pair"):
        ShapePlan(max_model_len=32, extend_widths=[4])
    with pytest.raises(PlanError, match="more tokens than max_model_len"):
        ShapePlan(max_model_len=32, extend_widths=[(64, 1)])
