"""The Trainer on XLA (a model placed on the XLA device trains there): packed fp32 rows, no compilation after
the second optimizer step, and every step's loss equal to the CPU run's within what fp32 reordering
over a few AdamW steps allows (tied embeddings stay tied when the model moves to XLA: untied, the two
copies trained apart and the losses drifted by 5e-4 from the second step on)."""

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
    return [
        {"input_ids": torch.randint(1, VOCAB, (int(k),), generator=g).tolist()}
        for k in torch.randint(3, 30, (n,), generator=g)
    ]


def train(tmp_path, device: str, steps: int, resume: str = None, **kw):
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(cfg, seed=0)
    if device == "xla":
        model.to(torch.device("xla", 0))
    base = dict(
        output_dir=str(tmp_path / device),
        max_length=32,
        per_device_train_batch_size=4,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
        packing=True,
    )
    args = TrainingArguments(**{**base, **kw})
    trainer = Trainer(model=model, args=args, train_dataset=docs())
    compiles = []
    step = trainer._optimizer_step

    def counted(*a, **kw):
        before = runtime.counters().uncached_compiles
        out = step(*a, **kw)
        compiles.append(runtime.counters().uncached_compiles - before)
        return out

    trainer._optimizer_step = counted
    trainer.train(resume_from_checkpoint=resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    return trainer, losses, compiles


def test_trainer_on_xla_compiles_nothing_after_step_two(tmp_path):
    trainer, losses, compiles = train(tmp_path, "xla", steps=5)
    assert trainer.device.type == "xla"
    assert len(compiles) == 5 and sum(compiles[2:]) == 0, compiles
    _, cpu_losses, _ = train(tmp_path, "cpu", steps=5)
    assert len(losses) == 5 and losses == pytest.approx(cpu_losses, rel=tol.FP32_TRAINED)


def test_save_and_exact_resume_on_xla(tmp_path):
    _, whole, _ = train(tmp_path, "xla", steps=4, save_strategy="steps", save_steps=2)
    _, rest, compiles = train(tmp_path, "xla", steps=4, resume=str(tmp_path / "xla" / "checkpoint-2"))
    assert len(compiles) == 2  # the resumed run made steps 3 and 4; its history holds the restored 1 and 2
    assert len(whole) == len(rest) == 4 and rest == pytest.approx(whole, rel=tol.FP32_TRAINED)
