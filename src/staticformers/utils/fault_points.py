"""Named points where a test can kill the process (SIGKILL), to prove that no kill loses a checkpoint.

The checkpoint writer (`training/checkpoint_folders.py`, `checkpoints/weights_writer.py`, the Trainer's save) calls
`reached("name")` at each moment that matters: files written, before the commit rename, between the
renames of a re-save, after it. With `STATICFORMERS_FAULT_POINT=name` (or `name:N`, the N-th time
that point is reached) the process kills itself there with SIGKILL, which no `finally` or `except`
sees, exactly as `kill -9` or the kernel's OOM killer would. Unset (always, outside tests), a call
costs one dictionary lookup.
"""

from __future__ import annotations

import collections
import os
import signal

ENV = "STATICFORMERS_FAULT_POINT"

_hits: collections.Counter = collections.Counter()


def reached(name: str) -> None:
    """Kill this process now if `STATICFORMERS_FAULT_POINT` names this point (and this is the N-th hit)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, nth = spec.rpartition(":")
    if not nth.isdigit():  # no count given: the name is the whole spec
        target, nth = spec, "1"
    if target != name:
        return
    _hits[name] += 1
    if _hits[name] >= int(nth):
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["reached", "ENV"]
