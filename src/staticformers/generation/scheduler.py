"""Which step runs next, and for whom: the queue, the running rows, the step rule, admission, the KV pool's blocks and
preemption, and the plans of the steps it decides.

Why a module of its own: deciding a step is host bookkeeping that never touches the device, and it used to be
interleaved with running steps in the loop. The loop (`loop.py`) asks the scheduler what runs next (`next_kind`),
lets it take joining rows and give rows their blocks, asks it for the step's `StepPlan` (`step_plan.py`), runs it
through `runner.py`, and emits. The batch's device state (its cache's shape, the rows' samplers and grammars) is the
loop's: the scheduler reads the batch's KV length through a callable and reports the rows it preempted, whose
device state the loop then saves and clears.

The rules, each decided here:

- **No two admissions without a token between them.** A step admits waiting requests (a prefill), runs the next
  chunk of the prefilling rows (in which every decoding row takes a token too: `chunking.py`), or runs a decode
  step. With rows decoding, an admission is followed by a decode step; with rows prefilling and requests waiting,
  chunks and admissions alternate.
- **First come, first served, as far as blocks go.** A waiting request joins while a slot is free and (block caches)
  its first step's blocks fit in what the running rows' next steps leave (`spare_blocks`: admitting into blocks that
  are about to be needed would preempt it again at once). With prefix caching it first holds the cached blocks of
  its prompt's prefix (`_share_prefix`, keyed by the adapter's load).
- **Blocks before each step, oldest row first** (`make_room`): each row the step runs gets the blocks of the
  positions it writes and reads (`reach`); while the pool lacks them, the newest running row is preempted: its blocks
  freed, its prompt and what it generated queued first, to resume by prefilling them.
- **Blocks behind a sliding window go back** (`slide`, block caches of a model whose every layer attends a window):
  before each of a row's steps, the blocks no query of it can read return to the pool (with prefix caching, a
  prompt's full blocks are registered first, so they stay cached). With prompts chunked, a request is then refused
  only when its widest step's window does not fit the pool (`peak_blocks`), however long it runs. On a model that
  mixes window and full-attention layers, the window layers' blocks are a group of their own (`BlockGroup`): a row
  holds the same logical blocks in each, every step takes its new blocks in each, and only the window group gives
  back those behind its window.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..adapters.bank import bank_of
from .chunking import chunk_apart_plan, chunk_plan, decoding, prefilling
from .kv_blocks import NULL_BLOCK, BlockAllocator, blocks_behind, blocks_for, window_blocks
from .plan import ShapePlan
from .prefix_cache import adapter_key, block_keys
from .step_plan import StepPlan
from .step_split import split_by_context

logger = logging.getLogger("staticformers")


@dataclass(frozen=True)
class BlockGroup:
    """One account of pool blocks: `pool`, the row attribute listing a row's blocks in it (`attr`), and the window
    behind which they go back (`window`, None: none do)."""

    pool: BlockAllocator
    attr: str
    window: Optional[int]


class Scheduler:
    """The host side of one loop's continuous batching (see the module docstring).

    `plan`: the loop's shape plan; `max_slots`: rows at most; `chunk`: the chunk width (None: prompts in one prefill),
    the widest with `budgeted` (each chunk step's width is then the plan's chunk budget's at its batch,
    `ShapePlan.chunk_width_at`), `chunked`: whether prompts are chunked; `blocks`: the pool's account on block caches (None: static caches), of
    `block_size` positions; `share`: prefix caching by shared blocks; `ahead`: positions a decoding row's step
    writes (k+1 when verifying); `model`: whose adapter bank the rows name; `kv_length`: the batch's KV length now
    (None: no batch); `costs`: on block caches, (the weights' bytes, one position's bytes over the layers), with
    which decode steps are split by context (None: never split); `window`: on block caches, the sliding window every
    layer of the model attends (`kv_blocks.sliding_window`), behind which blocks go back (None: none do);
    `window_group`: on block caches of a model that mixes window and full layers, (the window layers' account, their
    window): a group of its own (`BlockGroup`)."""

    def __init__(
        self,
        plan: ShapePlan,
        max_slots: int,
        chunk: Optional[int],
        chunked: bool,
        blocks: Optional[BlockAllocator],
        block_size: int,
        share: bool,
        ahead: int,
        model,
        kv_length: Callable[[], Optional[int]],
        costs: Optional[tuple] = None,
        window: Optional[int] = None,
        window_group: Optional[tuple[BlockAllocator, int]] = None,
        budgeted: bool = False,
    ):
        self.plan, self.max_slots, self.chunked = plan, max_slots, chunked
        self.chunk: int = chunk if chunk is not None else 0  # 0: no chunks (prompts run whole, nothing is prefilling)
        self.budgeted = budgeted
        self._first = self.chunk  # the first chunk's width of the rows `take_joining` took last
        self.blocks, self.block_size, self.share, self.ahead = blocks, int(block_size), share, ahead
        self.model, self.kv_length = model, kv_length
        self.costs = costs  # (the weights' bytes, one position's bytes): what a step reads (`step_split.py`)
        self.window = window if blocks is not None else None
        self.groups: list[BlockGroup] = []
        if blocks is not None:
            self.groups.append(BlockGroup(blocks, "blocks", self.window))
            if window_group is not None:
                self.groups.append(BlockGroup(window_group[0], "window_blocks", window_group[1]))
        self.waiting: deque = deque()
        self.rows: dict = {}  # slot -> the row that holds it
        self.joining: list = []  # the rows the current step's prefill takes from the queue
        self.mutex = threading.Lock()  # guards `waiting`, `joining` and the cancelled ids against other threads
        self._cancelled: set = set()
        self._last_was_prefill = False
        self._chunk_turn = False  # with rows prefilling and requests waiting, chunks and admissions alternate
        self._order = itertools.count()
        self.preemptions = 0  # rows preempted for want of blocks (reported)

    # ---- the queue (callable from other threads) ----------------------------------------------------
    def queue(self, row) -> None:
        with self.mutex:
            self.waiting.append(row)

    def cancel(self, request_id: Any) -> bool:
        """Drop a waiting request, or mark a running one to be freed before the next step; whether it was found."""
        with self.mutex:
            for row in self.waiting:
                if row.request.request_id == request_id:
                    self.waiting.remove(row)
                    return True
            if any(r.request.request_id == request_id for r in list(self.rows.values())):
                self._cancelled.add(request_id)
                return True
        return False

    def cancelled_slots(self) -> list:
        """The slots of running rows cancelled since the last call."""
        with self.mutex:
            cancelled, self._cancelled = self._cancelled, set()
        return [s for s, r in self.rows.items() if r.request.request_id in cancelled]

    def uses_adapter(self, name: str) -> bool:
        """Whether a waiting, joining or running request names adapter `name`."""
        with self.mutex:  # the rows a prefill is taking in are in neither `waiting` nor `rows` until it ends
            if any(r.request.adapter == name for r in list(self.waiting) + list(self.joining)):
                return True
        return any(r.request.adapter == name for r in list(self.rows.values()))

    # ---- the step rule --------------------------------------------------------------------------------
    def next_kind(self) -> Optional[str]:
        """What the next step does: "chunk" (the prefilling rows' next chunks, the decoding rows' next tokens),
        "admit" (a prefill of waiting requests), "decode", or None (nothing to run)."""
        busy = bool(decoding(self.rows))
        turn = not busy or not self._last_was_prefill  # after an admission, the decoding rows take a token first
        with self.mutex:
            admit = turn and bool(self.waiting) and len(self.rows) < self.max_slots and self._head_fits()
        chunk = turn and bool(prefilling(self.rows))
        if chunk and (not admit or self._chunk_turn):
            return "chunk"
        if admit:
            return "admit"
        return "decode" if busy else None

    def ran(self, kind: str) -> None:
        """Record that a step of `kind` (`next_kind`'s answer) ran."""
        self._last_was_prefill = kind == "admit"  # a chunk step gave the decoding rows their tokens
        if kind != "decode":
            self._chunk_turn = kind == "admit"

    def reset(self) -> None:
        """After the batch was dropped for a failure: the next step may admit at once."""
        self._last_was_prefill = False

    # ---- admission ------------------------------------------------------------------------------------
    def take_joining(self) -> list:
        """Take waiting rows for free slots, first come first served, as far as the pool's blocks go (each then holds
        its first step's blocks); they are `joining` until the loop holds them in `rows`."""
        with self.mutex:
            room = min(self.max_slots - len(self.rows), self.plan.batch_sizes[-1])
            self._first = self._joining_width()
            joining: list = []
            while self.waiting and len(joining) < room:
                if self.blocks is not None and not self._hold_first_blocks(self.waiting[0]):
                    break
                joining.append(self.waiting.popleft())
            self.joining = joining  # in the same critical section: `uses_adapter` never misses them
        for row in joining:
            row.order = next(self._order)
        return joining

    def adapter_load(self, row) -> tuple:
        """(the row's bank slot, the load it holds now): a reloaded adapter's prefixes are not the old one's."""
        bank = bank_of(self.model) if row.adapter else None
        return row.adapter, bank.load_of(row.adapter) if bank is not None else 0

    def scored(self, row) -> bool:
        """Whether the row's prefill scores its prompt (asked, and not a preempted row resuming: it was scored)."""
        return row.request.sampling.prompt_logprobs is not None and not row.resumed

    def chunk_at(self, batch: int) -> int:
        """The chunk width of a chunk step of batch bucket `batch`: the plan's chunk budget over it, or the one width."""
        width = self.plan.chunk_width_at(batch) if self.budgeted else None
        return self.chunk if width is None else width

    def chunk_now(self) -> int:
        """The width of the prefilling rows' next chunks on block caches, where they run in a batch of their own (its
        bucket the width's batch, `chunking.chunk_apart_plan`) and it is what their `reach` holds blocks for. On
        static caches, where a row's reach is its whole need, the widest (the batch's step runs its own width)."""
        if not self.budgeted or self.blocks is None:
            return self.chunk
        return self.chunk_at(self.plan.batch_bucket(max(len(prefilling(self.rows)), 1)))

    def _joining_width(self) -> int:
        """The first chunk's width of the next admission: the chunk budget's at the batch of the rows it may take (when
        fewer join, their prefill computes less than the budget)."""
        room = min(self.max_slots - len(self.rows), self.plan.batch_sizes[-1])
        return self.chunk_at(self.plan.batch_bucket(max(min(room, len(self.waiting)), 1)))

    def first_tokens(self, row, width: Optional[int] = None) -> list:
        """What a joining row's prefill runs: its prompt, or its first chunk of `width` tokens (None: the admission's,
        `take_joining`'s); a scored prompt is never chunked."""
        width = self._first if width is None else width
        return row.prompt[:width] if self.chunked and not self.scored(row) else row.prompt

    def _first_blocks(self, row, shared: int = 0, width: Optional[int] = None) -> int:
        """The pool blocks a joining row's first step writes beyond the `shared` blocks it holds already (0 on static
        caches): its prefill (its first chunk `width` wide, None: the admission's), or with shared blocks a chunk of
        that width after them (a wider one, when fewer rows chunk beside it, gets the rest from `make_room`)."""
        if self.blocks is None:
            return 0
        width = self._first if width is None else width
        if shared:
            return blocks_for(min(len(row.prompt), shared * self.block_size + width), self.block_size) - shared
        return blocks_for(len(self.first_tokens(row, width)), self.block_size)

    def _hold_first_blocks(self, row) -> bool:
        """Give a waiting row the blocks of its first step: the cached blocks of its prompt's prefix (shared, when
        prefix caching is on; its length then starts after them), then new ones. False (holding nothing) when
        what is spare does not cover the new ones."""
        assert self.blocks is not None, "blocks are held on block caches only"
        shared = self._share_prefix(row)
        row.length = shared * self.block_size
        self.slide(row)  # a cached prefix longer than the window: only its last blocks are read
        cost = self._first_blocks(row, shared)
        if cost > self.spare_blocks():
            self.release(row)
            row.length = 0
            return False
        if self.share and not self.scored(row):
            self.blocks.count_query(len(row.prompt), shared * self.block_size)
        for g in self.groups:
            setattr(row, g.attr, getattr(row, g.attr) + g.pool.take(cost))
        return True

    def _share_prefix(self, row) -> int:
        """Hold the cached blocks of the longest prefix of a waiting row's prompt in every group (none without prefix
        caching, or for a prompt it scores: that needs every position's logits): the full layers' blocks of the whole
        prefix, a window group's of its last window only (those behind it are `NULL_BLOCK`). Returns how many
        logical blocks the prefix covers."""
        for g in self.groups:
            setattr(row, g.attr, [])
        if not self.share or self.scored(row) or self.blocks is None:
            return 0
        key = adapter_key(row.request.adapter, *self.adapter_load(row))
        keys = block_keys(row.prompt, key, self.block_size)[: max(len(row.prompt) - 1, 0) // self.block_size]
        found = self.blocks.peek(keys)  # every layer reads the whole prefix (all-window models: slid just after)
        n, rest = len(found), self.groups[1:]
        for g in rest:  # the longest prefix whose last window's blocks each group has too
            assert g.window is not None, "a second group is a window group"
            while n and len(g.pool.peek(keys[self._behind(n, g.window) : n])) < n - self._behind(n, g.window):
                n -= 1
        self.blocks.hold(found[:n])
        row.blocks = found[:n]
        for g in rest:
            behind = self._behind(n, g.window)
            held = g.pool.peek(keys[behind:n])
            g.pool.hold(held)
            setattr(row, g.attr, [NULL_BLOCK] * behind + held)
        return n

    def _behind(self, n: int, window: Optional[int]) -> int:
        """Of a row's first `n` blocks, those no query after them reads through `window` (none without one)."""
        return 0 if window is None else min(blocks_behind(n * self.block_size, window, self.block_size), n)

    def _head_fits(self) -> bool:
        """Whether the first waiting row's prefill has its blocks free (always, on static caches)."""
        return (
            self.blocks is None or self._first_blocks(self.waiting[0], 0, self._joining_width()) <= self.spare_blocks()
        )

    def spare_blocks(self) -> int:
        """Free blocks beyond what the running rows' next steps take (a decoding row its next positions, a
        prefilling row its next chunk): what admission may give, so that a row it admits does not make the next step
        preempt (admitting into blocks the running rows are about to need only to preempt it again thrashes)."""
        if self.blocks is None:
            return 0
        return self.free_blocks() - sum(self._blocks_short(row) for row in self.rows.values())

    def free_blocks(self) -> int:
        """Blocks every group can still hand out (a step takes its new logical blocks in each)."""
        return min(g.pool.free for g in self.groups)

    def _blocks_short(self, row) -> int:
        """Blocks a running row lacks for its next step's positions (`reach`, up to the batch's KV length)."""
        kv = self.kv_length()
        upto = min(self.reach(row), kv) if kv is not None else self.reach(row)
        return max(blocks_for(upto, self.block_size) - len(row.blocks), 0)

    def reach(self, row) -> int:
        """The cache positions a row needs of the batch's shape: on static caches its whole need (K never changes
        under a row); on block caches those its next step writes and reads, at least one past what it holds (so K
        follows the rows' contexts, not their needs: a step reads K positions of every row, and a move costs a table
        copy). A joining row: its prefill, or after a cached prefix its next chunk."""
        if self.blocks is None:
            return row.need
        if row.length == 0:
            return len(self.first_tokens(row))
        if row.length < len(row.prompt):
            return min(len(row.prompt), row.length + self.chunk_now())
        return min(row.length + self.ahead, self.plan.kv_lengths[-1])

    # ---- blocks ---------------------------------------------------------------------------------------
    def kv_reach(self) -> int:
        """The KV bucket the running rows' next steps need (block caches)."""
        return self.plan.kv_bucket(max(self.reach(r) for r in self.rows.values()))

    def make_room(self, slots: list) -> tuple[list, bool]:
        """Give each row in `slots` (those the next step runs) blocks for the positions that step writes and reads
        (`reach`), oldest row first, preempting the newest running rows while the pool lacks blocks (nothing on
        static caches). Returns the rows preempted [(slot, row)], in order, whose device state the loop saves and
        clears, and whether any row's blocks changed (the block table needs writing)."""
        preempted: list = []
        changed = False
        if self.blocks is None:
            return preempted, changed
        for slot in sorted(slots, key=lambda s: self.rows[s].order):
            if slot not in self.rows:  # preempted for an older row
                continue
            row = self.rows[slot]
            changed |= self.slide(row)
            more = self._blocks_short(row)
            while more > self.free_blocks() and slot in self.rows:
                newest = max(self.rows, key=lambda s: self.rows[s].order)
                preempted.append((newest, self._preempt(newest)))
            if slot in self.rows and more > 0:
                for g in self.groups:
                    getattr(row, g.attr).extend(g.pool.take(more))
                changed = True
        return preempted, changed

    def _preempt(self, slot: int):
        """Take the row's slot and blocks and queue it first: it resumes by prefilling its prompt and what it
        generated, and goes on as if it had never stopped."""
        row = self.rows.pop(slot)
        self.release(row)
        row.prompt = list(row.request.prompt) + row.tokens
        row.length, row.resumed = 0, bool(row.generated)
        with self.mutex:
            self.waiting.appendleft(row)
        self.preemptions += 1
        logger.debug("preempted request %r for want of KV blocks", row.request.request_id)
        return row

    def release(self, row) -> None:
        """Give the row's blocks back to the pool, in every group."""
        for g in self.groups:
            held = getattr(row, g.attr)
            if held:
                g.pool.give_back([b for b in held if b != NULL_BLOCK])
        row.blocks, row.window_blocks = [], []

    def register(self, row, upto: Optional[int] = None) -> None:
        """Cache the row's prompt's full blocks (its first `upto` logical blocks at most) under their keys, in every
        group: what a later prompt with the same prefix holds instead of computing it."""
        load = self.adapter_load(row)
        keys = block_keys(row.prompt, adapter_key(row.request.adapter, *load), self.block_size)[:upto]
        for g in self.groups:
            g.pool.register(getattr(row, g.attr)[:upto], keys, tag=load if row.adapter else None)

    def slide(self, row) -> bool:
        """With a sliding window: give back the row's blocks that no query of its next step (from `row.length` on)
        reads, each entry now `NULL_BLOCK`, in each group that has one. A prompt's full blocks are registered first
        when prefix caching is on (as `loop.py` registers them once the prompt is in). Whether any went back (the
        table needs writing)."""
        changed = False
        for g in self.groups:
            held = getattr(row, g.attr)
            if g.window is None:
                continue
            behind = min(blocks_behind(row.length, g.window, self.block_size), len(held))
            if behind == 0 or held[behind - 1] == NULL_BLOCK:  # given back from the front: all before it are too
                continue
            gone = [b for b in held[:behind] if b != NULL_BLOCK]
            if self.share and not self.scored(row):
                self.register(row, behind)
            g.pool.give_back(gone)
            held[:behind] = [NULL_BLOCK] * behind
            changed = True
        return changed

    def peak_blocks(self, prompt: int, need: int, scored: bool) -> list[tuple[BlockGroup, int]]:
        """The most blocks a request of a `prompt`-token prompt and `need` positions holds at once, in each group: all
        of them, or with a sliding window and prompts chunked those of its widest step's window (a chunk, or a verify
        step's tokens), or of its prompt when it scores it (one prefill). Admission refuses a request one of these
        does not fit."""
        out = []
        for g in self.groups:
            if g.window is None or not self.chunked:  # unchunked, a resumed row prefills all it holds at once
                out.append((g, blocks_for(need, self.block_size)))
                continue
            most = min(
                blocks_for(need, self.block_size), window_blocks(g.window, max(self.chunk, self.ahead), self.block_size)
            )
            out.append((g, max(most, blocks_for(prompt, self.block_size)) if scored else most))
        return out

    # ---- plans ----------------------------------------------------------------------------------------
    def adapters(self, batch: int, rows: Optional[list] = None) -> Optional[list]:
        """Each row's adapter bank slot for a step (None: the model batches no adapters): `rows` [(slot, row)] a
        prefill's, in order; None: every slot of a batch of `batch` rows (0 for a free one)."""
        if bank_of(self.model) is None:
            return None
        if rows is not None:
            return [r.adapter for _, r in rows]
        return [self.rows[s].adapter if s in self.rows else 0 for s in range(batch)]

    def prefill_plan(self, whole: list, given: list, batch: int) -> StepPlan:
        """The prefill of joining rows `whole` [(slot, row)], `given[i]` the tokens row i runs: its prompt, or its
        first chunk (such a row chooses nothing yet)."""
        done = [i for i, (_, row) in enumerate(whole) if len(given[i]) == len(row.prompt)]
        choosing = [whole[i][0] for i in done]
        return StepPlan(
            "prefill",
            [s for s, _ in whole],
            choosing,
            done,
            [whole[i][1].generated for i in done],
            given,
            adapters=self.adapters(batch, whole),
            scores=any(self.scored(r) for _, r in whole),
            scored=[r.request.sampling.prompt_logprobs if self.scored(r) else None for _, r in whole],
            advance={slot: len(g) for (slot, _), g in zip(whole, given)},
            completes=choosing,
        )

    def chunk_plan(self, batch: int, kv: int) -> StepPlan:
        """The next chunk of every prefilling row (`chunking.py`)."""
        return chunk_plan(self.rows, batch, kv, self.chunk_at(batch), self.adapters(batch))

    def chunk_apart_plan(self, own: tuple) -> Optional[StepPlan]:
        """The prefilling rows' next chunks in a step of their own, over a view of the block pool; None when that view
        would be `own`, the batch's shape (`chunking.chunk_apart_plan`)."""
        adapters = {s: r.adapter for s, r in self.rows.items()} if bank_of(self.model) is not None else None
        return chunk_apart_plan(self.rows, self.plan, self.chunk_at, adapters, own)

    def decode_apart_plans(self, batch: int, kv: int) -> Optional[list]:
        """On block caches, the decoding rows' decode step as steps over views of the pool, each of its own batch
        and KV buckets: the decoding rows alone, or the short contexts and the long ones apart, when they read less
        than the one step of the batch's `[batch, kv]` shape (`step_split.split_by_context`); None: that step."""
        if self.costs is None:  # static caches
            return None
        reach = {s: self.reach(self.rows[s]) for s in decoding(self.rows)}
        groups = split_by_context(reach, batch, kv, self.plan, *self.costs)
        if groups is None:
            return None
        has_bank = bank_of(self.model) is not None
        plans = []
        for group in groups:
            size = self.plan.batch_bucket(len(group))
            plans.append(
                decode_step(
                    self.rows,
                    group,
                    dict(enumerate(group)),
                    size,
                    adapters=[self.rows[s].adapter for s in group] + [0] * (size - len(group)) if has_bank else None,
                    fails=group,
                    view=(size, self.plan.kv_bucket(max(reach[s] for s in group))),
                )
            )
        return plans

    def decode_plan(self, batch: int) -> StepPlan:
        """One token of every decoding row; a prefilling row takes part at its length (its next chunk rewrites it)
        and a free slot at 0, their outputs dropped."""
        return decode_step(
            self.rows,
            decoding(self.rows),
            {slot: slot for slot in self.rows},
            batch,
            adapters=self.adapters(batch),
            fails=sorted(self.rows),  # the prefilling rows too: their positions were in the step
        )


def decode_step(
    rows: dict,
    slots: list,
    placed: dict,
    size: int,
    adapters: Optional[list],
    fails: list,
    view: Optional[tuple] = None,
) -> StepPlan:
    """A decode step of `size` rows in which row i holds `rows[placed[i]]`'s last token at its length (other rows 0):
    the rows `slots` choose their next token from their row of the step (a prefilling row placed in it takes part at
    its length, its next chunk rewriting it, and its linear-attention state waits for its chunks); `view`: the pool's
    view the step runs on (its rows are `slots` in order), None: the batch's own cache."""
    last, at = [0] * size, [0] * size
    for i, slot in placed.items():
        last[i], at[i] = rows[slot].last, rows[slot].length
    row_of = {slot: i for i, slot in placed.items()}
    picks = [row_of[s] for s in slots]  # where each choosing row's logits are among the step's
    return StepPlan(
        "decode",
        slots,
        slots,
        picks,
        [rows[s].generated for s in slots],
        torch.tensor(last, dtype=torch.long).view(size, 1),  # one tensor, not an element write a row
        torch.tensor(at, dtype=torch.long).view(size, 1),
        adapters=adapters,
        counts={p: 0 for p in picks},
        advance={s: 1 for s in slots},
        fails=fails,
        view=view,
    )


__all__ = ["Scheduler", "decode_step"]
