"""The one generation loop: requests join and leave a batch of slots between decode steps.

    loop = GenerationLoop(engine, settings)
    loop.add(GenerationRequest(prompt_ids, max_new_tokens=64, sampling=SamplingParams(...)))
    while not loop.idle:
        for event in loop.step():      # TokenEvent: request id, token id, finish reason
            ...

`generate()`, `pipeline`, `staticformers generate` and the server all drive this loop.

Each `step()` is: schedule, run, emit. The scheduler (`scheduler.py`) keeps the queue and the running rows, decides
what runs next, gives rows their KV blocks (preempting when the pool runs out) and describes the step as a
`step_plan.StepPlan`; the runner (`runner.py`) runs it and returns a `StepResult`; the loop applies it to the rows and
emits their events. The loop itself owns the batch's device state: its cache's shape (allocating it, moving rows to
another shape), the rows' samplers and grammars, the prefix pools, and what a failure ends.

Design choices:

- **Slots.** The batch is the rows of one `[B, K]` static cache (`models/kv_cache.py`), B a batch bucket of the
  plan, K one of its KV lengths. A request owns one row (its slot) from its prefill to its last token.
  Its prompt is inserted into positions `0..n-1` of that row while the other rows keep their state;
  each decode step feeds every row its last token at its own position. Empty rows ride along (masked,
  their outputs dropped), so a decode step is always the one `[B, 1]` graph of the cache's shape.
- **One device call per `step()`.** A step either prefills waiting requests into free slots (all that
  fit, as one prefill batch, first come first served) or runs one decode step over the running rows.
  A prefill never follows a prefill while rows are running: between two decode steps there is at most
  one prefill, as in the Neuron serving stacks. A running request's inter-token latency therefore grows
  by at most one prefill (of at most the largest batch bucket of prompts) when others join; a joining
  request waits at most one decode step before its prefill.
- **KV length follows the requests.** A row needs `prompt + max_new_tokens - 1` positions
  (`ShapePlan.positions_needed`); the cache's K is the smallest KV length holding every row's need, and
  B the smallest batch bucket holding every row. When a joining request needs more (a longer answer,
  one row too many), the batch *moves*: the running rows are copied into the engine's cache of the
  larger shape (`KVCache.copy_rows`, one copy of the rows' keys and values, i.e. of the old cache at
  most) and decoding continues there with that shape's graph. When rows leave and a smaller shape would
  do, the batch moves down only if that shape's decode graph is already built, so a move never
  compiles; when the last row leaves, the next request starts from the smallest shape it needs.
- **Adapters per row.** A request may name a LoRA adapter (`GenerationRequest.adapter`) held by the
  model's adapter bank (`adapters/bank.py`: stacked adapter weights, slot 0 = none); each prefill and
  decode step passes every row's slot to the engine, which writes them into the bank's rows index in
  place. Rows of different adapters (and of none) share one batch and one graph of its shape.
- **Sampling per row on the device** (`sampling.RowSampler`): each request has its own settings and
  seed; only the chosen ids (and log-probabilities when asked) come back to the host.
- **Grammars per row as data** (`constraints.RowConstraints`): a request's `structured_outputs` is
  matched on the host; its row's words of one packed bitmask are filled while the device step runs and
  mask the logits before the choice; no graph is added. A complete grammar ends its row ("stop").
- **Prompt log-probabilities from the prefill.** When a joining request asks for them
  (`SamplingParams.prompt_logprobs`), its prefill batch runs the engine's scoring prefill (the same
  shape, `Engine.prefill(..., scores=True)`), and the request's first event carries them.
- **One loop per engine at a time.** The loop holds the engine's lock from its first step until it is
  idle again, so caches are never shared by two loops; `add` and `cancel` may be called from other
  threads.
- **Failures stay inside the step.** An exception in a prefill or decode ends the requests of that
  call with an event whose `error` is set (their slots are freed); the loop itself keeps working. An
  exception anywhere else in a step (choosing shapes, moving the batch, emitting events) ends every
  request of the batch that the step had not ended yet, and the batch is rebuilt from the queue.
- **Chunked prefill and prefix caching** (`chunked_prefill=C`, `prefix_caching=True`): a prompt longer
  than C runs as chunks through the engine's extend step (with the plan's chunk budget, `chunked_prefill=True`,
  each step's C is the budget over its batch bucket), one chunk of every prefilling row per
  chunk step, in which every decoding row also takes its next token (`chunking.py`; on block caches the chunks run
  apart, in a view of the pool holding only the prefilling rows, after a decode step, and that decode step may
  itself split the rows by context: `step_split.py`); a prompt whose first blocks were
  computed before has them copied from the device pool into its slot and prefills only the rest
  (`prefix_cache.py`).
- **Block caches** (`kv_blocks=N`, the server's `--num-gpu-blocks-override` / `--kv-cache-memory-bytes`): the
  cache is a view of one pool of blocks (`models/block_kv_cache.py`) and a row holds only the blocks its tokens
  fill (`kv_blocks.py` keeps the account). Before each step every row of it gets blocks for the positions that
  step writes and reads (`Scheduler.make_room`: a decoding row its next position, or k+1 when verifying; a prefilling row
  its next chunk), the oldest row first; when the pool runs out, the newest row is *preempted*: its blocks are
  freed, and it waits first in the queue with its prompt and what it generated, to resume by prefilling them
  (chunked), its sampling generator and grammar state kept, so it finishes as it would have. A request joins
  only when its first chunk fits in the blocks the running rows' next steps leave (`Scheduler.spare_blocks`: admitting
  into blocks about to be needed would preempt it again at once). A batch moving to another shape copies table
  rows, not keys and values. The table is data: the plan's graphs are the static cache's. With prefix caching a
  joining prompt *holds* the cached blocks of its prefix (`kv_blocks.BlockAllocator.match`: chained keys with
  the adapter's load in them), its rest running as chunks: no copy and no graph; a row whose prompt is in
  registers its full blocks, which stay cached after it ends until the pool needs them (least recently used
  first).
- **Rows end, the batch stays.** A row that ends (even on its first token, while others of its prefill
  are still being emitted) only frees its slot; the batch is dropped at the end of a step that leaves
  no row running, so the next request starts from the smallest shape it needs.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional

import torch

from ..adapters.bank import bank_of
from ..adapters.lora import BASE
from ..models.kv_cache import KVCache, bytes_per_position
from .constraints import Grammar, RowConstraints
from .engine import CompileSettings, Engine
from .kv_blocks import BlockAllocator, sliding_window, window_group, window_spec
from .chunking import chunk_width, decoding, positions_needed, prefilling, widest_steps
from .plan import ShapePlan
from .prefix_cache import PrefixCache, adapter_key
from .runner import StepRunner
from .scheduler import Scheduler
from .sampling import RowSampler, SamplingParams
from .requests import GenerationRequest, Row, TokenEvent
from .step_plan import StepPlan, StepResult

logger = logging.getLogger("staticformers")


def refuse_on_linear_attention(config, prefix_caching: bool) -> None:
    """A hybrid model's linear-attention layers keep one recurrent state per request, not one per position: a
    cached prefix of positions holds nothing they could start from. One sentence."""
    if prefix_caching and getattr(config, "has_linear_attention", False):
        raise ValueError(
            f"prefix caching is not supported for {config.architecture}: its linear-attention layers "
            f"keep one recurrent state per request, not per position, so a cached prefix holds nothing "
            f"they could resume from: turn prefix caching off."
        )


class GenerationLoop:
    """Continuous batching over the slots of the engine's static caches (see the module docstring).

    `chunked_prefill`: a chunk width C the plan declares as an extend width `(C, 1)` (True: the widest it
    declares, or with the plan's chunk budget `chunk_tokens` each chunk step's batch's width), None: every prompt in
    one prefill. `prefix_caching`: keep prompt prefixes in a pool of
    `prefix_cache_blocks` blocks of `prefix_block_size` tokens (the rest of a prompt that hits runs through
    the extend step: the plan must declare one). `kv_blocks`: run on block caches (`models/block_kv_cache.py`)
    over one pool of that many blocks of `kv_block_size` positions, each row holding the blocks its tokens fill;
    when the pool runs out, the newest row is preempted and later resumed by recomputation (None: static caches,
    a row holding its whole need from its prefill)."""

    def __init__(
        self,
        engine: Engine,
        settings: CompileSettings,
        plan: Optional[ShapePlan] = None,
        max_batch_size: Optional[int] = None,
        speculator=None,
        chunked_prefill=None,
        prefix_caching: bool = False,
        prefix_cache_blocks: int = 256,
        prefix_block_size: int = 32,
        kv_blocks: Optional[int] = None,
        kv_block_size: int = 32,
    ):
        self.engine, self.settings = engine, settings
        refuse_on_linear_attention(engine.model.config, prefix_caching)
        self.plan = plan.bind(engine.model.config.max_position_embeddings) if plan is not None else engine.plan
        # speculative decoding (`speculative/step.py`): its verify step replaces the decode step
        self.speculator = speculator
        if speculator is not None:
            self.plan = speculator.plan_for(self.plan)
        engine.follow(self.plan)  # a hybrid's states per verified position and its chunk
        self.runner = StepRunner(engine, settings, self.plan)
        largest = self.plan.batch_sizes[-1]
        self.max_slots = min(int(max_batch_size), largest) if max_batch_size else largest
        self.vocab = engine.model.config.vocab_size
        self.cache: Optional[KVCache] = None
        self.sampler: Optional[RowSampler] = None
        self.constraints: Optional[RowConstraints] = None
        self.moves = 0  # batch moves to another shape (reported)
        self._events: list = []  # what the current step produced so far
        self._holding = False
        self._ids = itertools.count()
        self.chunked = chunked_prefill is not None and chunked_prefill is not False
        self.chunk = (
            chunk_width(self.plan, None if chunked_prefill is True else chunked_prefill)
            if self.chunked or prefix_caching
            else None
        )
        # the plan's chunk budget gives each chunk step its batch's width (a width passed as a number is every batch's)
        passed = isinstance(chunked_prefill, int) and not isinstance(chunked_prefill, bool)
        budgeted = self.chunk is not None and not passed and self.plan.chunk_tokens is not None
        # prefix caching: on static caches a pool its blocks are copied from; on block caches the blocks are shared
        self.prefix = (
            PrefixCache(engine.model, prefix_cache_blocks, prefix_block_size, engine.tp)
            if prefix_caching and kv_blocks is None
            else None
        )
        self.share = bool(prefix_caching and kv_blocks is not None)
        self._owner: Any = None  # the weights' fingerprint the shared blocks' keys were computed under
        self._bank_changes = -1  # the adapter bank's `changes` when the prefix pool last retired blocks
        # block caches: a row was freed since the table was written, so its slot's entries still name blocks that
        # are free (or cached, or another row's); every step writes every row, a free one too, so the table is
        # written again before the next step
        self._table_stale = False
        self.chunks = 0  # extend steps run for chunks (reported)
        self.blocks = self._block_allocator(kv_blocks, kv_block_size)
        self.block_size = int(kv_block_size)
        ahead = speculator.width if speculator is not None else 1
        # a model mixing window and full layers: the window layers' blocks in a pool and an account of their own
        steps = widest_steps(self.plan, self.chunk if self.chunked else None, budgeted)
        self._window_spec = (  # (the window layers, their pool's blocks): the engine's pool spec
            window_spec(
                engine.model.config, kv_blocks, self.max_slots, steps, self.plan.max_model_len, self.block_size, ahead
            )
            if kv_blocks is not None
            else None
        )
        self.window_blocks = BlockAllocator(self._window_spec[1]) if self._window_spec is not None else None
        mixed = window_group(engine.model.config) if self.window_blocks is not None else None
        self.scheduler = Scheduler(
            self.plan,
            self.max_slots,
            self.chunk,
            self.chunked,
            self.blocks,
            self.block_size,
            self.share,
            ahead,
            engine.model,
            lambda: self.cache.max_length if self.cache is not None else None,
            self._read_costs() if self.blocks is not None else None,
            sliding_window(engine.model.config) if self.blocks is not None else None,
            (self.window_blocks, mixed[1]) if self.window_blocks is not None and mixed is not None else None,
            budgeted=budgeted,
        )
        engine.use_blocks(kv_blocks, kv_block_size, self._window_spec)

    def _read_costs(self) -> tuple:
        """(the weights' bytes on this rank, one position's bytes over the layers): what a step reads, from which the
        scheduler decides whether a decode step is split by context (`step_split.py`)."""
        model, tp = self.engine.model, max(self.engine.tp, 1)
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) // tp
        return weights, bytes_per_position(model.config, model.dtype, tp)

    def _block_allocator(self, blocks, size) -> Optional[BlockAllocator]:
        """The pool's account for `kv_blocks=blocks` (None: static caches); what block caches cannot run yet is
        refused here, one sentence each."""
        if blocks is None:
            return None
        config = self.engine.model.config
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"kv_block_size={size!r} must be a positive number of positions.")
        if getattr(config, "has_linear_attention", False):
            raise ValueError(
                f"kv_blocks is not supported for {config.architecture}: its linear-attention layers keep "
                f"one state per request, not blocks of positions; leave kv_blocks unset."
            )
        if self.speculator is not None and getattr(self.speculator.proposer, "own_cache", False):
            raise ValueError(
                "a draft model keeps its own static cache rows, which a preempted request would lose: "
                "use prompt-lookup (ngram) speculation with kv_blocks, or leave kv_blocks unset."
            )
        odd = [k for k in self.plan.kv_lengths if k % size]
        if odd:
            raise ValueError(
                f"The KV block size {size} (kv_block_size, the server's --block-size) does not divide "
                f"the plan's KV lengths {odd}: choose a block size that divides every KV length of the "
                f"plan."
            )
        if not self.chunked and self.plan.prompt_lengths[-1] < self.plan.kv_lengths[-1]:
            raise ValueError(
                "a preempted request resumes by prefilling its prompt and what it generated, which can "
                "outgrow the largest prompt bucket: turn chunked prefill on with kv_blocks."
            )
        return BlockAllocator(blocks)

    # ---- requests --------------------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> int:
        """Check a request against the model and the plan before any work; returns the positions it needs."""
        return self._checked(request)[0]

    def _checked(self, request: GenerationRequest) -> tuple[int, int]:
        """`validate`'s checks; returns the positions the request needs and its adapter's bank slot."""
        prompt = request.prompt
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("The prompt is empty: pass at least one token id.")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise ValueError("The prompt must be a list of integer token ids.")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.vocab:
            raise ValueError(f"The prompt holds ids outside the vocabulary [0, {self.vocab}): found {low}..{high}.")
        n = request.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_new_tokens={n!r} must be a positive integer.")
        if not isinstance(request.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, not {type(request.sampling).__name__}.")
        grammar = request.structured_outputs
        if grammar is not None and not isinstance(grammar, Grammar):
            raise TypeError(
                f"structured_outputs must be a compiled Grammar (GrammarCompiler.compile), not "
                f"{type(grammar).__name__}."
            )
        if grammar is not None and grammar.compiler.vocab_size != self.vocab:
            raise ValueError(
                f"structured_outputs was compiled for a vocabulary of {grammar.compiler.vocab_size} ids, "
                f"the model has {self.vocab}: compile it with vocab_size={self.vocab}."
            )
        if self.chunked and request.sampling.prompt_logprobs is not None:
            self.plan.prompt_bucket(len(prompt))  # scored prompts run in one prefill
        need = positions_needed(self.plan, len(prompt), n, self.chunked)
        if self.speculator is not None:
            need = self.speculator.need(need, self.plan)
        for group, peak in self.scheduler.peak_blocks(len(prompt), need, request.sampling.prompt_logprobs is not None):
            if peak > group.pool.blocks:  # the full layers' pool: the window layers' never holds less than their peak
                raise ValueError(
                    f"The request needs {need} cache positions, {peak} blocks of {self.block_size} at once, and the "
                    f"KV pool has {group.pool.blocks}: lower max_new_tokens or give the pool more blocks."
                )
        slot = self.adapter_slot(request)
        request.prompt = list(prompt)
        return need, slot

    def adapter_slot(self, request: GenerationRequest) -> int:
        """The bank slot of the request's adapter (0: none); an adapter the model does not hold is refused."""
        if request.adapter is not None and not isinstance(request.adapter, str):
            raise TypeError(f"adapter must be an adapter's name or None, not {type(request.adapter).__name__}.")
        bank = bank_of(self.engine.model)
        if bank is None:
            if request.adapter is not None and request.adapter != BASE:
                raise ValueError(
                    f"The request asks for adapter {request.adapter!r} but the model batches no adapters: "
                    f"load them and call model.enable_adapter_batching() first."
                )
            return 0
        return bank.slot_of(request.adapter)

    def add(self, request: GenerationRequest) -> Any:
        """Queue a request (validated now; see `validate`); returns its id (given, or a new integer)."""
        need, slot = self._checked(request)
        if request.request_id is None:
            request.request_id = next(self._ids)
        self.scheduler.queue(Row(request, need, slot))
        return request.request_id

    def cancel(self, request_id: Any) -> bool:
        """Stop a request: dropped if waiting, its slot freed before the next step if running. Whether
        it was found."""
        return self.scheduler.cancel(request_id)

    def uses_adapter(self, name: str) -> bool:
        """Whether a waiting or running request names adapter `name` (callable from other threads)."""
        return self.scheduler.uses_adapter(name)

    @property
    def rows(self) -> dict:
        """The running rows by slot (the scheduler's)."""
        return self.scheduler.rows

    @rows.setter
    def rows(self, rows: dict) -> None:
        self.scheduler.rows = rows

    @property
    def waiting(self):
        """The queued rows, first to join first (the scheduler's)."""
        return self.scheduler.waiting

    @property
    def preemptions(self) -> int:
        """Rows preempted for want of blocks (reported)."""
        return self.scheduler.preemptions

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.rows

    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def padding_slots(self) -> int:
        """Rows of the current batch that carry no request (computed and dropped each decode step)."""
        return (self.cache.batch - len(self.rows)) if self.cache is not None else 0

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One device call: a prefill of waiting requests into free slots, or a decode step (see the module
        docstring); returns the events it produced."""
        if not self._holding:
            self.engine.lock.acquire()
            self._holding = True
            # this loop's kind of cache: another loop may have run on the engine with the other kind since
            self.engine.use_blocks(
                self.blocks.blocks if self.blocks is not None else None, self.block_size, self._window_spec
            )
        self._events, self.scheduler.joining = [], []
        try:
            for slot in self.scheduler.cancelled_slots():
                self._free(slot)
            kind = self.scheduler.next_kind()
            if kind == "chunk":
                self._chunk_or_decode()
            elif kind == "admit":
                if not self._admit() and prefilling(self.rows):  # all hits: their rest runs now
                    self._chunk_or_decode()
            elif kind == "decode":
                self._make_room(decoding(self.rows))
                if decoding(self.rows):  # none when every decoding row was preempted for another's blocks
                    self._decode()
            if kind is not None:
                self.scheduler.ran(kind)
            self._maybe_shrink()
        except Exception as exc:  # whatever broke, the requests it touched end with it and the loop starts clean
            logger.exception("a generation step failed: its requests fail and the batch starts again")
            self._fail_all(exc)
        finally:
            if not self.rows:  # the next request starts from the smallest shape it needs
                self.cache, self.sampler, self.constraints = None, None, None
            if self.idle:
                self.close()
        events, self._events, self.scheduler.joining = self._events, [], []
        return events

    def _fail_all(self, exc: BaseException) -> None:
        """End every request of the batch (running or joining) that this step has not already ended, with
        an error event, and drop the batch: the next step builds its state again from the waiting queue."""
        ended = {e.request_id for e in self._events if e.finish_reason is not None}
        held = {id(r) for r in self.rows.values()}
        rows = list(self.rows.values()) + [r for r in self.scheduler.joining if id(r) not in held]
        for row in rows:
            if row.request.request_id not in ended:
                ended.add(row.request.request_id)
                self._events.append(TokenEvent(row.request.request_id, None, row.generated, "error", error=exc))
        for row in rows:
            self.scheduler.release(row)
        self.rows.clear()
        self.cache, self.sampler, self.constraints = None, None, None
        self.scheduler.reset()

    def abandon(self, error: BaseException) -> list[TokenEvent]:
        """End every running request with `error` and drop the batch (waiting requests stay queued):
        for a caller whose `step` raised past the loop's own recovery. Returns their error events."""
        self._events = []
        self._fail_all(error)
        events, self._events, self.scheduler.joining = self._events, [], []
        if self.idle:
            self.close()
        return events

    def close(self) -> None:
        """Drop the batch and let other loops use the engine (called by `step` when idle)."""
        self.cache, self.sampler, self.constraints = None, None, None
        if self._holding:
            self._holding = False
            self.engine.lock.release()

    def _free(self, slot: int) -> None:
        """Give a row's slot back. The batch itself is dropped by `step` once no row is left, never here:
        rows that join in the same prefill still need it after an earlier one ends on its first token."""
        self.scheduler.release(self.rows.pop(slot))
        self._clear_slot(slot)
        self._table_stale = self.blocks is not None

    def _clear_slot(self, slot: int) -> None:
        """Forget a freed slot's sampling and grammar state."""
        if self.sampler is not None:
            self.sampler.clear_row(slot)
        if self.constraints is not None:
            self.constraints.clear_row(slot)

    # ---- prefill -----------------------------------------------------------------------------------
    def _admit(self) -> bool:
        """Give waiting requests free slots and prefill them: a prefix-cache hit has its blocks copied, a
        prompt longer than the chunk width gets its first chunk; the rest of both runs as chunks
        (`chunking.py`). Returns whether a prefill ran (False: only hits joined)."""
        self._own_prefixes()
        joining = self.scheduler.take_joining()
        if not joining:  # its cached prefix's blocks were free ones: what is left does not cover the rest
            return False
        try:
            self._fit(
                len(self.rows) + len(joining), max(self.scheduler.reach(r) for r in joining + list(self.rows.values()))
            )
            slots = [s for s in range(self.cache.batch) if s not in self.rows][: len(joining)]
            for slot, row in zip(slots, joining):
                self.sampler.set_row(slot, row.request.sampling, row.prompt)
                self.constraints.set_row(slot, row.request.structured_outputs, row.request.sampling.eos_token_ids)
                if row.resumed:  # where its sampling and grammar were when it was preempted
                    self.sampler.generators[slot] = row.generator or self.sampler.generators[slot]
                    self.constraints.rows[slot] = row.grammar
            if self.blocks is not None:
                self._write_table({**self.rows, **dict(zip(slots, joining))})
            whole, given = [], []  # the rows this prefill runs, and the tokens each one gets
            for slot, row in zip(slots, joining):
                if row.length:  # it holds its prefix's shared blocks: the rest runs as chunks
                    continue
                hit = self._match_prefix(row)
                if hit:
                    self.prefix.load(self.cache, slot, hit)
                    self.engine.backend.flush(self.engine.model.device)  # its own graph on a lazily traced device
                    row.length = len(hit) * self.prefix.block_size
                    continue
                whole.append((slot, row))
                given.append(self.scheduler.first_tokens(row))
            step = result = None
            if whole:
                step = self.scheduler.prefill_plan(whole, given, self.cache.batch)
                result = self.runner.run(step, self.cache, self.sampler, self.constraints)
        except Exception as exc:  # the joining requests fail; the running ones are untouched
            logger.exception("prefill failed for %d request(s)", len(joining))
            for slot in [s for s in range(self.cache.batch if self.cache else 0) if s not in self.rows]:
                if self.sampler is not None:
                    self.sampler.clear_row(slot)
                if self.constraints is not None:
                    self.constraints.clear_row(slot)
            for row in joining:
                self.scheduler.release(row)
            self._events += [TokenEvent(r.request.request_id, None, r.generated, "error", error=exc) for r in joining]
            return True
        for slot, row in zip(slots, joining):  # every joining row holds its slot before any of them may end
            self.rows[slot] = row
        if step is not None:
            self._apply(step, result)
        return bool(whole)

    def _make_room(self, slots: list) -> None:
        """Before a step on block caches: the batch moves to a longer KV length if a row's reach outgrew it (a table
        copy), then the scheduler gives the step's rows their blocks (`Scheduler.make_room`); a row it preempted
        keeps its sampling generator and grammar state, to resume as if it had never stopped."""
        if self.blocks is None:
            return
        reach = self.scheduler.kv_reach()
        if reach > self.cache.max_length:  # the longest context outgrew the batch's KV length: a table copy
            slots_now = sorted(self.rows)
            self._move(self.cache.batch, reach, slots_now, slots_now)
        preempted, changed = self.scheduler.make_room(slots)
        for slot, row in preempted:
            row.generator = self.sampler.generators[slot] if self.sampler is not None else None
            row.grammar = self.constraints.rows[slot] if self.constraints is not None else None
            self._clear_slot(slot)
        if changed or self._table_stale:  # a freed row's entries point at blocks it no longer holds
            self._write_table(self.rows)

    def _write_table(self, rows: dict, view: Optional[KVCache] = None) -> None:
        """The block cache's tables (or `view`'s, a view of its pool) from `rows` {row: the `Row` there}; every other
        row's entries the null block. Its own graph on a lazily traced device (flushed), not part of the next step's."""
        cache = view or self.cache
        windows = {i: r.window_blocks for i, r in rows.items()} if self.window_blocks is not None else None
        cache.write_table({i: r.blocks for i, r in rows.items()}, windows)
        if view is None:
            self._table_stale = False
        self.engine.backend.flush(self.engine.model.device)

    def prefix_counts(self) -> Optional[tuple[int, int]]:
        """(prompt tokens looked up, found cached) since the loop started, as vLLM counts them; None without prefix
        caching."""
        if self.share:
            return self.blocks.queries, self.blocks.hits
        return (self.prefix.queries, self.prefix.hits) if self.prefix is not None else None

    @property
    def kv_usage(self) -> float:
        """The share of the pool's blocks that rows hold (0 on static caches); with a window group, the fuller of the
        two pools (either running out preempts)."""
        groups = self.scheduler.groups
        return max((g.pool.used / g.pool.blocks for g in groups), default=0.0)

    @property
    def blocks_used(self) -> int:
        """Pool blocks the rows hold (0 on static caches)."""
        return self.blocks.used if self.blocks is not None else 0

    def _own_prefixes(self) -> None:
        """Before a prefill or chunk matches or stores prefixes: empty the pool if the weights changed (once per
        call: the fingerprint walks the parameters), and free the blocks of adapter loads the bank no longer
        holds (an adapter unloaded or reloaded: its slot written in place, which the fingerprint cannot see).
        Shared blocks: their keys are dropped instead (the blocks rows hold stay theirs)."""
        if self.share:
            owner = self.engine.weights_fingerprint()
            if owner != self._owner:
                for g in self.scheduler.groups:
                    g.pool.forget()
                self._owner = owner
            bank = bank_of(self.engine.model)
            if bank is not None and bank.changes != self._bank_changes:
                self._bank_changes = bank.changes
                for g in self.scheduler.groups:
                    g.pool.retire(lambda tag: tag is None or bank.load_of(tag[0]) == tag[1])
        if self.prefix is not None:
            self.prefix.owned_by(self.engine.weights_fingerprint())
            bank = bank_of(self.engine.model)
            if bank is not None and bank.changes != self._bank_changes:
                self._bank_changes = bank.changes
                self.prefix.retire(lambda tag: tag is None or bank.load_of(tag[0]) == tag[1])

    def _match_prefix(self, row: Row) -> list:
        """The pool rows of the prefix cache's longest match for a joining row ([] when caching is off, or the
        request scores its prompt, which needs every position's logits)."""
        if self.prefix is None or row.request.sampling.prompt_logprobs is not None:
            return []
        return self.prefix.match(
            row.request.prompt, adapter_key(row.request.adapter, *self.scheduler.adapter_load(row))
        )

    def _store_prefix(self, slot: int, row: Row) -> None:
        """Keep the blocks of a row whose prompt is now all in its cache row (prefix caching on): copied into the
        pool, or on block caches its full blocks registered under their keys, shared as they are."""
        if self.share:
            self.scheduler.register(row)
        if self.prefix is not None:
            load = self.scheduler.adapter_load(row)
            if self.prefix.store(
                self.cache,
                slot,
                row.request.prompt,
                adapter_key(row.request.adapter, *load),
                tag=load if row.adapter else None,
            ):
                self.engine.backend.flush(self.engine.model.device)

    def _fail_rows(self, slots: list, exc: BaseException) -> None:
        """End the rows `slots` with an error event and free their slots."""
        for slot in slots:
            row = self.rows[slot]
            self._events.append(TokenEvent(row.request.request_id, None, row.generated, "error", error=exc))
            self._free(slot)

    # ---- decode ------------------------------------------------------------------------------------
    def _decode(self) -> None:
        """A decode step of the running rows, or with a speculator its verify step where it has one."""
        step = None
        if self.speculator is not None:
            try:
                step = self.speculator.plan_verify(self)
            except Exception as exc:  # a draft model's step failed: the rows of this step fail, as a decode's would
                logger.exception("speculative proposals failed for %d request(s)", len(self.rows))
                self._fail_rows(sorted(self.rows), exc)
                return
        if step is None and self.blocks is not None:
            apart = self.scheduler.decode_apart_plans(self.cache.batch, self.cache.max_length)
            if apart is not None:  # each view reads less than the batch's shape, so none is that shape
                for plan in apart:
                    if all(s in self.rows for s in plan.slots):
                        self._run_apart(plan)
                return
        step = step or self.scheduler.decode_plan(self.cache.batch)
        result = self._run(step)
        if result is not None:
            if step.kind == "verify":
                self.speculator.verified([self.rows[s] for s in step.choosing], result.accepted)
            self._apply(step, result)

    def _chunk_or_decode(self) -> None:
        """Every row's blocks for a chunk step, then the step: the prefilling rows' next chunks and the decoding rows'
        next tokens; a decode step when every prefilling row was preempted for another's blocks. On block caches the
        chunks run apart, in the smallest batch that holds the prefilling rows, after a decode step of the decoding
        rows: a chunk step of the whole batch computes a chunk's width for every decoding row, to keep one token
        (the mixed step stays where the rows apart would fill the batch's own shape)."""
        width = None
        while width != self.scheduler.chunk_now():  # a preempted prefilling row widens the others' next chunks
            width = self.scheduler.chunk_now()
            self._make_room(sorted(self.rows))
        if not prefilling(self.rows):
            if decoding(self.rows):
                self._decode()
            return
        apart = self.scheduler.chunk_apart_plan(self.cache.shape) if self.blocks is not None else None
        if apart is None:
            self._chunk()
            return
        if decoding(self.rows):
            self._decode()
        if all(s in self.rows for s in apart.slots):  # a failed decode step fails every row of the batch
            self._chunk_apart(apart)

    def _chunk(self) -> None:
        """The next chunk of every prefilling row, and the next token of every decoding row (`chunking.py`)."""
        self._own_prefixes()
        step = self.scheduler.chunk_plan(self.cache.batch, self.cache.max_length)
        result = self._run(step)
        if result is not None:
            self.chunks += 1
            self._apply(step, result)

    def _chunk_apart(self, step: StepPlan) -> None:
        """The prefilling rows' next chunks on a view of the pool of the step's own shape."""
        self._own_prefixes()
        self._run_apart(step)

    def _run_apart(self, step: StepPlan) -> None:
        """Run a step of some rows on a view of the pool of the step's own shape (`step.view`): its table holds their
        blocks, row i the i-th of `step.slots` (written before every such step: the view is shared by every step of
        its shape), then apply its result."""
        view = self.engine.cache(*step.view)
        self._write_table({i: self.rows[s] for i, s in enumerate(step.slots)}, view)
        result = self._run(step, view)
        if result is not None:
            self.chunks += step.kind == "chunk"
            self._apply(step, result)

    def _run(self, step: StepPlan, cache: Optional[KVCache] = None) -> Optional[StepResult]:
        """Run a decode, chunk or verify step of the batch (or of `cache`, a view of its pool); if it fails, the rows
        it names end with the error (None)."""
        try:
            return self.runner.run(step, cache or self.cache, self.sampler, self.constraints)
        except Exception as exc:
            logger.exception("%s step failed for %d request(s)", step.kind, len(step.fails))
            self._fail_rows(step.fails, exc)
            return None

    def _apply(self, step: StepPlan, result: StepResult) -> None:
        """A step's result on its rows: the positions it wrote (a verify step's rows advance by each token they emit
        instead), a row whose prompt is now all in its cache has its prefix stored, then each choosing row's tokens,
        stopping at one that ends it."""
        for slot, n in step.advance.items():
            self.rows[slot].length += n
        per_token = step.kind == "verify"
        for i, slot in enumerate(step.choosing):
            row = self.rows[slot]
            if slot in step.completes:
                self._store_prefix(slot, row)
            for j, token in enumerate(result.tokens[i]):
                if per_token:
                    row.length += 1  # the token before it is now in the cache
                event = self._emit(slot, row, token, result.choice, i * result.width + j)
                if j == 0 and result.prompt_scores[i] is not None:
                    event.prompt_logprobs = result.prompt_scores[i]
                if row.request.output_logits:  # a copy: a CUDA graph's next replay overwrites its outputs
                    event.logits = result.logits_of(i, j).clone()
                if event.finish_reason is not None:
                    break

    def _emit(self, slot: int, row: Row, token: int, choice, i: int) -> TokenEvent:
        """Record the row's new token and add its event to the step's (and return it); a finished row frees
        its slot."""
        index = row.generated
        row.generated += 1
        row.last = token
        row.tokens.append(token)
        params = row.request.sampling
        reason = None
        if token in params.eos_token_ids and row.generated > params.min_new_tokens:
            reason = "stop"
        elif self.constraints is not None and self.constraints.advance(slot, token):
            reason = "stop"  # its grammar is complete
        elif row.generated >= row.request.max_new_tokens:
            reason = "length"
        event = TokenEvent(row.request.request_id, token, index, reason)
        if choice.logprobs is not None and params.logprobs is not None:
            event.logprob = float(choice.logprobs[i])
            if params.logprobs > 0 and choice.top_ids is not None:
                ids, lps = (
                    choice.top_ids[i, : params.logprobs].tolist(),
                    choice.top_logprobs[i, : params.logprobs].tolist(),
                )
                event.top_logprobs = list(zip(ids, lps))
        self._events.append(event)
        if reason is not None:
            self._free(slot)
        return event

    # ---- the batch's shape -------------------------------------------------------------------------
    def _fit(self, count: int, need: int) -> None:
        """Make the batch hold `count` rows and a row of `need` positions: allocate it, or move it to a
        larger shape (the running rows keep their slots)."""
        batch, kv = self.plan.batch_bucket(count), self.plan.kv_bucket(need)
        device = self.engine.model.device
        if self.cache is None:
            self.cache = self.engine.cache(batch, kv)
            self.sampler = RowSampler(batch, self.vocab, device, self.engine.backend.host_generators)
            self.constraints = RowConstraints(batch, self.vocab)
            return
        if batch <= self.cache.batch and kv <= self.cache.max_length:
            return
        batch, kv = max(batch, self.cache.batch), max(kv, self.cache.max_length)
        slots = sorted(self.rows)
        self._move(batch, kv, slots, slots)

    def _maybe_shrink(self) -> None:
        """Move to a smaller shape when the running rows fit one whose decode graph is already built (on block caches
        a smaller KV length also while requests wait: the move is a table copy)."""
        if not self.rows or (self.waiting and self.blocks is None):
            return
        batch = self.cache.batch if self.waiting else self.plan.batch_bucket(len(self.rows))
        kv = self.plan.kv_bucket(max(self.scheduler.reach(r) for r in self.rows.values()))
        if (
            (batch, kv) == (self.cache.batch, self.cache.max_length)
            or batch > self.cache.batch
            or kv > self.cache.max_length
        ):
            return
        if not self.engine.warm("decode", batch, kv, self.settings):
            return
        if self.speculator is not None and not self.speculator.warm(self.engine, batch, kv, self.settings):
            return
        slots = sorted(self.rows)
        self._move(batch, kv, slots, list(range(len(slots))))

    def _move(self, batch: int, kv: int, src: list, dst: list) -> None:
        target = self.engine.cache(batch, kv)
        if src:
            device = target.tensors[0].device
            target.copy_rows(self.cache, torch.tensor(src, device=device), torch.tensor(dst, device=device))
        self.sampler.resize(batch, src, dst)
        self.constraints.resize(batch, src, dst)
        self.rows = {d: self.rows[s] for s, d in zip(src, dst)}
        logger.debug("batch moved from %s to %s", self.cache.shape, target.shape)
        self.cache = target
        self.moves += 1
        if self.blocks is not None:  # the target's other rows may hold another batch's entries
            self._write_table(self.rows)
        # the copy is a graph of its own on a lazily traced device, not part of the next step's (which compiled a
        # second graph for its shape after a move down)
        self.engine.backend.flush(self.engine.model.device)


__all__ = ["GenerationLoop", "GenerationRequest", "TokenEvent"]
