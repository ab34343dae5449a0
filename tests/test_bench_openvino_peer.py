"""bench/generate.py's OpenVINO contenders (bench/openvino_peer.py): the runs it refuses, each in one sentence.
The peer itself needs the `openvino` extra's venv; its measurements are in BENCHMARKS.md."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import openvino_peer  # noqa: E402


def test_no_openvino_contender_asks_nothing():
    openvino_peer.check(["hf", "sf", "sf_int8"], ["float16"], "cuda")  # nothing of OpenVINO's asked: no refusal


def test_openvino_off_the_cpu_is_refused():
    with pytest.raises(SystemExit, match="runs on the CPU only: drop it or pass --device cpu"):
        openvino_peer.check(["sf", "openvino"], ["float32"], "cuda")


def test_a_dtype_without_a_pinned_precision_is_refused():
    with pytest.raises(SystemExit, match="float32 or bfloat16 only, not float16"):
        openvino_peer.check(["openvino_int8"], ["bfloat16", "float16"], "cpu")
    assert openvino_peer.PRECISION_HINTS == {"float32": "f32", "bfloat16": "bf16"}


def test_without_optimum_intel_the_contender_names_the_extra(monkeypatch):
    monkeypatch.setattr(openvino_peer, "available", lambda: False)
    with pytest.raises(
        SystemExit, match=r"needs optimum-intel with OpenVINO, not importable here: pip install -e '\.\[openvino\]'"
    ):
        openvino_peer.check(["openvino"], ["float32"], "cpu")
