"""Bounds on what rendering an untrusted chat template may cost: time, and the size of what it makes.

Jinja's sandbox stops a template from reaching Python, not from exhausting the machine: `'a' * 10**9`
allocates a gigabyte, and loops over `range(100000)` nested twice run for hours. Chat templates come
from Hub repositories, so rendering one is bounded here:

- **Products and powers** (`*`, `**`) are checked before they run: a string or list repeated past
  `MAX_CHARS`, or an integer power of more than `MAX_POWER_BITS` bits, is refused.
- **Output**: a render that yields more than `MAX_CHARS` characters is stopped.
- **Time**: a render runs at most `MAX_SECONDS`; the clock is read at every call the template makes,
  every 1024 items of a `range` and every chunk of output, so a loop that makes no output is stopped too.

A stopped render raises `TemplateLimitError` (a `ValueError`, one sentence naming the bound).
"""

from __future__ import annotations

import math
import time
from contextvars import ContextVar
from typing import Any, Iterable, Iterator

from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

MAX_CHARS = 16 * 2**20  # characters a render may produce, and a repeated string or list may hold
MAX_POWER_BITS = 4096  # bits of an integer `a ** b`
MAX_SECONDS = 5.0  # wall time of one render

_DEADLINE: ContextVar[float] = ContextVar("template_deadline", default=math.inf)


class TemplateLimitError(ValueError):
    """A chat template went past one of the bounds of this module."""


def _check_time() -> None:
    if time.monotonic() > _DEADLINE.get():
        raise TemplateLimitError(
            f"The chat template ran for more than {MAX_SECONDS:g} s and was stopped: fix the "
            f"template (a loop too long?)."
        )


class _Range:
    """`range(...)` for templates: jinja2's safe range, whose iteration reads the clock every 1024 items."""

    def __init__(self, *args: int):
        self._range = safe_range(*args)

    def __iter__(self) -> Iterator[int]:
        for i, value in enumerate(self._range):
            if not i & 1023:
                _check_time()
            yield value

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        return self._range[index]


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the bounds of this module."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.globals["range"] = _Range

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        if operator == "*":
            count = right if _size(left) else left
            size = _size(left) or _size(right)
            if isinstance(count, int) and size and size * count > MAX_CHARS:
                raise TemplateLimitError(
                    f"The chat template repeats a value of length {size} {count} times, more "
                    f"than the {MAX_CHARS} it may make: fix the template."
                )
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > MAX_POWER_BITS:
                raise TemplateLimitError(
                    f"The chat template computes {left} ** {right}, an integer of more than "
                    f"{MAX_POWER_BITS} bits: fix the template."
                )
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's own signature)
        _check_time()
        return super().call(__context, __obj, *args, **kwargs)


def bounded(chunks: Iterable[str]) -> Iterator[str]:
    """A render's chunks (`template.generate(...)`), stopped past `MAX_CHARS` characters or `MAX_SECONDS`."""
    token = _DEADLINE.set(time.monotonic() + MAX_SECONDS)
    try:
        made = 0
        for chunk in chunks:
            made += len(chunk)
            if made > MAX_CHARS:
                raise TemplateLimitError(
                    f"The chat template made more than {MAX_CHARS} characters and was stopped: fix the template."
                )
            _check_time()
            yield chunk
    finally:
        _DEADLINE.reset(token)


__all__ = ["BoundedSandbox", "MAX_CHARS", "MAX_POWER_BITS", "MAX_SECONDS", "TemplateLimitError", "bounded"]
