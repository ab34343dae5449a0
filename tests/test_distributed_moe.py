"""Expert parallelism under torchrun (4 CPU ranks, gloo) against one process, on a tiny Qwen3-MoE whose
loss includes the load-balancing loss: ep2 and ep4 with FSDP, ep2 inside tp2 (both exchanges), the
Trainer with compiled blocks, a checkpoint saved at ep2 resumed at ep4 and in one process, a Hugging
Face export transformers loads, and greedy tokens."""

from __future__ import annotations

import json
import os

import pytest
import torch

import distributed_trainer_worker as T
import distributed_worker as W
from launch import torchrun
import tolerances as tol

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = ("fsdp4_ep2", "fsdp4_ep4", "tp2_fsdp2_ep2", "tp2_fsdp2_ep2_all_reduce")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("qwen3-moe", num_key_value_heads=4, output_router_logits=True, router_aux_loss_coef=0.1)


@pytest.fixture(scope="module")
def launched(checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist_moe"))
    torchrun("distributed_moe_worker.py", checkpoint, out)
    results = []
    for r in range(4):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results, out


def _single(checkpoint):
    from staticformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory):
    from staticformers import Trainer

    model = _single(checkpoint)
    assert model.config.output_router_logits
    greedy = W.greedy(model, W.PROMPT, W.NEW_TOKENS)
    opt = W.make_optimizer(model)
    losses = W.train_steps(model, opt, range(W.STEPS), clip=lambda p, n: torch.nn.utils.clip_grad_norm_(list(p), n))
    trainer_model = _single(checkpoint)
    trainer = Trainer(
        model=trainer_model,
        args=T.args_for(str(tmp_path_factory.mktemp("moe_one")), T.GLOBAL_BATCH, save_strategy="no"),
        train_dataset=T.docs(trainer_model.config.vocab_size),
    )
    trainer.train()
    return {"losses": losses, "model": model.eval(), "greedy": greedy, "trainer": T.history(trainer)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_losses_match_one_process(launched, reference, layout):
    results, _ = launched
    for rank, res in enumerate(results):
        assert res[layout]["losses"] == pytest.approx(reference["losses"], rel=tol.FP32_TRAINED), f"rank {rank}"


def test_each_rank_holds_its_experts(launched):
    results, _ = launched
    # ep2: ranks 0,1 hold experts 0-1 and 2-3, split again over efsdp 2 (ranks 0 and 2 share experts 0-1)
    assert [r["ep2_rows"] for r in results] == [[0, 1], [2, 1], [1, 1], [3, 1]]
    assert [r["ep4_rows"] for r in results] == [[0, 1], [1, 1], [2, 1], [3, 1]]


def test_the_trainer_with_compiled_blocks_matches_one_process(launched, reference):
    results, _ = launched
    expected = reference["trainer"]
    for rank, res in enumerate(results):
        assert res["trainer_ep2"]["losses"] == pytest.approx(expected["losses"], rel=tol.FP32_TRAINED), f"rank {rank}"
        assert res["trainer_ep2"]["grad_norms"] == pytest.approx(expected["grad_norms"], rel=tol.FP32_TRAINED)


def test_a_checkpoint_from_ep2_resumes_at_ep4_and_in_one_process(launched, reference, checkpoint):
    from staticformers.distributed.dcp_checkpoint import load_checkpoint

    results, out = launched
    tail = reference["losses"][W.RESUME_AT :]
    for res in results:
        assert res["resumed_ep4"]["losses"] == pytest.approx(tail, rel=tol.FP32_TRAINED)
    model = _single(checkpoint)
    opt = W.make_optimizer(model)
    assert load_checkpoint(os.path.join(out, "dcp"), model, opt) == {"step": W.RESUME_AT}
    clip = lambda p, n: torch.nn.utils.clip_grad_norm_(list(p), n)  # noqa: E731
    assert W.train_steps(model, opt, range(W.RESUME_AT, W.STEPS), clip=clip) == pytest.approx(
        tail, rel=tol.FP32_TRAINED
    )


def test_the_export_loads_in_transformers_and_generation_matches(launched, reference):
    from transformers import AutoModelForCausalLM as HFModel

    results, out = launched
    hf = HFModel.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([W.PROBE])).logits[0]
    tol.assert_close(theirs, torch.tensor(results[0]["ep2_trained_logits"]))
    assert len(set(reference["greedy"])) > 1
    for rank, res in enumerate(results):
        assert res["ep2_generate"] == W.greedy(hf, W.PROMPT, W.NEW_TOKENS), f"rank {rank}"
