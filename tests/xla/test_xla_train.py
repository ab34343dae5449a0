"""The Trainer on XLA (a model loaded with device_map="xla" trains there): packed fp32 rows, one XLA graph
set for the first steps and no compilation after the second, and the first step's loss equal to the
CPU's. What is not proven here (README): later steps drift from the CPU's by up to 5e-4 relative,
more than fp32 reordering explains, and is under investigation."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed here: `make test-xla` runs these in its own venv")

import torch  # noqa: E402

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402
from staticformers.backends.xla import runtime  # noqa: E402

import tolerances as tol  # noqa: E402

VOCAB = 64


def docs(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (int(k),), generator=g).tolist()}
            for k in torch.randint(3, 30, (n,), generator=g)]


def train(tmp_path, device: str, steps: int):
    cfg = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, seed=0)
    if device == "xla":
        model.to(torch.device("xla", 0))
    args = TrainingArguments(output_dir=str(tmp_path / device), max_length=32, per_device_train_batch_size=4,
                             max_steps=steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                             learning_rate=1e-3, seed=0, packing=True)
    trainer = Trainer(model=model, args=args, train_dataset=docs())
    compiles = []
    step = trainer._optimizer_step

    def counted(*a, **kw):
        before = runtime.counters().uncached_compiles
        out = step(*a, **kw)
        compiles.append(runtime.counters().uncached_compiles - before)
        return out

    trainer._optimizer_step = counted
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    return trainer, losses, compiles


def test_trainer_on_xla_compiles_nothing_after_step_two(tmp_path):
    trainer, losses, compiles = train(tmp_path, "xla", steps=5)
    assert trainer.device.type == "xla"
    assert len(compiles) == 5 and sum(compiles[2:]) == 0, compiles
    _, cpu_losses, _ = train(tmp_path, "cpu", steps=1)
    assert losses[0] == pytest.approx(cpu_losses[0], rel=tol.FP32_REORDERED)
