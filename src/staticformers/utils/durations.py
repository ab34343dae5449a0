"""Durations as people read them: a short one in milliseconds, a longer one in seconds.

A fixed `{:.2f} s` prints a 12 ms generation as "0.01 s" and a 3 ms one as "0.00 s"; tables and summary
lines (the CLI's `--stats`, the demo's generation table) print `duration(seconds)` instead, with three
significant figures below ten seconds.
"""

from __future__ import annotations


def duration(seconds: float) -> str:
    """`seconds` as "850 us", "12.3 ms", "1.23 s", "12.3 s" or "123 s" (at least three significant figures)."""
    if seconds != seconds or seconds < 0:  # NaN or negative: no duration to speak of
        raise ValueError(f"a duration must be a non-negative number of seconds, not {seconds!r}")
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        ms = seconds * 1e3
        return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


__all__ = ["duration"]
