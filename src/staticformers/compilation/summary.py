"""How many of the graphs a run built were compiled, and how many the on-disk caches answered.

A graph loaded from `$STATICFORMERS_CACHE` (inductor's FX-graph cache, or a precompiled artifact)
still counts as a graph of the plan, but it cost a load, not a compile: `staticformers generate --stats`
and the demo say which. `CacheWatch` reads the counters PyTorch and the engine keep for that
(`torch._dynamo.utils.counters`: inductor's `fxgraph_cache_hit`, staticformers' `artifacts_loaded`)
before and after a run.
"""

from __future__ import annotations

from typing import Iterable


def cache_answers() -> int:
    """Graphs the on-disk caches have answered in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"] + counters["staticformers"]["artifacts_loaded"]


class CacheWatch:
    """`with CacheWatch() as w: ...` then `w.answered`: graphs the on-disk caches answered inside the block."""

    def __enter__(self) -> "CacheWatch":
        self._start = cache_answers()
        self.answered = 0
        return self

    def __exit__(self, *exc) -> None:
        self.answered = cache_answers() - self._start


def graphs_line(rows: Iterable[dict], answered: int, seconds: float) -> str:
    """One line: graphs built, how many came from the on-disk cache, and the seconds their first calls took."""
    rows = list(rows)
    graphs = sum(r["graphs"] for r in rows)
    answered = min(answered, graphs)
    compiled = graphs - answered
    if not graphs:
        return "no graphs (eager)"
    parts = [f"{compiled} compiled"] if compiled else []
    if answered:
        parts.append(f"{answered} loaded from the on-disk cache")
    return f"{graphs} graph{'s' if graphs != 1 else ''} ({', '.join(parts)}) in {seconds:.1f} s"


__all__ = ["CacheWatch", "cache_answers", "graphs_line"]
