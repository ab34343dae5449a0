"""A draft model's proposals: a smaller model sharing the tokenizer runs k decode steps per verify.

Design choices:

- **Its own engine, plan and caches.** The draft has its own `Engine` (its own graphs, counted and
  compiled ahead like the target's) over a plan with the target's batch buckets, prompt buckets and KV
  lengths (`plan_for`); its proposals come from its own `[B, 1]` decode graph.
- **Its rows mirror the target's slots.** Its cache has the target batch's shape `(B, K)`; a row's
  draft keys and values sit in the row's target slot. When the target batch moves to another shape,
  the draft's rows are copied along (`KVCache.copy_rows`).
- **Catching up.** A row that accepted every proposal holds one token the draft never ran (its last
  proposal), so it feeds two tokens before proposing; a step runs as many draft decode steps as its
  most behind row needs (k, or k+1), each row reading its proposals from the steps after its own
  catch-up. A row new to the draft has its prompt prefilled (it fits the plan's prompt buckets, as the
  target's prefill did) and feeds what it generated since; so does a row the target advanced without
  the draft (plain decode steps near the end of the cache).
- **Chained on the device.** A draft step's input is the previous step's output (or a catch-up token
  made on the host); the proposals cross to the host once, after the k steps.
- **Sampling rows draw from q**, the draft's distribution after the row's temperature, top-k, top-p and
  min-p, with the row's own generator; q goes to the rejection rule (`acceptance.py`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..plan import ShapePlan
from .acceptance import draft_distribution, race


class _State:
    __slots__ = ("row", "slot", "length", "fed", "props")

    def __init__(self, row, slot: int, length: int):
        self.row, self.slot, self.length = row, slot, length  # length: positions of the row in the draft cache
        self.fed = self.props = 0  # this step: tokens fed before proposing, proposals fed after


class DraftModel:
    """The draft-model proposer (see the module docstring): `engine` the draft's Engine, `settings` its
    compile settings, `k` the tokens it proposes per step."""

    own_cache = True  # it keeps its own static cache rows per target row (a loop on block caches refuses it)

    deterministic = False

    def __init__(self, engine, settings, k: int):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_assistant_tokens={k!r} must be a positive integer.")
        self.engine, self.settings, self.k = engine, settings, k
        self.plan: Optional[ShapePlan] = None
        self.cache = None
        self.known: dict[int, _State] = {}

    # ---- the plan ------------------------------------------------------------------------------------
    def check(self, target_model) -> None:
        """Refuse a draft that cannot propose for this target (one sentence, before any work)."""
        config = self.engine.model.config
        if getattr(config, "has_linear_attention", False):
            raise ValueError(
                f"The draft model ({config.architecture}) has linear-attention layers, whose recurrent "
                f"state the draft would have to roll back after each rejected proposal: use a draft "
                f"model without them, or prompt lookup (prompt_lookup_num_tokens)."
            )
        mine, theirs = self.engine.model.config.vocab_size, target_model.config.vocab_size
        if mine > theirs:
            raise ValueError(
                f"The draft model's vocabulary ({mine} ids) is larger than the target's ({theirs}): "
                f"use a draft that shares the target's tokenizer."
            )

    def plan_for(self, plan: ShapePlan) -> ShapePlan:
        """The draft's plan: the target's buckets, without its extend widths."""
        mine = ShapePlan(
            batch_sizes=plan.batch_sizes,
            prompt_lengths=plan.prompt_lengths,
            kv_lengths=plan.kv_lengths,
            max_model_len=plan.max_model_len,
        )
        self.plan = mine.bind(self.engine.model.config.max_position_embeddings)
        return self.plan

    def warm(self, batch: int, kv: int) -> bool:
        return self.engine.warm("decode", batch, kv, self.settings)

    # ---- proposing ----------------------------------------------------------------------------------
    def _follow(self, loop, slots: list) -> None:
        """Make the draft cache the target batch's shape, its known rows in their target slots."""
        alive = {id(loop.rows[s]): s for s in slots}
        self.known = {key: st for key, st in self.known.items() if key in alive and st.row is loop.rows[alive[key]]}
        shape = loop.cache.shape
        if self.plan is None:
            self.plan_for(loop.plan)
        if (
            self.cache is not None
            and self.cache.shape == shape
            and all(st.slot == alive[key] for key, st in self.known.items())
        ):
            return
        target = self.engine.cache(*shape)
        moved = [(st.slot, alive[key]) for key, st in self.known.items()]
        if moved and target is not self.cache:
            device = target.keys[0].device
            target.copy_rows(
                self.cache,
                torch.tensor([m[0] for m in moved], device=device),
                torch.tensor([m[1] for m in moved], device=device),
            )
        elif moved:  # same cache, rows elsewhere: cannot happen in the loop; start them again
            self.known.clear()
        for key, st in self.known.items():
            st.slot = alive[key]
        self.cache = target

    def propose(self, histories: list, limits: list, loop, slots: list, **_) -> tuple[list, Optional[torch.Tensor]]:
        """Up to `limits[i]` proposals per row and, when a row samples, q `[n, k, vocab]` (the target's vocab)."""
        self._follow(loop, slots)
        rows = [loop.rows[s] for s in slots]
        fresh = [i for i, row in enumerate(rows) if id(row) not in self.known]
        if fresh:  # the prompt into the same slot of the draft's cache (the tokens after it are fed below)
            with torch.no_grad():
                self.engine.prefill(
                    self.settings,
                    [rows[i].request.prompt for i in fresh],
                    self.cache,
                    [slots[i] for i in fresh],
                    self.plan,
                )
            for i in fresh:
                self.known[id(rows[i])] = _State(rows[i], slots[i], len(rows[i].request.prompt))
        states = [self.known[id(r)] for r in rows]
        for st, h in zip(states, histories):
            st.fed = len(h) - st.length
        span = max((st.fed - 1 + m for st, m in zip(states, limits) if m > 0), default=0)
        if span == 0:
            return [[] for _ in rows], None
        for st in states:  # a row with nothing to propose feeds what fits in the others' steps
            st.fed = min(st.fed, span)
        batch = self.cache.batch
        feed = torch.zeros(batch, span, dtype=torch.long)
        fed = torch.zeros(batch, span, dtype=torch.bool)
        positions = torch.arange(span).repeat(batch, 1)
        for slot, st, h in zip(slots, states, histories):
            feed[slot, : st.fed] = torch.as_tensor(h[st.length : st.length + st.fed], dtype=torch.long)
            fed[slot, : st.fed] = True
            positions[slot] += st.length
        # a row past its own proposals keeps running (its outputs unused): clamped into the cache, where its
        # real positions never reach (each is at most length + k - 1 < K - 1, the verify's own bound)
        positions.clamp_(max=self.cache.max_length - 1)
        device = self.engine.model.device
        sampler = loop.sampler
        t = sampler._table(tuple(slots))
        sampling = bool(t["sampling"])
        vocab = loop.vocab
        index = torch.tensor(slots, dtype=torch.long).to(device)
        outs, qs = [], []
        previous = None
        with torch.no_grad():
            for j in range(span):
                # each step's inputs made on the host, of standard strides, as the warm-up's (a lazily traced
                # device would compile a graph per column index; a view's strides would miss the guards);
                # a row past its catch-up takes the previous step's output, on the device
                fed_j = fed[:, j : j + 1].clone(memory_format=torch.contiguous_format).to(device)
                feed_j = feed[:, j : j + 1].clone(memory_format=torch.contiguous_format).to(device)
                at = positions[:, j : j + 1].clone(memory_format=torch.contiguous_format).to(device)
                inputs = feed_j if previous is None else torch.where(fed_j, feed_j, previous.view(batch, 1))
                argmax, logits = self.engine.decode(self.settings, self.cache, inputs, at)
                chosen = argmax
                if sampling:
                    mine = logits.index_select(0, index).float()
                    if mine.shape[-1] < vocab:  # a draft with a smaller vocabulary: the rest is impossible
                        mine = torch.nn.functional.pad(mine, (0, vocab - mine.shape[-1]), value=float("-inf"))
                    q = draft_distribution(sampler, mine, slots)
                    noise = torch.ones(len(slots), vocab, device="cpu" if sampler.host_generators else sampler.device)
                    for i in t["sample_rows"]:
                        noise[i].exponential_(generator=sampler.generators[slots[i]])
                    drawn = torch.where(
                        t["do_sample"].view(-1), race(q, noise.to(device)), argmax.index_select(0, index)
                    )
                    chosen = argmax.index_copy(0, index, drawn)
                    qs.append(q)
                outs.append(chosen)
                previous = chosen
        self.engine.backend.flush(device)
        out = torch.stack(outs, 1).cpu()  # [B, span]
        q_all = torch.stack(qs, 1) if qs else None  # [n, span, vocab]
        proposals, q = [], None
        if q_all is not None:
            q = torch.zeros(len(slots), self.k, vocab, device=q_all.device)
        for i, (slot, st, m) in enumerate(zip(slots, states, limits)):
            start = st.fed - 1
            p = out[slot, start : start + m].tolist()
            proposals.append(p)
            st.props = max(0, span - st.fed)  # proposals it fed itself (their keys are in its cache)
            if q is not None and p:
                q[i, : len(p)] = q_all[i, start : start + len(p)]
        return proposals, q

    def accepted(self, rows: list, counts: list) -> None:
        """After the verify: each row's draft cache holds its fed tokens and its accepted proposals that it fed."""
        for row, a in zip(rows, counts):
            st = self.known.get(id(row))
            if st is not None:
                st.length += st.fed + min(a, st.props)
