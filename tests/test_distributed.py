"""Tensor parallel + FSDP2 under torchrun (4 CPU ranks, gloo) against one process, on a tiny Qwen3.

One torchrun launch (tests/distributed_worker.py) runs every layout in turn, because each launch
costs ~8 s of startup here; the tests below read its per-rank results and compare them with the
same recipe run in this process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import distributed_worker as W
from launch import torchrun
import tolerances as tol

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = ("tp2_fsdp2", "tp4", "fsdp4")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("qwen3", num_key_value_heads=4)  # 4 KV heads: tp4 splits them


@pytest.fixture(scope="module")
def gen_checkpoint(tiny_checkpoints):
    return tiny_checkpoints("llama", num_key_value_heads=4)  # untied: its greedy tokens vary


@pytest.fixture(scope="module")
def bias_checkpoint(tiny_checkpoints):
    return tiny_checkpoints("qwen2", num_key_value_heads=4)  # q/k/v biases


@pytest.fixture(scope="module")
def launched(checkpoint, gen_checkpoint, bias_checkpoint, tmp_path_factory):
    """(per-rank results, output folder) of one 4-rank torchrun launch."""
    out = str(tmp_path_factory.mktemp("dist_out"))
    torchrun("distributed_worker.py", checkpoint, gen_checkpoint, bias_checkpoint, out)
    results = []
    for r in range(4):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results, out


def _single(checkpoint):
    from staticformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def _torch_clip(params, max_norm):
    return torch.nn.utils.clip_grad_norm_(list(params), max_norm)


@pytest.fixture(scope="module")
def reference(checkpoint, gen_checkpoint):
    """The recipe in one process: losses of every step, the trained model, greedy tokens."""
    gen = _single(gen_checkpoint)
    greedy = W.greedy(gen, W.PROMPT, W.NEW_TOKENS)
    with torch.no_grad():
        logits = gen(input_ids=torch.tensor(W.PROMPT)).logits[0, -1]
    model = _single(checkpoint)
    opt = W.make_optimizer(model)
    losses = W.train_steps(model, opt, range(W.STEPS), clip=_torch_clip)
    return {"losses": losses, "model": model.eval(), "greedy": greedy, "logits": logits}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_losses_match_one_process(launched, reference, layout):
    results, _ = launched
    for rank, res in enumerate(results):
        assert res[layout]["losses"] == pytest.approx(reference["losses"], rel=tol.FP32_TRAINED), f"rank {rank}"


def test_checkpoint_from_tp2_fsdp2_resumes_at_fsdp4_and_in_one_process(launched, reference, checkpoint):
    from staticformers.distributed.dcp_checkpoint import load_checkpoint

    results, out = launched
    tail = reference["losses"][W.RESUME_AT :]
    for res in results:
        assert res["resumed_fsdp4"]["losses"] == pytest.approx(tail, rel=tol.FP32_TRAINED)
    model = _single(checkpoint)
    opt = W.make_optimizer(model)
    extra = load_checkpoint(os.path.join(out, "dcp"), model, opt)
    assert extra == {"step": W.RESUME_AT}
    assert W.train_steps(model, opt, range(W.RESUME_AT, W.STEPS), clip=_torch_clip) == pytest.approx(
        tail, rel=tol.FP32_TRAINED
    )


def test_save_pretrained_writes_one_checkpoint_transformers_loads(launched, reference):
    from transformers import AutoModelForCausalLM as HFModel

    results, out = launched
    hf_dir = os.path.join(out, "hf")
    assert sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")) == ["model.safetensors"]
    hf = HFModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([W.PROBE])).logits[0]
        ours_one_process = reference["model"](input_ids=torch.tensor([W.PROBE])).logits[0]
    # exactly the weights the tp2 x fsdp2 ranks trained
    tol.assert_close(theirs, torch.tensor(results[0]["tp2_fsdp2_trained_logits"]))
    # and near the one-process run (AdamW amplifies 1e-7 gradient differences on near-zero gradients)
    torch.testing.assert_close(theirs, ours_one_process, atol=5e-3, rtol=0)


@pytest.mark.parametrize("layout", ("tp4", "tp2_fsdp2"))
def test_tensor_parallel_greedy_equals_one_process(launched, reference, layout):
    results, _ = launched
    assert len(set(reference["greedy"])) > 2  # a sequence that says something
    for rank, res in enumerate(results):
        assert res[f"{layout}_greedy"] == reference["greedy"], f"rank {rank}"
        tol.assert_close(torch.tensor(res[f"{layout}_logits"]), reference["logits"])


@pytest.mark.parametrize("layout", ("tp4", "tp2_fsdp2"))
def test_tensor_parallel_generate_equals_one_process(launched, reference, layout):
    results, _ = launched
    for rank, res in enumerate(results):
        assert res[f"{layout}_generate"] == reference["greedy"], f"rank {rank}: {res[f'{layout}_generate']}"


def test_tensor_parallel_with_qkv_biases_matches_one_process(launched, bias_checkpoint):
    model = _single(bias_checkpoint)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(W.PROMPT)).logits[0, -1]
    results, _ = launched
    for res in results:
        tol.assert_close(torch.tensor(res["qwen2_tp4_logits"]), expected)


def test_per_rank_parameter_and_optimizer_bytes_are_a_quarter(launched, reference):
    model = reference["model"]
    whole = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    results, _ = launched
    for layout, limit in (("tp2_fsdp2", 0.27), ("fsdp4", 0.27), ("tp4", 0.30)):
        for res in results:
            assert res[layout]["param_bytes"] <= limit * whole, (layout, res[layout]["param_bytes"], whole)
            assert res[layout]["optim_bytes"] <= 2 * limit * whole  # AdamW: two moments per parameter
        total = sum(res[layout]["param_bytes"] for res in results)
        assert total >= whole  # every weight is held somewhere


def test_hsdp_and_cpu_offload_match_one_process(launched, reference):
    results, _ = launched
    for res in results:
        assert res["hsdp2x2"]["losses"] == pytest.approx(reference["losses"], rel=tol.FP32_TRAINED)
        assert res["fsdp4_offload"]["losses"] == pytest.approx(reference["losses"][:2], rel=tol.FP32_TRAINED)


def test_fsdp_mixed_precision_keeps_fp32_shards_and_trains_close(launched, reference):
    results, _ = launched
    for res in results:
        assert res["tp2_fsdp2_bf16"]["param_dtypes"] == ["torch.float32"]  # master shards stay fp32
        assert res["tp2_fsdp2_bf16"]["losses"] == pytest.approx(
            reference["losses"][:2], rel=tol.BF16_LOSS
        )  # bf16 compute
