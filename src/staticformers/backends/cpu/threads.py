"""The CPU kernels' thread count, set once per process when the CPU backend is made.

torch starts with a thread per core it counts, which ignores an affinity mask's and a container quota's
limits; on a 2-CPU quota of a 64-core host it would run 32 or 64 threads whose every parallel region waits
for the slowest, descheduled one. `utils/cpus.py` chooses the count (`--threads`,
`STATICFORMERS_NUM_THREADS`, `OMP_NUM_THREADS`, else the CPUs usable); here it is applied: an explicit count
as given, the default only ever lowering torch's (a `torch.set_num_threads` the caller made below it stays).
The saved compiled functions are keyed by the thread count (`precompiled.py`), so this runs before any is
looked up.
"""

from __future__ import annotations

import logging

import torch

from ...utils.cpus import THREADS_ENV, ThreadChoice, choose_threads

log = logging.getLogger(__name__)


def apply_thread_choice(choice: ThreadChoice | None = None) -> ThreadChoice:
    """Set torch's intra-op threads from `choice` (default: `choose_threads()`) and return what applies now."""
    choice = choice or choose_threads()
    current = torch.get_num_threads()
    if choice.source in ("--threads", THREADS_ENV) or (not choice.explicit and current > choice.threads):
        if current != choice.threads:
            torch.set_num_threads(choice.threads)
            log.info("CPU threads: %s (torch had %d)", choice.reason(), current)
    return choice


__all__ = ["apply_thread_choice"]
