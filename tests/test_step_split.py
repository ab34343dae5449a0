"""`generation/step_split.py`: when a block cache's decode step splits by context, from what each choice reads."""

from __future__ import annotations

from staticformers import ShapePlan
from staticformers.generation.step_split import GAIN, READS_PER_POSITION, split_by_context

PLAN = ShapePlan(batch_sizes=[1, 2, 4, 8, 16], prompt_lengths=[32], kv_lengths=[256, 512, 2048], max_model_len=2048)
WEIGHTS, POSITION = 166_000_000, 16_384  # the 41.6M reference in fp32: its weights, one position over 8 layers


def test_one_long_context_among_short_ones_runs_apart():
    """15 rows within 256 positions and one at 1,900 in a batch of 16 at K = 2048: the short rows over K = 256 in
    a batch of 16, the long one alone over 2048."""
    reach = {s: 100 + 10 * s for s in range(15)} | {15: 1900}
    assert split_by_context(reach, 16, 2048, PLAN, WEIGHTS, POSITION) == [list(range(15)), [15]]


def test_the_cut_is_the_cheapest_one():
    """Four rows at 200 and four at 500 with one at 1,900: the cut keeps the 500s with the short rows (K = 512 for
    eight rows) rather than with the long one (K = 2048 for five)."""
    reach = {0: 200, 1: 200, 2: 200, 3: 200, 4: 500, 5: 500, 6: 500, 7: 500, 8: 1900}
    assert split_by_context(reach, 16, 2048, PLAN, WEIGHTS, POSITION) == [list(range(8)), [8]]


def test_no_split_when_it_reads_about_as_much():
    """Contexts in one bucket, a single row, or weights that dwarf the gather: the batch's one step."""
    assert split_by_context({0: 100, 1: 200}, 2, 256, PLAN, WEIGHTS, POSITION) is None
    assert split_by_context({0: 1900}, 1, 2048, PLAN, WEIGHTS, POSITION) is None
    assert split_by_context({0: 100, 1: 1900}, 2, 2048, PLAN, 100 * WEIGHTS, POSITION) is None


def test_decoding_rows_run_apart_from_a_prefilling_rows_context():
    """Two decoding rows within 256 positions in a batch of 4 whose K is 2048 because of a row still prefilling: one
    step of their own, a batch of 2 over K = 256; none when their own shape is the batch's."""
    assert split_by_context({0: 100, 1: 120}, 4, 2048, PLAN, WEIGHTS, POSITION) == [[0, 1]]
    assert split_by_context({0: 100, 1: 120}, 2, 256, PLAN, WEIGHTS, POSITION) is None


def test_the_threshold_is_what_the_two_steps_read():
    """Right at the threshold: two rows, one short and one long, split exactly when the two steps' bytes are at
    most GAIN of the one step's."""
    reach, short_kv, long_kv = {0: 100, 1: 1900}, 256, 2048
    per = POSITION * READS_PER_POSITION
    one = lambda w: w + 2 * long_kv * per  # noqa: E731
    two = lambda w: 2 * w + (short_kv + long_kv) * per  # noqa: E731
    # the weights' bytes at which two == GAIN * one: 2w + s = GAIN * (w + o)  =>  w = (GAIN * o - s) / (2 - GAIN)
    edge = (GAIN * 2 * long_kv * per - (short_kv + long_kv) * per) / (2 - GAIN)
    below, above = int(edge * 0.99), int(edge * 1.01)
    assert two(below) <= GAIN * one(below) and two(above) > GAIN * one(above)
    assert split_by_context(reach, 2, long_kv, PLAN, below, POSITION) == [[0], [1]]
    assert split_by_context(reach, 2, long_kv, PLAN, above, POSITION) is None
