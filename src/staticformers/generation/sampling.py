"""Choosing the next token on the device, per row: logits processors with transformers' semantics,
then argmax or a draw.

Why a module of its own: the engine's compiled graphs return the argmax *and* the last position's
logits. When no row needs processing (plain greedy), the argmax is the answer and nothing else runs.
Otherwise every row of the batch is processed with *its own* settings (a request's temperature,
top-k, top-p, min-p, penalties, seed), vectorised over the rows on the device, and only the chosen
ids go back to the host: requests with different settings share one decode step (`loop.py`).

Processors apply in transformers' order: repetition penalty, presence and frequency penalties
(OpenAI's, over the tokens generated so far), min-new-tokens (stop ids forbidden), then for
sampling rows temperature, top-k, top-p, min-p. Each matches the transformers processor of the same
name row by row (tests check them on random logits); per-row thresholds are computed on the host in
Python floats, as transformers computes them from its scalars. The penalties keep `[slots, vocab]`
state on the device (the prompt's tokens, counts of generated ones) instead of the growing id
history, so their cost does not grow with the sequence.

A sampling row draws with the exponential race: `argmax(probs / E)` with `E ~ Exp(1)` per token
picks token `i` with probability `probs[i]`, as `torch.multinomial` does, from noise the row draws
from its own generator. A request with a seed therefore gets the same tokens whichever rows share
its batch and whenever it joins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..utils.seeds import check_seed
from .constraints import unpack

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# processors (one setting for every row; transformers' processors of the same name)
# ---------------------------------------------------------------------------------------------
def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty) -> torch.Tensor:
    """Seen tokens' logits divided by `penalty` when positive, multiplied when negative (`penalty` a float
    or a `[rows, 1]` tensor)."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def forbid(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set the logits of `token_ids` (1-D) to -inf (min_new_tokens keeps EOS out)."""
    out = logits.clone()
    out[:, token_ids] = NEG_INF
    return out


def temperature(logits: torch.Tensor, value) -> torch.Tensor:
    return logits / value


def top_k(logits: torch.Tensor, k, min_tokens_to_keep: int = 1, largest: Optional[int] = None) -> torch.Tensor:
    """Keep the `k` largest logits of each row (`k` an int, or a `[rows]` tensor with 0 = keep all; then
    `largest`, when given, is at least its largest value: how wide a `topk` to take without reading `k`)."""
    vocab = logits.shape[-1]
    if isinstance(k, int):
        k = min(max(int(k), min_tokens_to_keep), vocab)
        threshold = torch.topk(logits, k)[0][..., -1, None]
        return logits.masked_fill(logits < threshold, NEG_INF)
    k = torch.where(k > 0, k.clamp(min=min_tokens_to_keep), vocab).clamp(max=vocab)
    values = torch.topk(logits, min(int(largest), vocab) if largest is not None else int(k.max()))[0]
    threshold = values.gather(1, (k - 1).view(-1, 1))
    return logits.masked_fill(logits < threshold, NEG_INF)


def top_p(
    logits: torch.Tensor, p, min_tokens_to_keep: int = 1, threshold: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Nucleus filtering: `p` a float, or per-row `threshold` `[rows, 1]` (1 - p) with rows whose p is 1 left
    alone (`p` then a `[rows, 1]` bool tensor: which rows filter)."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= ((1 - p) if threshold is None else threshold)
    remove[..., -min_tokens_to_keep:] = False
    remove = remove.scatter(1, sorted_indices, remove)
    if threshold is not None:
        remove = remove & p
    return logits.masked_fill(remove, NEG_INF)


def min_p(logits: torch.Tensor, p, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Drop tokens less likely than `p` times the most likely one (`p` a float or `[rows, 1]`)."""
    probs = torch.softmax(logits, dim=-1)
    remove = probs < p * probs.amax(dim=-1, keepdim=True)
    keep = torch.topk(probs, min(min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
    remove.scatter_(-1, keep, False)
    return logits.masked_fill(remove, NEG_INF)


def _number(value, name: str, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name}={value!r} must be {kind}.")


def check_options(
    do_sample: bool,
    temperature_: Optional[float],
    top_k_: Optional[int],
    top_p_: Optional[float],
    min_p_: Optional[float],
    repetition_penalty_: Optional[float],
    presence_penalty_: Optional[float] = None,
    frequency_penalty_: Optional[float] = None,
) -> None:
    """Refuse values that cannot mean anything, with one sentence each (a string, a bool or NaN first)."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample={do_sample!r} must be True or False.")
    for name, value in (
        ("temperature", temperature_),
        ("top_p", top_p_),
        ("min_p", min_p_),
        ("repetition_penalty", repetition_penalty_),
        ("presence_penalty", presence_penalty_),
        ("frequency_penalty", frequency_penalty_),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise ValueError(
                f"{name}={value!r} must be a finite number{' (not a string)' if isinstance(value, str) else ''}."
            )
    _number(top_k_, "top_k", integer=True)
    if do_sample and temperature_ is not None and not temperature_ > 0:
        raise ValueError(
            f"temperature={temperature_} must be greater than 0 when sampling (use do_sample=False for greedy)."
        )
    if top_p_ is not None and not 0 < top_p_ <= 1:
        raise ValueError(f"top_p={top_p_} must be in (0, 1].")
    if min_p_ is not None and not 0 <= min_p_ <= 1:
        raise ValueError(f"min_p={min_p_} must be in [0, 1].")
    if top_k_ is not None and top_k_ < 0:
        raise ValueError(f"top_k={top_k_!r} must be a non-negative integer.")
    if repetition_penalty_ is not None and not 0 < repetition_penalty_ < float("inf"):
        raise ValueError(f"repetition_penalty={repetition_penalty_} must be greater than 0 and finite.")
    for value, name in ((presence_penalty_, "presence_penalty"), (frequency_penalty_, "frequency_penalty")):
        if value is not None and not -2 <= value <= 2:
            raise ValueError(f"{name}={value} must be in [-2, 2].")


def warped(logits: torch.Tensor, t: dict) -> torch.Tensor:
    """The rows' sampling distributions: temperature, top-k, top-p and min-p of a row table `t`
    (`RowSampler._table`), then softmax (one row of `t` per row of `logits`)."""
    y = logits
    if t["temperature"] is not None:
        y = temperature(y, t["temperature"])
    if t["top_k"] is not None:
        y = top_k(y, t["top_k"], largest=t["top_k_max"])
    if t["top_p"] is not None:
        y = top_p(y, t["top_p_on"], threshold=t["top_p"])
    if t["min_p"] is not None:
        y = min_p(y, t["min_p"])
    return torch.softmax(y, dim=-1)


# ---------------------------------------------------------------------------------------------
# one request's settings
# ---------------------------------------------------------------------------------------------
@dataclass
class SamplingParams:
    """How one request chooses its tokens (transformers' and OpenAI's names); validated on creation.

    `eos_token_ids` end the request (and are forbidden before `min_new_tokens`); `seed` gives the request
    its own generator; `generator` shares one (its draws then depend on the rows around it); neither:
    torch's global generator. `logprobs`: how many of the most likely tokens to report per step (0:
    only the chosen token's; None: none). `prompt_logprobs` (vLLM's name): the same for every prompt
    token (its log-probability given the tokens before it), computed by the prefill."""

    do_sample: bool = False
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    min_new_tokens: int = 0
    eos_token_ids: Sequence[int] = field(default_factory=tuple)
    seed: Optional[int] = None
    generator: Optional[torch.Generator] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    def __post_init__(self):
        check_options(
            self.do_sample,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.presence_penalty,
            self.frequency_penalty,
        )
        _number(self.min_new_tokens, "min_new_tokens", integer=True)
        if self.min_new_tokens is None:
            self.min_new_tokens = 0
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens={self.min_new_tokens!r} must be a non-negative integer.")
        if self.seed is not None:
            check_seed(self.seed)
        if self.seed is not None and self.generator is not None:
            raise ValueError("Pass generator or seed, not both.")
        if self.logprobs is not None:
            _number(self.logprobs, "logprobs", integer=True)
            if not 0 <= self.logprobs <= 20:
                raise ValueError(f"logprobs={self.logprobs} must be between 0 and 20.")
        if self.prompt_logprobs is not None:
            _number(self.prompt_logprobs, "prompt_logprobs", integer=True)
            if not 0 <= self.prompt_logprobs <= 20:
                raise ValueError(f"prompt_logprobs={self.prompt_logprobs} must be between 0 and 20.")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    # what actually applies (transformers skips neutral values)
    @property
    def sampling(self) -> bool:
        return bool(self.do_sample)

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty not in (None, 1.0) or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def needs_logits(self) -> bool:
        """False when the graph's own argmax is the answer (plain greedy, nothing to report)."""
        return (
            self.sampling
            or self.penalised
            or (self.min_new_tokens > 0 and bool(self.eos_token_ids))
            or self.logprobs is not None
        )


@dataclass
class Choice:
    """What `RowSampler.choose` returns for its rows: ids `[n]` and, when asked, log-probabilities."""

    ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None  # [n]: the chosen tokens' log-probabilities
    top_ids: Optional[torch.Tensor] = None  # [n, k]
    top_logprobs: Optional[torch.Tensor] = None  # [n, k]


# ---------------------------------------------------------------------------------------------
# the rows of one batch
# ---------------------------------------------------------------------------------------------
class RowSampler:
    """Per-slot settings and penalty state of one batch of `slots` rows (see the module docstring)."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device, host_generators: bool = False):
        self.slots, self.vocab, self.device = int(slots), int(vocab_size), torch.device(device)
        # draws made on the host and sent (a lazily traced device would compile a new graph per draw)
        self.host_generators = bool(host_generators)
        self.params: list[Optional[SamplingParams]] = [None] * self.slots
        self.generators: list[Optional[torch.Generator]] = [None] * self.slots
        self.prompt_seen: Optional[torch.Tensor] = None  # [slots, vocab] bool, when a row is penalised
        self.counts: Optional[torch.Tensor] = None  # [slots, vocab] int32: generated tokens
        self._tables: dict = {}  # rows -> per-row tensors, rebuilt when the rows' settings change

    # ---- rows joining, leaving, moving -----------------------------------------------------------
    def set_row(self, slot: int, params: SamplingParams, prompt: Sequence[int]) -> None:
        self.params[slot] = params
        self._tables.clear()
        if params.seed is not None:
            g = torch.Generator(device="cpu" if self.host_generators else self.device)
            g.manual_seed(params.seed % 2**64)
            self.generators[slot] = g
        else:
            self.generators[slot] = params.generator
        if params.penalised:
            self._penalty_state()
            self.prompt_seen[slot].zero_()
            self.counts[slot].zero_()
            ids = torch.as_tensor(list(prompt), dtype=torch.long).to(self.device)
            self.prompt_seen[slot].index_fill_(0, ids.clamp(0, self.vocab - 1), True)

    def clear_row(self, slot: int) -> None:
        self.params[slot] = None
        self.generators[slot] = None
        self._tables.clear()

    def resize(self, slots: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """A batch moving to `slots` rows: row `src[i]` becomes row `dst[i]`; the others are empty."""
        params, gens = [None] * slots, [None] * slots
        for s, d in zip(src, dst):
            params[d], gens[d] = self.params[s], self.generators[s]
        if self.prompt_seen is not None:
            seen = torch.zeros(slots, self.vocab, dtype=torch.bool, device=self.device)
            counts = torch.zeros(slots, self.vocab, dtype=torch.int32, device=self.device)
            if src:
                s_idx = torch.tensor(list(src), device=self.device)
                d_idx = torch.tensor(list(dst), device=self.device)
                seen[d_idx] = self.prompt_seen[s_idx]
                counts[d_idx] = self.counts[s_idx]
            self.prompt_seen, self.counts = seen, counts
        self.slots, self.params, self.generators = int(slots), params, gens
        self._tables.clear()

    def _penalty_state(self) -> None:
        if self.prompt_seen is None:
            self.prompt_seen = torch.zeros(self.slots, self.vocab, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(self.slots, self.vocab, dtype=torch.int32, device=self.device)

    # ---- choosing ----------------------------------------------------------------------------------
    def needs_logits(self, rows: Sequence[int]) -> bool:
        return any(self.params[r] is not None and self.params[r].needs_logits for r in rows)

    def choose(
        self,
        logits: torch.Tensor,
        argmax: torch.Tensor,
        rows: Sequence[int],
        steps: Sequence[int],
        allowed: Optional[torch.Tensor] = None,
    ) -> Choice:
        """Next ids for `rows` (slots) from their `[n, vocab]` logits and the graph's argmax; `steps[i]` is
        how many tokens row `rows[i]` has generated (0 = its first). `allowed`: the rows' packed token
        bitmask `[n, ceil(vocab/32)]` int32 (`constraints.py`; all ones for a free row), applied to every
        row's logits before argmax or draw, so the graph's argmax is not the answer then."""
        if not self.needs_logits(rows) and allowed is None:
            return Choice(argmax)
        rows = list(rows)
        t = self._table(tuple(rows))
        raw = logits.float()
        x = raw
        if t["penalised"]:
            idx = t["index"]
            seen = self.prompt_seen.index_select(0, idx) | (self.counts.index_select(0, idx) > 0)
            x = repetition_penalty(x, seen & t["rep_on"], t["rep"])
            counts = self.counts.index_select(0, idx).float()
            x = x - t["frequency"] * counts - t["presence"] * (counts > 0).float()
        banned = [
            i
            for i, (r, s) in enumerate(zip(rows, steps))
            if s < self.params[r].min_new_tokens and self.params[r].eos_token_ids
        ]
        if banned:  # a mask made on the host: indexing with Python ints would be a new graph per row on XLA
            mask = torch.zeros(len(rows), self.vocab, dtype=torch.bool)
            for i in banned:
                mask[i, [t for t in self.params[rows[i]].eos_token_ids if 0 <= t < self.vocab]] = True
            x = x.masked_fill(mask.to(x.device), NEG_INF)
        if allowed is not None:
            x = torch.where(unpack(allowed, self.vocab, x.device), x, NEG_INF)
        ids = x.argmax(dim=-1)
        if t["sampling"]:
            probs = warped(x, t)
            race = torch.where(probs > 0, probs / self._noise(rows, t["sample_rows"]), -1.0)  # a 0 draw: inf, never NaN
            drawn = race.argmax(dim=-1)
            ids = torch.where(t["do_sample"], drawn, ids)
        choice = Choice(ids)
        if t["logprobs"] is not None:
            logp = torch.log_softmax(raw, dim=-1)
            choice.logprobs = logp.gather(1, ids.view(-1, 1)).squeeze(1)
            if t["logprobs"] > 0:
                choice.top_logprobs, choice.top_ids = torch.topk(logp, t["logprobs"], dim=-1)
        return choice

    def logprobs_asked(self, rows: Sequence[int]) -> Optional[int]:
        """The most top log-probabilities any of `rows` asks for (0: only its token's; None: no row asks)."""
        return self._table(tuple(rows))["logprobs"]

    def observe(self, rows: Sequence[int], ids: torch.Tensor) -> None:
        """Count the chosen ids of `rows` as generated (penalties)."""
        if self.counts is None or not any(self.params[r] is not None and self.params[r].penalised for r in rows):
            return
        idx = torch.tensor(list(rows), device=self.device)
        self.counts.index_put_(
            (idx, ids.to(self.device).long()),
            torch.ones(len(rows), dtype=torch.int32, device=self.device),
            accumulate=True,
        )

    # ---- per-row tables ------------------------------------------------------------------------------
    def _table(self, rows: tuple) -> dict:
        t = self._tables.get(rows)
        if t is None:
            t = self._tables[rows] = self._build(rows)
        return t

    def _build(self, rows: tuple) -> dict:
        ps = [self.params[r] or SamplingParams() for r in rows]
        dev = self.device

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype).view(-1, 1).to(dev)

        sampling = [p.sampling for p in ps]
        t: dict = {
            "index": torch.tensor(list(rows), dtype=torch.long).to(dev),
            "sampling": any(sampling),
            "do_sample": torch.tensor(sampling, dtype=torch.bool).to(dev),
            "sample_rows": [i for i, s in enumerate(sampling) if s],
            "penalised": any(p.penalised for p in ps),
        }
        rep = [p.repetition_penalty if p.repetition_penalty not in (None, 1.0) else 1.0 for p in ps]
        t["rep"], t["rep_on"] = col(rep), col([r != 1.0 for r in rep], torch.bool)
        t["presence"] = col([float(p.presence_penalty or 0.0) for p in ps])
        t["frequency"] = col([float(p.frequency_penalty or 0.0) for p in ps])
        temps = [p.temperature if p.sampling and p.temperature not in (None, 1.0) else 1.0 for p in ps]
        t["temperature"] = col(temps) if any(v != 1.0 for v in temps) else None
        ks = [p.top_k if p.sampling and p.top_k else 0 for p in ps]
        t["top_k"] = torch.tensor(ks, dtype=torch.long).to(dev) if any(ks) else None
        # the most any row keeps, known here (no read from the device), rounded up to a power of two so that
        # a compile-per-shape device sees few distinct `topk` widths
        widest = self.vocab if 0 in ks else max(ks)
        t["top_k_max"] = min(self.vocab, 1 << max(0, widest - 1).bit_length())
        tps = [p.top_p if p.sampling and p.top_p is not None and p.top_p < 1.0 else 1.0 for p in ps]
        t["top_p"] = col([1 - v for v in tps]) if any(v < 1.0 for v in tps) else None
        t["top_p_on"] = col([v < 1.0 for v in tps], torch.bool)
        mps = [p.min_p if p.sampling and p.min_p is not None else 0.0 for p in ps]
        t["min_p"] = col(mps) if any(mps) else None
        asked = [p.logprobs for p in ps if p.logprobs is not None]
        t["logprobs"] = max(asked) if asked else None
        return t

    def _noise(self, rows: list, sample_rows: list) -> torch.Tensor:
        """`[n, vocab]` Exp(1) noise: each sampling row draws from its own generator (1 elsewhere)."""
        noise = torch.ones(len(rows), self.vocab, device="cpu" if self.host_generators else self.device)
        for i in sample_rows:
            noise[i].exponential_(generator=self.generators[rows[i]])
        return noise.to(self.device)
