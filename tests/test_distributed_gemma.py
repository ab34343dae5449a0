"""Gemma 2 (soft caps, windows) and Gemma 3 (per-head q/k norm, two RoPE bases) at tp_size=2 under torchrun
(2 CPU ranks, gloo) equal one process: logits, greedy tokens and two training steps' losses. OLMo 2's
refusal of tensor parallelism is in test_gemma_olmo.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

import distributed_gemma_worker as W
from launch import torchrun
import tolerances as tol

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
FAMILIES = ("gemma2", "gemma3")


@pytest.fixture(scope="module")
def launched(tiny_checkpoints, tmp_path_factory):
    """(family -> checkpoint, per-rank results) of one 2-rank launch."""
    paths = {f: tiny_checkpoints(f) for f in FAMILIES}
    out = str(tmp_path_factory.mktemp("dist_gemma"))
    torchrun("distributed_gemma_worker.py", out, *paths.values(), nproc=2)
    results = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return paths, results


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_one_process(launched, family):
    from staticformers import AutoModelForCausalLM

    paths, results = launched
    path = paths[family]
    want = W.run(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    for rank in results:
        got = rank[path]
        tol.assert_close(torch.tensor(got["logits"]), torch.tensor(want["logits"]))
        assert got["tokens"] == want["tokens"]
        assert got["losses"] == pytest.approx(want["losses"], rel=tol.FP32_TRAINED)
        assert got["q_proj_rows"] == 4 * 16 // 2  # each rank holds half the query heads
