"""Checkpoints: exact resume, save_total_limit, atomic writes, and a process killed mid-save (real SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from staticformers.training import checkpoint_folders as ckpt

HERE = os.path.dirname(os.path.abspath(__file__))


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed=0):
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg, seed=seed)


def docs(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, 64, (int(k),), generator=g).tolist()}
        for k in torch.randint(3, 30, (n,), generator=g)
    ]


def args_for(path, **kw):
    base = dict(
        output_dir=str(path),
        max_length=32,
        per_device_train_batch_size=4,
        max_steps=8,
        logging_steps=2,
        save_strategy="steps",
        save_steps=3,
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.01,
    )
    return TrainingArguments(**{**base, **kw})


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Crash(Exception):
    pass


class Crashing(Trainer):
    """Dies right after step 4 (checkpoint-3 is on disk), as a killed run would."""

    def log(self, logs):
        super().log(logs)
        if self.state.global_step == 4 and "loss" in logs:
            raise Crash()


@pytest.mark.parametrize(
    "extra", [dict(), dict(bf16=True, packing=True, gradient_accumulation_steps=2)], ids=["fp32", "bf16-packed-accum"]
)
def test_resume_is_bit_identical(tmp_path, extra):
    full = tiny_model()
    Trainer(
        model=full, args=args_for(tmp_path / "full", **extra), train_dataset=docs()
    ).train()  # 10 batches/epoch: crosses epochs

    first = tiny_model()
    with pytest.raises(Crash):
        Crashing(model=first, args=args_for(tmp_path / "split", **extra), train_dataset=docs()).train()
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path / "split"))] == [3]
    resumed = tiny_model(seed=123)  # different weights: everything must come from the checkpoint
    trainer = Trainer(model=resumed, args=args_for(tmp_path / "split", **extra), train_dataset=docs())
    out = trainer.train(resume_from_checkpoint=True)
    assert out.global_step == 8
    a, b = state(full), state(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    saved = os.listdir(tmp_path / "split" / "checkpoint-3")
    for name in (
        "config.json",
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
    ):
        assert name in saved


def test_save_total_limit_and_checkpoint_folders(tmp_path):
    trainer = Trainer(
        model=tiny_model(), args=args_for(tmp_path, save_steps=2, save_total_limit=2), train_dataset=docs()
    )
    trainer.train()
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == [6, 8]
    st = ckpt.read_json(str(tmp_path / "checkpoint-8" / "trainer_state.json"))
    assert st["global_step"] == 8 and st["log_history"] and st["train_rows"] > 0


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    class Failing(Trainer):
        def save_checkpoint_files(self, directory):
            if self.state.global_step == 6:
                open(os.path.join(directory, "model.safetensors"), "wb").write(b"half")
                raise OSError("disk full")
            super().save_checkpoint_files(directory)

    with pytest.raises(OSError, match="disk full"):
        Failing(model=tiny_model(), args=args_for(tmp_path), train_dataset=docs()).train()
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == [3]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(ckpt.TMP_PREFIX)]


def test_resume_refuses_other_data(tmp_path):
    Trainer(model=tiny_model(), args=args_for(tmp_path, max_steps=3), train_dataset=docs()).train()
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="same dataset"):
        Trainer(model=model, args=args_for(tmp_path, bf16=True), train_dataset=docs(80)).train(
            resume_from_checkpoint=True
        )
    # the refusal loses nothing: the caller's fp32 weights are untouched (not cast, not overwritten)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n
    # a checkpoint that fails half-way through loading (its optimizer file is gone) gives the model back too
    os.remove(os.path.join(ckpt.last_checkpoint(str(tmp_path)), ckpt.OPTIMIZER))
    with pytest.raises(FileNotFoundError):
        Trainer(model=model, args=args_for(tmp_path, bf16=True), train_dataset=docs()).train(
            resume_from_checkpoint=True
        )
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        os.makedirs(tmp_path / "checkpoint-99")
        ckpt.resolve_resume_path(str(tmp_path / "checkpoint-99"), str(tmp_path))


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {here!r})
    from test_checkpoint_resume import tiny_model, docs, args_for
    from staticformers import Trainer
    import staticformers.training.trainer as tr

    class SlowSave(Trainer):
        def save_checkpoint_files(self, directory):
            if self.state.global_step == 6:  # the second save: write part of it, then hang until killed
                torch.save(self.optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
                print("SAVING", directory, flush=True)
                time.sleep(120)
            super().save_checkpoint_files(directory)

    SlowSave(model=tiny_model(), args=args_for({out!r}), train_dataset=docs()).train()
""")


def test_sigkill_mid_save_leaves_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(here=HERE, out=str(out)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("SAVING"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"the child ended before saving: {proc.stderr.read()[-2000:]}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    names = os.listdir(out)
    assert "checkpoint-3" in names and "checkpoint-6" not in names
    assert any(n.startswith(ckpt.TMP_PREFIX) for n in names)  # the half-written one, never loaded
    assert ckpt.last_checkpoint(str(out)) == str(out / "checkpoint-3")
    # the last good checkpoint loads in transformers and resumes; the next save clears the debris
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(str(out / "checkpoint-3"))
    resumed = tiny_model(seed=5)
    Trainer(model=resumed, args=args_for(out), train_dataset=docs()).train(resume_from_checkpoint=True)
    full = tiny_model()
    Trainer(model=full, args=args_for(tmp_path / "full"), train_dataset=docs()).train()
    assert all(torch.equal(a, b) for a, b in zip(state(full).values(), state(resumed).values()))
    assert not any(n.startswith(ckpt.TMP_PREFIX) for n in os.listdir(out))
    assert [s for s, _ in ckpt.list_checkpoints(str(out))] == [3, 6, 8]
