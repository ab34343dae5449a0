"""The CPU kernels' thread count, set once per process when the CPU backend is made.

torch starts with a thread per core it counts, which ignores an affinity mask's and a container quota's
limits; on a 2-CPU quota of a 64-core host it would run 32 or 64 threads whose every parallel region waits
for the slowest, descheduled one. `utils/cpus.py` chooses the count (`--threads`,
`STATICFORMERS_NUM_THREADS`, `OMP_NUM_THREADS`, else the CPUs usable); here it is applied: an explicit count
as given, the default only ever lowering torch's (a `torch.set_num_threads` the caller made below it stays).
The saved compiled functions are keyed by the thread count (`precompiled.py`), so this runs before any is
looked up. Several threads with OpenMP's spinning wait (a program that imported torch without choosing a
wait policy; the command line chooses a short spin itself) get a one-time warning saying what to set.
"""

from __future__ import annotations

import logging
import os

import torch

from ...utils.cpus import THREADS_ENV, WAIT_ENV, ThreadChoice, choose_threads

log = logging.getLogger(__name__)

# said once per process, where it can still be acted on (a next run): the command line sets a short spin itself
SPIN_HINT = (
    "staticformers: the CPU kernels run on {n} threads whose idle OpenMP workers spin (OpenMP's default "
    "wait): on a machine busy with other work that can make each step many times slower than one "
    "thread. Set GOMP_SPINCOUNT=2000 (or OMP_WAIT_POLICY=PASSIVE) in the environment before torch is imported (or "
    "STATICFORMERS_NUM_THREADS=1); `staticformers doctor` shows the choice."
)


def apply_thread_choice(choice: ThreadChoice | None = None) -> ThreadChoice:
    """Set torch's intra-op threads from `choice` (default: `choose_threads()`) and return what applies now."""
    choice = choice or choose_threads()
    current = torch.get_num_threads()
    if choice.source in ("--threads", THREADS_ENV) or (not choice.explicit and current > choice.threads):
        if current != choice.threads:
            torch.set_num_threads(choice.threads)
            log.info("CPU threads: %s (torch had %d)", choice.reason(), current)
    spin_hint(torch.get_num_threads(), os.environ)
    return choice


def spin_hint(threads: int, environ) -> bool:
    """Warn once (logging) when several threads run with OpenMP's spinning default; returns whether it warned."""
    global _HINTED
    if _HINTED or threads < 2 or any(environ.get(name, "").strip() for name in WAIT_ENV):
        return False
    _HINTED = True
    log.warning(SPIN_HINT.format(n=threads))
    return True


_HINTED = False


__all__ = ["apply_thread_choice"]
