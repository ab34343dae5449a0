"""The lint gate: ruff's checks configured in pyproject.toml ([tool.ruff.lint]: unused and undefined names, syntax
and statement errors, bugbear's likely bugs) pass over the package, the tests, the benchmarks and the examples, and
they are formatted as `ruff format` writes them ([tool.ruff]: 120 columns). `ruff format src tests bench examples`
formats them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--output-format",
            "concise",
            "src",
            "tests",
            "bench",
            "examples",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_changes_nothing():
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "src", "tests", "bench", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, "run `ruff format src tests bench examples`: " + out.stdout[-4000:] + out.stderr[-2000:]
