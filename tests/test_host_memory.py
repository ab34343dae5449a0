"""Training on the CPU keeps freed host memory in the process: a step that allocates and frees the
same blocks as the one before reuses mapped pages instead of page-faulting each of them again
(checked in fresh processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys
import torch
from staticformers.backends.cpu.host_memory import keep_freed_host_memory
print("tuned", keep_freed_host_memory())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a training step's pattern: blocks of several sizes, touched, then all freed
    held = [torch.ones(mb * 2**20 // 4) for mb in (8, 64, 96, 24)]
    del held
counts = []
for _ in range(6):
    before = faults()
    step()
    counts.append(faults() - before)
print("faults", min(counts[3:]))  # steady state: the last three steps' best
"""


def probe(**env) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src"), **env},
    )
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    return lines["tuned"] == "True", int(lines["faults"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    tuned, faults = probe()
    assert tuned
    assert faults < 4000  # the step's 192 MiB are 49,152 pages: reused, not faulted in again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_opt_out_leaves_malloc_alone():
    tuned, faults = probe(STATICFORMERS_KEEP_HOST_MEMORY="0")
    assert not tuned
    assert faults > 40000  # glibc maps fresh blocks and faults every page in again
