"""Launching a test worker under torchrun on the CPU (gloo), for the distributed tests."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def torchrun(worker: str, *args: str, nproc: int = 4) -> None:
    """Run `tests/<worker>` with `nproc` ranks; assert it succeeded and exited cleanly."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src")}
    cmd = [TORCHRUN, f"--nproc_per_node={nproc}", "--standalone", os.path.join(ROOT, "tests", worker), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "terminate called" not in proc.stderr  # the gloo exit abort (ARCHITECTURE.md): shutdown() prevents it
