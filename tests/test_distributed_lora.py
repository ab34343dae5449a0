"""LoRA fine-tuning of a model partitioned tp2 x fsdp2 (4 CPU ranks, gloo) against one process: the same
losses and gradient norms, only the adapter trains, its B split like a column-wise base and its A like a
row-wise one, the checkpoint holds the adapter alone and resumes exactly, and `save_model` writes PEFT's
files with the one-process adapter's values."""

from __future__ import annotations

import json
import os

import pytest
import torch

import distributed_lora_worker as W
import distributed_trainer_worker as T
import tolerances as tol
from launch import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("qwen3", num_key_value_heads=4)


@pytest.fixture(scope="module")
def launched(checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist_lora"))
    torchrun("distributed_lora_worker.py", checkpoint, out)
    with open(os.path.join(out, "lora.json")) as f:
        return json.load(f), out


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory):
    from staticformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    W.add_adapter(model)
    out = str(tmp_path_factory.mktemp("one_process_lora"))
    trainer = Trainer(model=model, args=T.args_for(out, T.GLOBAL_BATCH), train_dataset=T.docs(model.config.vocab_size))
    trainer.train()
    return T.history(trainer), model


def test_lora_at_tp2_fsdp2_matches_one_process(launched, reference):
    result, _ = launched
    expected, model = reference
    assert result["trainable"] == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert all("lora_" in n for n in result["trainable"])
    assert result["run"]["steps"] == expected["steps"]
    assert result["run"]["losses"] == pytest.approx(expected["losses"], rel=tol.FP32_TRAINED)
    assert result["run"]["grad_norms"] == pytest.approx(expected["grad_norms"], rel=tol.FP32_TRAINED)


def test_adapter_weights_follow_their_base_layers_split(launched):
    """Over (fsdp, tp) a weight's last placement is its tensor-parallel one; FSDP-only weights have one."""
    placed = launched[0]["placements"]
    colwise, rowwise = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert len(placed[f"{colwise}.lora_B.default.weight"]) == 2
    assert placed[f"{colwise}.lora_B.default.weight"][-1] == "S(0)"  # B's rows: the base's output columns
    assert len(placed[f"{colwise}.lora_A.default.weight"]) == 1  # A whole across tp (FSDP shards it)
    assert len(placed[f"{rowwise}.lora_A.default.weight"]) == 2
    assert placed[f"{rowwise}.lora_A.default.weight"][-1] == "S(1)"  # A's columns: the base's inputs
    assert len(placed[f"{rowwise}.lora_B.default.weight"]) == 1


def test_the_checkpoint_holds_the_adapter_and_resumes_exactly(launched):
    result, _ = launched
    assert "config.json" in result["checkpoint_files"] and "model.safetensors" not in result["checkpoint_files"]
    resumed = result["resumed"]
    k = resumed["steps"][0] - 1
    assert resumed["losses"] == pytest.approx(result["run"]["losses"][k:], rel=tol.FP32_TRAINED)


def test_save_model_writes_the_gathered_adapter_in_peft_format(launched, reference):
    from safetensors.torch import load_file

    _, out = launched
    _, model = reference
    saved = load_file(os.path.join(out, "final", "adapter_model.safetensors"))
    gathered = load_file(os.path.join(out, "gathered.safetensors"))  # DTensor's own full_tensor() of each weight
    ours = {
        f"base_model.model.{n}".replace(".default", ""): p.detach() for n, p in model.named_parameters() if "lora_" in n
    }
    assert saved.keys() == ours.keys() == gathered.keys()
    for k in saved:
        assert torch.equal(saved[k], gathered[k]), k  # a gather moves values, it computes nothing
        # against one process: AdamW moves a weight by about lr a step whatever its gradient's size, so
        # where a gradient is near zero the other ranks' summation order can change its update by up to
        # that; a wrong shard or a transposed gather moves weights by their own scale (init_lora_weights=False:
        # both A and B start random)
        assert (saved[k] - ours[k]).abs().max() <= T.MAX_STEPS * T.LEARNING_RATE, k
    assert os.path.isfile(os.path.join(out, "final", "adapter_config.json"))
