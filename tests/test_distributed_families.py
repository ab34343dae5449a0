"""Phi-3 (q/k/v and gate/up fused on disk, read per rank from the fused tensors) and GLM-4 (interleaved partial
RoPE, q/k/v biases, fused gate/up, post norms) at tensor parallel 2 under torchrun (2 CPU ranks, gloo), against
one process: logits, greedy tokens, a training step's loss (Phi-3 with LoRA on PEFT's fused names), and the
checkpoint a partitioned model saves (fused names again, loaded by transformers)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import distributed_families_worker as W
from launch import torchrun
import tolerances as tol

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def launched(tiny_checkpoints, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist_families"))
    paths = {"phi3": tiny_checkpoints("phi3"), "glm4": tiny_checkpoints("glm4")}
    torchrun("distributed_families_worker.py", paths["phi3"], paths["glm4"], out, nproc=2)
    results = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results, out, paths


def _single(family, path):
    from staticformers import AutoModelForCausalLM, LoraConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(W.PROMPT)).logits[0, -1]
    ids = model.generate(torch.tensor(W.PROMPT), max_new_tokens=W.NEW_TOKENS, do_sample=False, disable_compile=True)
    if family == "phi3":
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"],
                                     init_lora_weights=False))
    model.train()
    loss = float(model(input_ids=W.TRAIN, labels=W.TRAIN).loss.detach())
    return logits, ids[0, len(W.PROMPT[0]):].tolist(), loss


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_tensor_parallel_2_equals_one_process(launched, family):
    results, out, paths = launched
    logits, tokens, loss = _single(family, paths[family])
    for rank in results:
        tol.assert_close(torch.tensor(rank[family]["logits"]), logits)
        assert rank[family]["generate"] == tokens
        assert rank[family]["loss"] == pytest.approx(loss, rel=tol.FP32_REORDERED)
    from safetensors import safe_open

    saved = os.path.join(out, f"{family}_saved")
    with safe_open(os.path.join(saved, "model.safetensors"), "pt") as f, \
            safe_open(os.path.join(paths[family], "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        for name in g.keys():
            assert torch.equal(f.get_tensor(name), g.get_tensor(name)), name
