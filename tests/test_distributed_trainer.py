"""The Trainer on a model partitioned at load time (4 CPU ranks, gloo) against the Trainer in one process."""

from __future__ import annotations

import json
import os

import pytest
import torch

import distributed_trainer_worker as W
from launch import torchrun
import tolerances as tol

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("qwen3", num_key_value_heads=4)


@pytest.fixture(scope="module")
def launched(checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist_trainer"))
    torchrun("distributed_trainer_worker.py", checkpoint, out)
    results = []
    for r in range(4):
        with open(os.path.join(out, f"trainer_rank{r}.json")) as f:
            results.append(json.load(f))
    torchrun("distributed_trainer_worker.py", checkpoint, out, nproc=1)
    with open(os.path.join(out, "trainer_one.json")) as f:
        results.append(json.load(f))
    return results, out


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory):
    from staticformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = str(tmp_path_factory.mktemp("one_process_trainer"))
    trainer = Trainer(model=model, args=W.args_for(out, W.GLOBAL_BATCH), train_dataset=W.docs(model.config.vocab_size))
    trainer.train()
    history = W.history(trainer)
    history["eval_loss"] = trainer.evaluate(eval_dataset=W.docs(model.config.vocab_size, n=10, seed=1))["eval_loss"]
    return history, model.eval()


def test_trainer_at_tp2_fsdp2_matches_one_process(launched, reference):
    results, _ = launched
    expected, _ = reference
    assert expected["steps"] == [1, 2, 3, 4]
    for rank, res in enumerate(results[:4]):
        # one Trainer class; a partitioned model gives it its distributed side
        assert res["trainer_class"] == "Trainer" and res["distributed"] == "DistributedTraining"
        assert res["tp2_fsdp2"]["losses"] == pytest.approx(expected["losses"], rel=tol.FP32_TRAINED), f"rank {rank}"
        assert res["tp2_fsdp2"]["grad_norms"] == pytest.approx(expected["grad_norms"], rel=tol.FP32_TRAINED), (
            f"rank {rank}"
        )
        assert res["eval_loss"] == pytest.approx(expected["eval_loss"], rel=tol.FP32_TRAINED), f"rank {rank}"


def test_trainer_checkpoint_resumes_at_fsdp4_with_compiled_blocks(launched, reference):
    results, out = launched
    expected, _ = reference
    for res in results[:4]:
        assert res["compiled_blocks"] == 2
        assert res["resumed_fsdp4"]["losses"] == pytest.approx(expected["losses"], rel=tol.FP32_TRAINED)
        assert res["resumed_fsdp4"]["grad_norms"] == pytest.approx(expected["grad_norms"], rel=tol.FP32_TRAINED)
    assert {"checkpoint-2", "checkpoint-4"} <= set(os.listdir(os.path.join(out, "tp2_fsdp2")))


def test_trainer_checkpoint_resumes_in_one_process(launched, reference):
    results, _ = launched
    expected, _ = reference
    assert results[4]["losses"] == pytest.approx(expected["losses"], rel=tol.FP32_TRAINED)
    assert results[4]["grad_norms"] == pytest.approx(expected["grad_norms"], rel=tol.FP32_TRAINED)


def test_trainer_save_model_loads_in_transformers(launched, reference):
    from transformers import AutoModelForCausalLM as HFModel

    _, out = launched
    _, model = reference
    hf = HFModel.from_pretrained(os.path.join(out, "final"), dtype=torch.float32).eval()
    ids = torch.tensor([list(range(1, 17))])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(input_ids=ids).logits, atol=5e-3, rtol=0)
