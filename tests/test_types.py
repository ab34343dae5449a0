"""The type gate: mypy, configured in pyproject.toml ([tool.mypy]: the typed core's files, and how strictly), finds
nothing in the modules it lists. Its cache is .mypy_cache at the root (gitignored): a cold run takes about 15 s on
one core, a warm one under a second."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_finds_nothing():
    pytest.importorskip("mypy", reason="mypy comes with the test extra: pip install -e '.[test]'")
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--no-color-output"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
