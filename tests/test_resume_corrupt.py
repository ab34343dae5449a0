"""Resuming from a damaged checkpoint: every state file's failure is one sentence naming the file; with
`resume_from_checkpoint=True` a damaged newest checkpoint is skipped with a warning saying why, and the
run continues from the previous one bit-identically."""

import json
import os
import pickle
import shutil

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from staticformers.training.state_files import CorruptCheckpointError

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


def docs(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, 64, (int(k),), generator=g).tolist()}
        for k in torch.randint(3, 30, (n,), generator=g)
    ]


def args(path, **kw):
    base = dict(
        output_dir=str(path),
        max_length=32,
        per_device_train_batch_size=4,
        max_steps=6,
        logging_steps=1,
        save_steps=2,
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
        warmup_steps=1,
        weight_decay=0.01,
    )
    return TrainingArguments(**{**base, **kw})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run stopped after checkpoint-4 (checkpoints 2 and 4), and the weights of the same run done to step 6."""
    root = tmp_path_factory.mktemp("runs")
    full = tiny_model()
    Trainer(model=full, args=args(root / "full"), train_dataset=docs()).train()
    with pytest.raises(Stop):
        StopAtFive(model=tiny_model(), args=args(root / "part"), train_dataset=docs()).train()
    return root / "part", {k: v.clone() for k, v in full.state_dict().items()}


class Stop(Exception):
    pass


class StopAtFive(Trainer):
    """Stops during step 5 (checkpoints 2 and 4 are written), as a killed run would."""

    def log(self, logs):
        super().log(logs)
        if self.state.global_step == 5 and "loss" in logs:
            raise Stop()


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def garbage(path):
    path.write_bytes(os.urandom(300))


def set_json(**changes):
    def change(path):
        state = json.loads(path.read_text())
        state.update(changes)
        path.write_text(json.dumps(state))

    return change


CASES = {
    "optimizer-truncated": ("optimizer.pt", truncate),
    "optimizer-flipped-byte": ("optimizer.pt", flip),
    "optimizer-garbage": ("optimizer.pt", garbage),
    "optimizer-payload": ("optimizer.pt", "payload"),
    "optimizer-foreign": ("optimizer.pt", lambda p: torch.save({"state": {}, "param_groups": [{"params": [0]}]}, p)),
    "optimizer-wrong-shape": ("optimizer.pt", "wrong-shape"),
    "optimizer-nan-lr": ("optimizer.pt", "nan-lr"),
    "optimizer-nan-moment": ("optimizer.pt", "nan-moment"),
    "scheduler-truncated": ("scheduler.pt", truncate),
    "scheduler-foreign-values": (
        "scheduler.pt",
        lambda p: torch.save({"base_lrs": ["x"], "last_epoch": 3, "lr_lambdas": [None]}, p),
    ),
    "scheduler-negative-epoch": ("scheduler.pt", lambda p: torch.save({**torch.load(p), "last_epoch": -7}, p)),
    "scheduler-payload": ("scheduler.pt", "payload"),
    "rng-truncated": ("rng_state.pth", truncate),
    "rng-flipped-byte": ("rng_state.pth", flip),
    "rng-payload": ("rng_state.pth", "payload"),
    "rng-foreign": ("rng_state.pth", lambda p: torch.save({"python": 5}, p)),
    "state-not-json": ("trainer_state.json", lambda p: p.write_text("{not json")),
    "state-negative-step": ("trainer_state.json", set_json(global_step=-5)),
    "state-string-epoch": ("trainer_state.json", set_json(epoch="one")),
    "state-bool-rows": ("trainer_state.json", set_json(train_rows=True)),
    "state-history": ("trainer_state.json", set_json(log_history=5)),
    "state-list": ("trainer_state.json", lambda p: p.write_text("[1, 2]")),
    "weights-truncated": ("model.safetensors", truncate),
    "weights-header": ("model.safetensors", lambda p: p.write_bytes(b"\x10" + p.read_bytes()[1:])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_newest_checkpoint(runs, tmp_path, case, caplog):
    part, reference = runs
    out = tmp_path / "run"
    shutil.copytree(part, out)
    name, damage = CASES[case]
    target = out / "checkpoint-4" / name
    marker = tmp_path / "PWNED"
    if damage == "payload":
        with open(target, "wb") as f:
            pickle.dump(Payload(marker), f)
    elif damage in ("wrong-shape", "nan-lr", "nan-moment"):
        state = torch.load(target)
        first = next(iter(state["state"].values()))
        if damage == "wrong-shape":
            first["exp_avg"] = first["exp_avg"].reshape(-1)[:3].clone()
        elif damage == "nan-lr":
            state["param_groups"][0]["lr"] = float("nan")
        else:
            first["exp_avg_sq"][..., 0] = float("nan")
        torch.save(state, target)
    else:
        damage(target)

    model = tiny_model(seed=9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((CorruptCheckpointError, FileNotFoundError)) as err:
        Trainer(model=model, args=args(out), train_dataset=docs()).train(
            resume_from_checkpoint=str(out / "checkpoint-4")
        )
    text = str(err.value)
    assert name in text and "resume from another checkpoint-N folder, or start without resuming" in text, text
    assert "Traceback" not in text and text.count("\n") == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the refusal lost nothing

    caplog.clear()
    resumed = tiny_model(seed=9)
    out_ = Trainer(model=resumed, args=args(out), train_dataset=docs()).train(resume_from_checkpoint=True)
    assert "checkpoint-4 cannot be resumed from" in caplog.text and name in caplog.text
    assert "resuming from" in caplog.text and "checkpoint-2" in caplog.text
    assert out_.global_step == 6
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, reference[k]), k
    assert not marker.exists()


def test_no_good_checkpoint_left(runs, tmp_path):
    part, _ = runs
    out = tmp_path / "run"
    shutil.copytree(part, out)
    for step in (2, 4):
        truncate(out / f"checkpoint-{step}" / "optimizer.pt")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"No checkpoint in .* can be resumed from: the newest, "
        r".*checkpoint-4, fails with: .*optimizer.pt is damaged",
    ):
        Trainer(model=tiny_model(), args=args(out), train_dataset=docs()).train(resume_from_checkpoint=True)


def test_missing_weights_and_state_file(runs, tmp_path):
    part, _ = runs
    out = tmp_path / "run"
    shutil.copytree(part, out)
    os.remove(out / "checkpoint-4" / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match=r"checkpoint-4 has no model.safetensors"):
        Trainer(model=tiny_model(), args=args(out), train_dataset=docs()).train(
            resume_from_checkpoint=str(out / "checkpoint-4")
        )
    os.remove(out / "checkpoint-2" / "scheduler.pt")
    with pytest.raises(
        FileNotFoundError, match=r"checkpoint-2/scheduler.pt is missing, so the checkpoint is incomplete"
    ):
        Trainer(model=tiny_model(), args=args(out), train_dataset=docs()).train(
            resume_from_checkpoint=str(out / "checkpoint-2")
        )
