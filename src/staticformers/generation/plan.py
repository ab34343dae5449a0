"""The shape plan: every shape the generation engine will ever compile, decided before the first call.

A device that compiles one graph per input shape must never meet a shape it did not expect. The plan
lists three sets of buckets and the engine pads every request up to the smallest bucket that fits
("first fit", as NxD Inference does):

- batch buckets (default 1, 2, 4, 8): the decode slots; more sequences than the largest bucket wait
  for a free slot (`loop.py`), none is refused;
- prompt-length buckets (default powers of two from 16 up to `max_model_len`): prefill graphs are
  `[batch_bucket, prompt_bucket]`, the prompt at the start of each row and padding after it;
- KV-cache lengths (default powers of two from 256 up to `max_model_len`): decode graphs are
  `[batch_bucket, 1]` over a cache of one of these lengths, the smallest that holds every row's prompt
  and new tokens (`positions_needed`), so memory follows what a call needs and never
  `max_position_embeddings` blindly (Qwen3's 40,960 positions would cost gigabytes a sequence).

An optional fourth set, **extend widths** `(T, n)`, declares steps that run `T` new tokens per row over
the static cache, each row at its own positions, and return the logits at `n` of them: the verify step
of speculative decoding (`T = n = k + 1`) and the chunks of a chunked prefill (`T` the chunk, `n = 1`).
An extend step runs over a `[B, K]` cache, so each width adds `len(batch) * len(kv)` shapes; a plan
without widths has none (`with_extend_widths` adds them to a plan).

An optional **chunk budget** `chunk_tokens` (the server's `--max-num-batched-tokens`) declares the chunks' widths by
batch instead: a chunk step of batch bucket `B` runs `chunk_width_at(B) = min(chunk_tokens // B, largest prompt
bucket)` tokens per row, so every chunk step computes at most the budget whatever its batch, and a prompt chunking
alone (a batch of 1) takes the whole budget a step rather than the share of the largest batch. It adds one width per
batch bucket, `len(batch) * len(kv)` shapes, as one declared width does (`with_chunk_tokens` adds it to a plan).

A hybrid model's linear-attention layers (Gated DeltaNet) run a prompt, a chunk of one and training in the chunked
form, `linear_chunk` tokens at a time (default 64, transformers' and flash-linear-attention's): the size of the
matrices each chunk multiplies, which a device may prefer otherwise (its tile); any positive size gives the same
result. The engine gives it to the model's layers (`engine.py`).

`max_model_len` defaults to the smaller of the model's `max_position_embeddings` and 2048. The number
of shapes is `len(batch) * (len(prompt) + len(kv) * (1 + len(extend)))` (the chunk budget counting as one extend
width, unless a batch's chunk width is a declared one), printed by `str(plan)` and by
`staticformers compile`; each shape is one graph, or (on the CPU) a few small ones, its regions
(`compilation/steps.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_LINEAR_CHUNK = 64


class PlanError(ValueError):
    """A request that does not fit the shape plan (one sentence saying what to change)."""


def _powers_of_two(low: int, high: int) -> tuple[int, ...]:
    out, n = [], 1
    while n < low:
        n *= 2
    while n < high:
        out.append(n)
        n *= 2
    out.append(high)
    return tuple(out)


def _check_widths(widths, max_model_len: Optional[int]) -> tuple[tuple[int, int], ...]:
    """Extend widths as sorted `(T, n)` pairs: `T` tokens per row, `n` kept positions, `1 <= n <= T`."""
    out = set()
    for w in widths:
        try:
            t, n = (int(v) for v in w)
        except (TypeError, ValueError):
            raise PlanError(f"An extend width is a pair (tokens, kept positions), got {w!r}.") from None
        if t < 1 or not 1 <= n <= t:
            raise PlanError(f"The extend width {w!r} must have tokens >= 1 and 1 <= kept positions <= tokens.")
        if max_model_len is not None and t > max_model_len:
            raise PlanError(f"The extend width {w!r} has more tokens than max_model_len={max_model_len}: lower it.")
        out.add((t, n))
    return tuple(sorted(out))


def _check_buckets(name: str, values: Sequence[int]) -> tuple[int, ...]:
    values = tuple(sorted({int(v) for v in values}))
    if not values or values[0] < 1:
        raise PlanError(f"{name} must be a non-empty list of positive integers, got {list(values)}.")
    return values


@dataclass(frozen=True)
class Entry:
    """The shapes one (sub-)batch runs at: batch bucket, prompt bucket, KV-cache length."""

    batch: int
    prompt: int
    kv: int


class ShapePlan:
    """Batch, prompt-length and KV-length buckets (see the module docstring).

    Pass explicit bucket lists, or let them follow `max_model_len` and `max_batch_size`. A plan
    without `max_model_len` is completed from the model by `bind()` when the engine first sees it.
    """

    def __init__(
        self,
        batch_sizes: Optional[Sequence[int]] = None,
        prompt_lengths: Optional[Sequence[int]] = None,
        kv_lengths: Optional[Sequence[int]] = None,
        max_model_len: Optional[int] = None,
        max_batch_size: int = 8,
        min_prompt_length: int = 16,
        min_kv_length: int = 256,
        extend_widths: Sequence[Sequence[int]] = (),
        linear_chunk: int = DEFAULT_LINEAR_CHUNK,
        chunk_tokens: Optional[int] = None,
    ):
        if isinstance(linear_chunk, bool) or not isinstance(linear_chunk, int) or linear_chunk < 1:
            raise PlanError(
                f"linear_chunk={linear_chunk!r} must be a positive number of tokens (the chunked form's "
                f"chunk of a linear-attention layer; {DEFAULT_LINEAR_CHUNK} by default)."
            )
        self.linear_chunk = linear_chunk
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise PlanError(
                f"chunk_tokens={chunk_tokens!r} must be a positive number of tokens (what one chunk step computes)."
            )
        self.chunk_tokens = chunk_tokens
        if max_model_len is not None and int(max_model_len) < 2:
            raise PlanError(f"max_model_len must be at least 2, got {max_model_len}.")
        if int(max_batch_size) < 1:
            raise PlanError(f"max_batch_size must be at least 1, got {max_batch_size}.")
        self._requested = dict(
            batch_sizes=batch_sizes,
            prompt_lengths=prompt_lengths,
            kv_lengths=kv_lengths,
            max_model_len=max_model_len,
            max_batch_size=int(max_batch_size),
            min_prompt_length=int(min_prompt_length),
            min_kv_length=int(min_kv_length),
            extend_widths=_check_widths(extend_widths, None),
            linear_chunk=linear_chunk,
            chunk_tokens=chunk_tokens,
        )
        self.max_model_len = int(max_model_len) if max_model_len is not None else None
        self.batch_sizes = (
            _check_buckets("batch_sizes", batch_sizes)
            if batch_sizes is not None
            else _powers_of_two(1, int(max_batch_size))
        )
        self.prompt_lengths: tuple[int, ...] = ()
        self.kv_lengths: tuple[int, ...] = ()
        self.extend_widths = _check_widths(extend_widths, self.max_model_len)
        if chunk_tokens is not None and chunk_tokens < self.batch_sizes[-1]:
            raise PlanError(
                f"chunk_tokens={chunk_tokens} (--max-num-batched-tokens) is less than the largest batch bucket "
                f"({self.batch_sizes[-1]}): a chunk step of that batch gives every row at least one token, so "
                f"raise it to at least {self.batch_sizes[-1]}."
            )
        if self.max_model_len is not None or (prompt_lengths is not None and kv_lengths is not None):
            self._complete()

    # ---- completion ----------------------------------------------------------------------------
    def _complete(self) -> None:
        r = self._requested
        prompt = r["prompt_lengths"]
        kv = r["kv_lengths"]
        if self.max_model_len is None:
            self.max_model_len = max(max(prompt), max(kv))
        m = self.max_model_len
        self.prompt_lengths = (
            _check_buckets("prompt_lengths", prompt)
            if prompt is not None
            else _powers_of_two(min(r["min_prompt_length"], m), m)
        )
        self.kv_lengths = (
            _check_buckets("kv_lengths", kv) if kv is not None else _powers_of_two(min(r["min_kv_length"], m), m)
        )
        if self.kv_lengths[-1] > m or self.prompt_lengths[-1] > m:
            raise PlanError(
                f"The plan's buckets go beyond max_model_len={m} (prompt up to {self.prompt_lengths[-1]}, "
                f"KV up to {self.kv_lengths[-1]}): lower them or raise max_model_len."
            )
        self.extend_widths = _check_widths(self.extend_widths, m)

    @property
    def bound(self) -> bool:
        return bool(self.prompt_lengths) and bool(self.kv_lengths)

    def bind(self, max_position_embeddings: int) -> "ShapePlan":
        """This plan completed for a model (a copy when something had to be filled in)."""
        if self.max_model_len is not None and self.max_model_len > max_position_embeddings:
            raise PlanError(
                f"max_model_len={self.max_model_len} is more than the model's max_position_embeddings="
                f"{max_position_embeddings}: lower it."
            )
        if self.bound:
            return self
        r = dict(self._requested)
        r["max_model_len"] = min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        return ShapePlan(**r)

    def with_extend_widths(self, *widths: Sequence[int]) -> "ShapePlan":
        """This plan with the extend widths `widths` `(T, n)` added (itself when it has them all)."""
        wanted = _check_widths(widths, self.max_model_len)
        if set(wanted) <= set(self.extend_widths):
            return self
        r = dict(self._requested)
        r["extend_widths"] = tuple(sorted(set(self.extend_widths) | set(wanted)))
        return self._with(r)

    def with_chunk_tokens(self, tokens: int) -> "ShapePlan":
        """This plan with a chunk budget of `tokens` a step (the module docstring; itself when it has that one)."""
        if tokens == self.chunk_tokens:
            return self
        r = dict(self._requested)
        r["chunk_tokens"] = tokens
        return self._with(r)

    def _with(self, r: dict) -> "ShapePlan":
        """A plan of the arguments `r`, keeping what binding filled in."""
        if self.bound:
            r.update(prompt_lengths=self.prompt_lengths, kv_lengths=self.kv_lengths, max_model_len=self.max_model_len)
        return ShapePlan(**r)

    def chunk_width_at(self, batch: int) -> Optional[int]:
        """The chunk width of a chunk step of batch bucket `batch` under the chunk budget: the budget over the batch,
        at most the largest prompt bucket (which prefills a prompt's first chunk); None without a budget."""
        if self.chunk_tokens is None:
            return None
        self._need_bound()
        return max(1, min(self.chunk_tokens // int(batch), self.prompt_lengths[-1]))

    def widths_at(self, batch: int) -> tuple[tuple[int, int], ...]:
        """The extend widths `(T, n)` of batch bucket `batch`: the declared ones and the chunk budget's."""
        chunk = self.chunk_width_at(batch)
        if chunk is None or (chunk, 1) in self.extend_widths:
            return self.extend_widths
        return tuple(sorted(self.extend_widths + ((chunk, 1),)))

    # ---- first fit -----------------------------------------------------------------------------
    def _need_bound(self) -> None:
        if not self.bound:
            raise PlanError("This ShapePlan has no max_model_len yet: pass one, or let the engine bind it to a model.")

    def batch_bucket(self, n: int) -> int:
        for b in self.batch_sizes:
            if b >= n:
                return b
        raise PlanError(f"A batch of {n} is larger than the largest batch bucket ({self.batch_sizes[-1]}).")

    def prompt_bucket(self, n: int) -> int:
        self._need_bound()
        for length in self.prompt_lengths:
            if length >= n:
                return length
        raise PlanError(
            f"The prompt has {n} token{'s' if n != 1 else ''}, more than the largest prompt bucket ({self.prompt_lengths[-1]}, "
            f"max_model_len={self.max_model_len}): shorten it or use a plan with a larger max_model_len."
        )

    def kv_bucket(self, n: int) -> int:
        self._need_bound()
        for length in self.kv_lengths:
            if length >= n:
                return length
        raise PlanError(f"{n} cache slots are more than the largest KV length ({self.kv_lengths[-1]}).")

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a sequence needs: its prompt at positions `0..n-1`, then one per new token but
        the last (the last token is returned, never fed back); raises when it cannot fit.

        The prompt's bucket costs no positions: padding inside a prefill bucket sits after the prompt,
        is masked, and decode writes over it."""
        self._need_bound()
        self.prompt_bucket(prompt_len)
        total = prompt_len + max_new_tokens
        if total > self.max_model_len:
            raise PlanError(
                f"The prompt has {prompt_len} token{'s' if prompt_len != 1 else ''} and max_new_tokens={max_new_tokens}: {total} positions exceed "
                f"max_model_len={self.max_model_len}; lower max_new_tokens to at most "
                f"{max(self.max_model_len - prompt_len, 0)} or raise max_model_len."
            )
        need = max(prompt_len + max_new_tokens - 1, 1)
        if need > self.kv_lengths[-1]:
            raise PlanError(
                f"The prompt has {prompt_len} token{'s' if prompt_len != 1 else ''} and max_new_tokens={max_new_tokens} needs {need} cache "
                f"positions, more than the largest KV length ({self.kv_lengths[-1]}): lower max_new_tokens to at "
                f"most {self.kv_lengths[-1] - prompt_len + 1} or add a larger KV length to the plan."
            )
        return need

    def choose(self, batch: int, prompt_len: int, max_new_tokens: int) -> Entry:
        """The entry a batch of `batch` prompts of at most `prompt_len` tokens runs at, or a PlanError: the
        prompt bucket holds the longest prompt, the KV length its `positions_needed`."""
        need = self.positions_needed(prompt_len, max_new_tokens)
        return Entry(self.batch_bucket(batch), self.prompt_bucket(prompt_len), self.kv_bucket(need))

    # ---- the graphs it implies -----------------------------------------------------------------
    def prefill_shapes(self) -> list[tuple[int, int]]:
        self._need_bound()
        return [(b, length) for b in self.batch_sizes for length in self.prompt_lengths]

    def decode_shapes(self) -> list[tuple[int, int]]:
        self._need_bound()
        return [(b, kv) for b in self.batch_sizes for kv in self.kv_lengths]

    def extend_shapes(self) -> list[tuple[int, int, int, int]]:
        """`(B, K, T, n)`: an extend step of `[B, T]` tokens over a `[B, K]` cache, `n` positions kept."""
        self._need_bound()
        return [(b, kv, t, n) for b in self.batch_sizes for kv in self.kv_lengths for t, n in self.widths_at(b)]

    @property
    def num_shapes(self) -> int:
        return len(self.prefill_shapes()) + len(self.decode_shapes()) + len(self.extend_shapes())

    def key(self) -> tuple:
        return (
            self.batch_sizes,
            self.prompt_lengths,
            self.kv_lengths,
            self.max_model_len,
            self.extend_widths,
            self.linear_chunk,
            self.chunk_tokens,
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, ShapePlan) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        widths = f", extend_widths={[list(w) for w in self.extend_widths]}" if self.extend_widths else ""
        chunk = f", linear_chunk={self.linear_chunk}" if self.linear_chunk != DEFAULT_LINEAR_CHUNK else ""
        budget = f", chunk_tokens={self.chunk_tokens}" if self.chunk_tokens is not None else ""
        return (
            f"ShapePlan(batch_sizes={list(self.batch_sizes)}, prompt_lengths={list(self.prompt_lengths)}, "
            f"kv_lengths={list(self.kv_lengths)}, max_model_len={self.max_model_len}{widths}{chunk}{budget})"
        )

    def __str__(self) -> str:
        if not self.bound:
            return repr(self)
        lines = [
            f"shape plan: max_model_len {self.max_model_len}, {self.num_shapes} shapes at most",
            f"  batch buckets   {', '.join(map(str, self.batch_sizes))}",
            f"  prompt buckets  {', '.join(map(str, self.prompt_lengths))}   (prefill [batch, prompt])",
            f"  KV lengths      {', '.join(map(str, self.kv_lengths))}   (decode [batch, 1] over the cache)",
        ]
        if self.extend_widths:
            widths = ", ".join(f"{t} keep {n}" for t, n in self.extend_widths)
            lines.append(f"  extend widths   {widths}   (extend [batch, tokens] over the cache)")
        if self.chunk_tokens is not None:
            widths = ", ".join(f"{self.chunk_width_at(b)} at batch {b}" for b in self.batch_sizes)
            lines.append(f"  chunk budget    {self.chunk_tokens} tokens a step: {widths}")
        return "\n".join(lines)
