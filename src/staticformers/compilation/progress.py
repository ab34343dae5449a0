"""What a compile of many shapes says while it runs: how many shapes, which one now, and how long the rest
should take.

`staticformers compile`, the server's `--precompile` and `staticformers generate`'s first call compile a
known list of shapes (each one step function: one graph, or a few regions of one) that can take minutes on
a compile-per-shape device. `CompileProgress` turns the rows `Engine.precompile` reports into lines such as
"compiling shape 3/8 (about 40 s left: 20 s a shape so far in this run)". Its estimate is the mean seconds
of the shapes this run has already done (compiled or loaded from the on-disk cache) times the shapes left;
before any has finished it states a per-shape figure for the backend (`FIRST_GUESS`) or says it has none.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

from ..utils.durations import duration

# backend -> what one shape costs before this run has timed one (a stated figure, said as such)
FIRST_GUESS = {
    "inductor": "an inductor compile takes about 10-20 s a shape on a small CPU, less on a large one, "
    "about a second when the on-disk cache has it",
    "eager": "the eager backend only traces (no compiler): seconds a shape",
    "aot_eager": "aot_eager only traces (no compiler): seconds a shape",
}


class CompileProgress:
    """`progress = CompileProgress(total, backend)`; `progress.begin()` before the first shape, then
    `progress(row)` after each (the row `Engine.precompile` passes: kind, shape, seconds, cache_hit, graphs).
    `write` prints one line (default: stderr, flushed); `describe(row)` adds the finished shape's own line."""

    def __init__(
        self,
        total: int,
        backend: str,
        write: Optional[Callable[[str], None]] = None,
        describe: Optional[Callable[[dict], str]] = None,
    ):
        self.total, self.backend = int(total), backend
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.describe = describe
        self.done: list[dict] = []

    def estimate(self) -> str:
        """How long the shapes left should take, from this run's pace, or the stated figure."""
        left = self.total - len(self.done)
        if not self.done:
            guess = FIRST_GUESS.get(self.backend)
            return f"no shape timed yet; {guess}" if guess else f"no shape timed yet, and no figure for {self.backend}"
        pace = sum(r["seconds"] for r in self.done) / len(self.done)
        return f"about {duration(pace * left)} left: {duration(pace)} a shape so far in this run"

    def begin(self) -> None:
        if self.total:
            self.write(
                f"compiling {self.total} shape{'s' if self.total != 1 else ''} "
                f"(each one step's graphs; {self.estimate()})"
            )
            self.write(f"compiling shape 1/{self.total}")

    def __call__(self, row: dict) -> None:
        self.done.append(row)
        if self.describe is not None:
            self.write(self.describe(row))
        if len(self.done) < self.total:
            self.write(f"compiling shape {len(self.done) + 1}/{self.total} ({self.estimate()})")


__all__ = ["CompileProgress", "FIRST_GUESS"]
