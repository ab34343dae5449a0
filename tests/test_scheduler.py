"""The scheduler alone, on the host: the step rule, admission as far as blocks go, preemption of the newest row, and
the plans it hands the runner. No model and no device: these are the decisions `tests/test_kv_blocks.py` and
`tests/test_loop_property.py` check end to end against full-forward greedy."""

import random

import pytest
import torch

from staticformers.generation.kv_blocks import BlockAllocator
from staticformers.generation.plan import ShapePlan
from staticformers.generation.requests import GenerationRequest, Row
from staticformers.generation.sampling import SamplingParams
from staticformers.generation.scheduler import Scheduler

BLOCK = 16


def scheduler(blocks=None, chunk=16, max_slots=4, kv=None, ahead=1, budget=None):
    """A scheduler over batches 1, 2, 4 and prompts up to 64: one chunk width `chunk`, or with `budget` the chunk
    budget's widths (64 tokens: 64, 32 and 16)."""
    widths = ((chunk, 1),) if budget is None else ()
    plan = ShapePlan(
        batch_sizes=[1, 2, 4], prompt_lengths=[16, 32, 64], kv_lengths=[64, 128, 256], extend_widths=widths
    ).bind(256)
    if budget is not None:
        plan, chunk = plan.with_chunk_tokens(budget), plan.with_chunk_tokens(budget).chunk_width_at(1)
    state = {"kv": kv}
    pool = BlockAllocator(blocks) if blocks is not None else None
    s = Scheduler(
        plan,
        max_slots,
        chunk,
        True,
        pool,
        BLOCK,
        False,
        ahead,
        model=torch.nn.Module(),
        kv_length=lambda: state["kv"],
        budgeted=budget is not None,
    )
    return s, state


def row(n, new=8, rid=None, logprobs=None):
    request = GenerationRequest(list(range(1, n + 1)), new, SamplingParams(prompt_logprobs=logprobs), request_id=rid)
    return Row(request, need=n + new - 1)


def hold(s, rows):
    """What the loop does after a prefill of `rows`: each holds a slot, its first step's positions written."""
    free = [i for i in range(s.max_slots) if i not in s.rows]
    for slot, r in zip(free, rows):
        r.length = len(s.first_tokens(r))
        s.rows[slot] = r


def test_one_prefill_like_call_between_decode_steps_and_chunks_alternate_with_admissions():
    s, _ = scheduler()
    assert s.next_kind() is None
    s.queue(row(40, rid="long"))
    assert s.next_kind() == "admit"
    hold(s, s.take_joining())
    s.ran("admit")
    assert s.next_kind() == "chunk"  # nothing decodes yet: its chunks run back to back
    s.ran("chunk")
    s.queue(row(10, rid="short"))
    assert s.next_kind() == "admit"  # after a chunk, a waiting request gets its turn
    hold(s, s.take_joining())
    s.ran("admit")
    assert s.next_kind() == "decode"  # "short" decodes now: no second prefill-like call in a row
    s.ran("decode")
    assert s.next_kind() == "chunk"
    s.rows[0].length = 40  # "long" is in
    s.ran("chunk")
    assert s.next_kind() == "decode"


def test_admission_stops_at_a_full_batch_and_at_the_blocks_the_running_rows_need_next():
    s, state = scheduler(blocks=6, kv=64)
    for i in range(3):
        s.queue(row(30, rid=i))  # its first chunk of 16 tokens: one block
    joining = s.take_joining()
    assert [r.request.request_id for r in joining] == [0, 1, 2] and s.blocks.free == 3
    assert all(len(r.blocks) == 1 for r in joining)
    hold(s, joining)
    # each row's next chunk reaches 30 positions: one more block each, so nothing is spare for a fourth row
    assert s.spare_blocks() == 0
    s.queue(row(10, rid=3))
    assert s.next_kind() != "admit" and s.take_joining() == []
    assert [r.request.request_id for r in s.waiting] == [3] and not s.waiting[0].blocks


def test_make_room_preempts_the_newest_row_and_queues_it_first_with_what_it_generated():
    s, state = scheduler(blocks=4, kv=64, chunk=16)
    rows = [row(16, new=40, rid=i) for i in range(2)]
    for r in rows:
        s.queue(r)
    joining = s.take_joining()
    hold(s, joining)
    for r in s.rows.values():
        r.tokens, r.generated = [7] * 17, 17  # both decoded up to 33 positions: 3 blocks each would be needed
        r.length = 16 + 16
        r.blocks += s.blocks.take(1)
    assert s.blocks.free == 0
    preempted, changed = s.make_room(sorted(s.rows))
    assert [(slot, r.request.request_id) for slot, r in preempted] == [(1, 1)]
    assert list(s.rows) == [0] and len(s.rows[0].blocks) == 3 and changed
    resumed = s.waiting[0]
    assert resumed is rows[1] and resumed.resumed and resumed.length == 0 and not resumed.blocks
    assert resumed.prompt == list(range(1, 17)) + [7] * 17
    assert s.preemptions == 1 and s.blocks.free + s.blocks.used == 4


def test_plans_carry_what_the_runner_needs_and_who_fails_with_them():
    s, _ = scheduler(kv=64)
    a, b = row(40, rid="a"), row(8, rid="b", logprobs=2)
    s.queue(a)
    s.queue(b)
    joining = s.take_joining()
    given = [s.first_tokens(r) for r in joining]
    assert [len(g) for g in given] == [16, 8]  # a's first chunk; b's prompt (scored prompts are never chunked)
    step = s.prefill_plan(list(zip([0, 1], joining)), given, batch=2)
    assert step.kind == "prefill" and step.choosing == [1] and step.picks == [1] and step.scores
    assert step.scored == [None, 2] and step.advance == {0: 16, 1: 8}
    hold(s, joining)
    a.length, b.last, b.generated = 16, 5, 1
    chunk = s.chunk_plan(batch=2, kv=64)  # a's next chunk, and b's next token in the same step
    assert chunk.kind == "chunk" and chunk.slots == [0, 1] and chunk.choosing == [1] and chunk.fails == [0, 1]
    assert chunk.tokens[0].tolist() == list(range(17, 33)) and chunk.tokens[1, 0] == 5
    assert chunk.positions[1, 0] == 8 and chunk.keep[:, 0].tolist() == [15, 0]
    assert chunk.advance == {0: 16, 1: 1} and chunk.counts == {0: 15, 1: 0} and chunk.completes == []
    decode = s.decode_plan(batch=2)
    assert decode.choosing == [1] and decode.fails == [0, 1] and decode.steps == [1]
    assert decode.tokens[:, 0].tolist() == [0, 5] and decode.positions[:, 0].tolist() == [16, 8]


def test_a_chunk_budget_widens_the_chunks_of_fewer_rows():
    """With a chunk budget of 64 tokens: a lone prompt's first chunk and next chunks take 64 tokens a step; three
    joining at once take 16 each (a batch of 4), and two chunking apart take 32 each; a prefilling row preempted
    leaves the others' next chunks wider, and their reach follows."""
    s, state = scheduler(blocks=40, kv=256, budget=64)
    assert [s.chunk_at(b) for b in (1, 2, 4)] == [64, 32, 16]
    s.queue(row(200, rid="alone"))
    alone = s.take_joining()
    assert len(s.first_tokens(alone[0])) == 64 and len(alone[0].blocks) == 4
    hold(s, alone)
    assert s.chunk_now() == 64 and s.reach(alone[0]) == 128
    apart = s.chunk_apart_plan(own=(4, 256))
    assert apart.view == (1, 128) and apart.tokens.shape == (1, 64) and apart.advance == {0: 64}
    for i in range(3):
        s.queue(row(100, rid=i))
    three = s.take_joining()
    assert [len(s.first_tokens(r)) for r in three] == [16] * 3  # three rows' prefill: 16 tokens each
    hold(s, three)
    assert s.chunk_now() == 16 and s.reach(three[0]) == 32  # four rows chunk: a batch of 4
    apart = s.chunk_apart_plan(own=(4, 256))
    assert apart.tokens.shape == (4, 16) and apart.view == (4, 128)
    for slot in (2, 3):
        s.release(s.rows.pop(slot))
    assert s.chunk_now() == 32 and s.reach(three[0]) == 48  # 16 in, the next chunk of a batch of 2
    apart = s.chunk_apart_plan(own=(4, 128))
    assert apart.tokens.shape == (2, 32) and apart.advance == {0: 32, 1: 32}
    s.release(s.rows.pop(1))
    assert s.chunk_now() == 64 and s.reach(s.rows[0]) == 128


def test_without_a_budget_a_passed_width_is_every_batchs():
    s, _ = scheduler(chunk=16)
    assert [s.chunk_at(b) for b in (1, 2, 4)] == [16] * 3
    s.queue(row(200, rid="alone"))
    assert len(s.first_tokens(s.take_joining()[0])) == 16


@pytest.mark.parametrize("seed", range(5))
def test_random_joins_cancels_and_steps_never_leak_a_block(seed):
    """Random traffic on a small pool, the loop's side played by hand: every block is held by exactly one row or
    free, after every decision."""
    rng = random.Random(seed)
    s, state = scheduler(blocks=10, kv=256, chunk=16)
    ids = iter(range(10**6))

    def check():
        held = [b for r in list(s.rows.values()) for b in r.blocks]
        assert len(held) == len(set(held)) == s.blocks.used and not any(r.blocks for r in s.waiting)

    for _ in range(200):
        action = rng.random()
        if action < 0.3:
            s.queue(row(rng.randint(1, 60), new=rng.randint(1, 30), rid=next(ids)))
        elif action < 0.4 and s.rows:
            slot = rng.choice(list(s.rows))
            s.release(s.rows.pop(slot))
        kind = s.next_kind()
        if kind == "admit":
            hold(s, s.take_joining())
        elif kind in ("chunk", "decode"):
            running = sorted(s.rows)
            s.make_room(running)
            for r in s.rows.values():
                if r.length < len(r.prompt):
                    r.length = min(len(r.prompt), r.length + 16)
                elif r.length + 1 < 256 and len(r.blocks) * BLOCK > r.length:
                    r.tokens.append(3)
                    r.generated += 1
                    r.length += 1
            for slot in [slot for slot, r in s.rows.items() if r.generated >= r.request.max_new_tokens]:
                s.release(s.rows.pop(slot))  # it ended
        if kind is not None:
            s.ran(kind)
        check()
    for r in list(s.rows.values()):
        s.release(r)
    s.rows.clear()
    assert s.blocks.used == 0
