"""The shape plan: defaults, first-fit buckets, splitting, and one-sentence refusals."""

import pytest

from staticformers import ShapePlan
from staticformers.generation.plan import Entry, PlanError


def test_defaults_follow_max_model_len():
    plan = ShapePlan(max_model_len=1024)
    assert plan.batch_sizes == (1, 2, 4, 8)
    assert plan.prompt_lengths == (16, 32, 64, 128, 256, 512, 1024)
    assert plan.kv_lengths == (256, 512, 1024)
    assert plan.num_shapes == 4 * 7 + 4 * 3
    text = str(plan)
    assert "max_model_len 1024" in text and "40 shapes" in text


def test_bind_caps_at_model_positions_and_default():
    assert ShapePlan().bind(40960).max_model_len == 2048  # never max_position_embeddings blindly
    assert ShapePlan().bind(300).kv_lengths == (256, 300)
    with pytest.raises(PlanError, match="max_position_embeddings=512"):
        ShapePlan(max_model_len=1024).bind(512)


def test_first_fit_and_kv_need():
    plan = ShapePlan(max_model_len=512, max_batch_size=4)
    assert plan.choose(3, 17, 10) == Entry(4, 32, 256)
    assert plan.choose(1, 16, 1) == Entry(1, 16, 256)
    assert plan.choose(1, 200, 100) == Entry(1, 256, 512)  # 200 + 99 positions
    assert plan.choose(1, 197, 4) == Entry(1, 256, 256)  # the prompt's bucket costs no positions
    assert plan.choose(1, 255, 1) == Entry(1, 256, 256)


@pytest.mark.parametrize(
    "args,match",
    [
        ((1, 600, 1), "more than the largest prompt bucket"),
        ((1, 500, 20), "exceed max_model_len=512"),
        ((1, 300, 200), "needs 499 cache positions, more than the largest KV length \\(256\\)"),
    ],
)
def test_refusals_are_one_sentence(args, match):
    plan = ShapePlan(max_model_len=512, kv_lengths=[128, 256])
    with pytest.raises(PlanError, match=match) as err:
        plan.choose(*args)
    assert str(err.value).count(". ") == 0  # one sentence


def test_explicit_buckets():
    plan = ShapePlan(batch_sizes=[1, 3], prompt_lengths=[8, 24], kv_lengths=[64])
    assert plan.max_model_len == 64 and plan.batch_bucket(2) == 3 and plan.prompt_bucket(9) == 24
    with pytest.raises(PlanError, match="beyond max_model_len"):
        ShapePlan(prompt_lengths=[128], kv_lengths=[64], max_model_len=64)


def test_a_one_token_prompt_is_one_token_in_the_refusal():
    plan = ShapePlan(max_model_len=256).bind(256)
    with pytest.raises(PlanError, match=r"^The prompt has 1 token and max_new_tokens=300: 301 positions exceed"):
        plan.positions_needed(1, 300)
    with pytest.raises(PlanError, match=r"^The prompt has 2 tokens and"):
        plan.positions_needed(2, 300)


def test_a_chunk_budget_gives_each_batch_its_width_and_one_extend_shape_per_kv_length():
    """`chunk_tokens`: a chunk step of batch bucket B runs the budget over B (at most the largest prompt bucket), so
    every chunk step computes at most the budget; it adds as many shapes as one declared width."""
    plan = ShapePlan(max_model_len=1024, max_batch_size=16, chunk_tokens=512)
    assert [plan.chunk_width_at(b) for b in plan.batch_sizes] == [512, 256, 128, 64, 32]
    one_width = ShapePlan(max_model_len=1024, max_batch_size=16, extend_widths=((32, 1),))
    assert plan.num_shapes == one_width.num_shapes == 5 * 7 + 5 * 3 * 2
    assert sorted({(b, t) for b, _, t, _ in plan.extend_shapes()}) == [(1, 512), (2, 256), (4, 128), (8, 64), (16, 32)]
    assert ShapePlan(max_model_len=256, chunk_tokens=4096).chunk_width_at(1) == 256  # the largest prompt bucket
    assert "chunk budget    512 tokens a step: 512 at batch 1" in str(plan) and "chunk_tokens=512" in repr(plan)
    # a declared width that is a batch's chunk width is one shape, not two; verification widths stay per batch
    both = plan.with_extend_widths((64, 1), (5, 5))
    assert both.widths_at(8) == ((5, 5), (64, 1)) and both.widths_at(1) == ((5, 5), (64, 1), (512, 1))
    assert both.num_shapes == plan.num_shapes + 5 * 3 * 2 - 3
    assert ShapePlan(max_model_len=1024, max_batch_size=16).with_chunk_tokens(512) == plan != one_width
    assert ShapePlan(max_batch_size=4, chunk_tokens=64).bind(300).chunk_width_at(4) == 16  # bound later


@pytest.mark.parametrize(
    "tokens,match",
    [
        (4, r"^chunk_tokens=4 \(--max-num-batched-tokens\) is less than the largest batch bucket \(8\)"),
        (0, r"^chunk_tokens=0 must be a positive number of tokens"),
        (True, r"^chunk_tokens=True must be a positive number of tokens"),
    ],
)
def test_a_chunk_budget_is_refused_in_one_sentence(tokens, match):
    with pytest.raises(PlanError, match=match) as err:
        ShapePlan(max_model_len=256, chunk_tokens=tokens)
    assert str(err.value).count(". ") == 0
