"""The seed's two TrainingArguments snippets in examples/ run as they are."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name, tmp_path, *argv, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_bf16_snippet(tmp_path):
    out = run_example("train_bf16.py", tmp_path, "20")
    assert "device cpu, bf16 True" in out and "trained 20 steps" in out
    assert (tmp_path / "outputs" / "metrics.jsonl").exists()


@pytest.mark.inductor
def test_compile_snippet_with_inductor(tmp_path):
    out = run_example("train_compile.py", tmp_path, "3")
    assert "backend inductor" in out and "training graphs 2" in out, out
