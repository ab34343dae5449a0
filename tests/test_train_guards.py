"""Training refuses what would make it silently wrong or kill the machine, each with one sentence:
non-finite or absurd hyper-parameters, wrong types, rows longer than the model's positions (API and
CLI), allocations above the machine's memory, token ids outside the vocabulary, and NaN weights at a
checkpoint (never written, never called the last good checkpoint)."""

import json
import math
import os

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from staticformers.commands.cli import main
from staticformers.backends.memory_check import InsufficientMemoryError
from staticformers.training import checkpoint_folders as ckpt
from staticformers.training.trainer import TrainingDivergedError

pytestmark = pytest.mark.usefixtures("one_thread")

NAN, INF = float("nan"), float("inf")


def tiny_model(seed=0, **overrides):
    cfg = AutoConfig.for_model(
        "qwen3",
        **{
            **dict(
                vocab_size=64,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                tie_word_embeddings=True,
                max_position_embeddings=128,
            ),
            **overrides,
        },
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
        max_steps=4,
        logging_steps=1,
        save_steps=1,
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
    )
    return TrainingArguments(**{**base, **kw})


# ---- hyper-parameters ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(learning_rate="5e-5"), r"learning_rate='5e-5' must be a number \(not a string"),
        (dict(learning_rate=1e30), r"learning_rate=1e\+30 is far above any AdamW learning rate"),
        (dict(learning_rate=NAN), r"learning_rate=nan must be a finite number"),
        (dict(learning_rate=INF), r"learning_rate=inf must be a finite number"),
        (dict(learning_rate=True), r"learning_rate=True must be a number"),
        (dict(learning_rate=-1e-3), r"learning_rate=-0.001 must be a finite number >= 0"),
        (dict(weight_decay=NAN), r"weight_decay=nan must be a finite number"),
        (dict(weight_decay=INF), r"weight_decay=inf"),
        (dict(weight_decay="0.1"), r"weight_decay='0.1' must be a number"),
        (dict(weight_decay=2000.0), r"learning_rate x weight_decay = 2: AdamW multiplies"),
        (dict(max_grad_norm=NAN), r"max_grad_norm=nan must be a finite number; pass 0 or None for no clipping"),
        (dict(max_grad_norm=INF), r"max_grad_norm=inf"),
        (dict(max_grad_norm="1.0"), r"max_grad_norm='1.0' must be a number"),
        (dict(num_train_epochs=INF, max_steps=-1), r"num_train_epochs=inf must be a finite number"),
        (dict(num_train_epochs=NAN), r"num_train_epochs=nan"),
        (dict(num_train_epochs="3"), r"num_train_epochs='3' must be a number"),
        (dict(seed=2**70), r"seed=1180591620717411303424 must be an integer from 0 to 2\*\*64 - 1"),
        (dict(seed=-1), r"seed=-1 must be an integer from 0"),
        (dict(seed="42"), r"seed='42'"),
        (dict(seed=4.0), r"seed=4.0"),
        (dict(adam_epsilon=NAN), r"adam_epsilon=nan"),
        (dict(adam_beta1=NAN), r"adam_beta1=nan"),
        (dict(warmup_ratio=NAN), r"warmup_ratio=nan"),
        (dict(warmup_steps=1.5), r"warmup_steps=1.5 must be a whole number of steps"),
        (dict(logging_steps=NAN), r"logging_steps=nan"),
        (dict(save_steps=INF), r"save_steps=inf"),
        (dict(eval_steps=NAN), r"eval_steps=nan"),
        (dict(save_total_limit=2.5), r"save_total_limit=2.5 must be an integer of at least 1"),
        (dict(per_device_train_batch_size=True), r"per_device_train_batch_size=True must be a positive integer"),
        (dict(max_length=10.5), r"max_length=10.5 must be a positive integer"),
        (dict(max_steps=2.5), r"max_steps=2.5 must be a positive number of optimizer steps"),
        (dict(bf16="false"), r"bf16='false' must be True or False"),
        (dict(packing=1), r"packing=1 must be True or False"),
        (dict(torch_compile=True, torch_compile_backend=5), r"torch_compile_backend must be a backend name"),
    ],
)
def test_hyper_parameters_are_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        args(tmp_path, **kwargs)
    assert str(err.value).endswith(".")


def test_sane_values_still_accepted(tmp_path):
    a = args(
        tmp_path,
        learning_rate=1.0,
        weight_decay=0.5,
        max_grad_norm=None,
        seed=2**64 - 1,
        num_train_epochs=2.5,
        max_steps=-1,
    )
    assert a.learning_rate == 1.0 and a.seed == 2**64 - 1


# ---- max_length and memory ---------------------------------------------------------------------
def test_max_length_above_the_positions_is_refused_by_the_trainer(tmp_path):
    model = tiny_model()
    with pytest.raises(
        ValueError,
        match=r"max_length=1024 is more than the 128 positions this model has "
        r"\(max_position_embeddings\): pass max_length=128 or less\.",
    ):
        Trainer(model=model, args=args(tmp_path, max_length=1024), train_dataset=docs())
    Trainer(model=model, args=args(tmp_path, max_length=128), train_dataset=docs())  # the limit itself is fine


def tiny_config_file(path, positions):
    cfg = dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=positions,
    )
    path.write_text(json.dumps(cfg))
    return str(path)


def test_cli_max_length_refused_above_positions_and_defaulted_below(tmp_path, capsys):
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs()))
    config = tiny_config_file(tmp_path / "config.json", positions=48)
    rc = main(
        [
            "train",
            config,
            "--data",
            str(data),
            "--output-dir",
            str(tmp_path / "o"),
            "--max-length",
            "1024",
            "--max-steps",
            "1",
            "--batch-size",
            "4",
            "--no-save",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "max_length=1024 is more than the 48 positions" in err and "Traceback" not in err
    rc = main(
        [
            "train",
            config,
            "--data",
            str(data),
            "--output-dir",
            str(tmp_path / "o"),
            "--max-steps",
            "1",
            "--batch-size",
            "4",
            "--no-save",
            "--quiet",
        ]
    )
    assert rc == 0  # no --max-length: the model's 48 positions (below the default 512)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["global_step"] == 1


def test_huge_max_length_is_refused_before_allocating(tmp_path):
    """max_length=10**9 on a model that claims 10**9 positions: the row table alone is hundreds of GB."""
    model = tiny_model(max_position_embeddings=10**9)
    trainer = Trainer(model=model, args=args(tmp_path, max_length=10**9), train_dataset=docs())
    with pytest.raises(
        InsufficientMemoryError,
        match=r"The padded training rows \(24 x max_length=1000000000\) needs at "
        r"least .* GiB but cpu has .* available: lower max_length",
    ):
        trainer.train()
    with pytest.raises(InsufficientMemoryError, match=r"packed training rows"):
        Trainer(model=model, args=args(tmp_path, max_length=10**9, packing=True), train_dataset=docs()).train()


def test_one_step_above_the_memory_is_refused(tmp_path, monkeypatch):
    """The step estimate (logits, activations, optimizer state) against what the machine has: 1 MiB here."""
    import staticformers.backends.memory_check as memory_check

    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args(tmp_path), train_dataset=docs())
    trainer.get_train_rows()
    monkeypatch.setattr(memory_check, "available_bytes", lambda device=None: 2**20)
    with pytest.raises(
        InsufficientMemoryError,
        match=r"One training step of 4 x 32 tokens .* needs at least .* but cpu "
        r"has 1.0 MiB available: lower per_device_train_batch_size",
    ):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_kv_cache_and_model_size_are_checked(monkeypatch):
    import staticformers.backends.memory_check as memory_check

    with pytest.raises(MemoryError, match=r"A model of [\d,]+ parameters needs at least .* GiB"):
        AutoModelForCausalLM.from_config(
            AutoConfig.for_model(
                "qwen3",
                vocab_size=10**9,
                hidden_size=1024,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                head_dim=16,
            )
        )
    model = tiny_model()
    monkeypatch.setattr(memory_check, "available_bytes", lambda device=None: 1024)
    with pytest.raises(
        MemoryError,
        match=r"The KV cache \(\d+ sequences x \d+ positions\) needs at least .* but cpu has "
        r"0.0 MiB available: lower max_model_len or the batch buckets",
    ):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, disable_compile=True)


# ---- token ids -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [64, 1000, -5, -100])
def test_token_ids_outside_the_vocabulary(tmp_path, bad):
    data = docs()
    data[5]["input_ids"][2] = bad
    with pytest.raises(
        ValueError,
        match=rf"The training data hold a token id {bad} \(row \d+\), outside this model's "
        rf"vocabulary of 64 ids",
    ):
        Trainer(model=tiny_model(), args=args(tmp_path), train_dataset=data).train()
    trainer = Trainer(
        model=tiny_model(),
        args=args(tmp_path, eval_strategy="steps", eval_steps=1),
        train_dataset=docs(),
        eval_dataset=data,
    )
    with pytest.raises(ValueError, match=rf"The evaluation data hold a token id {bad}"):
        trainer.evaluate()


# ---- NaN weights at a checkpoint -----------------------------------------------------------------
class PoisonAt(Trainer):
    """Sets one weight to inf right after optimizer step `at` (before that step's checkpoint)."""

    at = 2

    def log(self, logs):
        super().log(logs)
        if self.state.global_step == self.at and "loss" in logs:
            with torch.no_grad():
                self.master.master[0].view(-1)[0] = INF


def test_nonfinite_weights_are_never_checkpointed(tmp_path):
    with pytest.raises(
        TrainingDivergedError,
        match=r"Training stopped at step 2: the weights hold NaN or infinite values "
        r"\(model.embed_tokens.weight\), so no checkpoint was written for it "
        r"\(the last good checkpoint is .*checkpoint-1\)",
    ):
        PoisonAt(model=tiny_model(), args=args(tmp_path), train_dataset=docs()).train()
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == [1]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_a_nonfinite_checkpoint_is_never_called_good(tmp_path, caplog):
    """A checkpoint whose weights hold NaN (written by something else) is skipped: by the divergence message
    and by resume_from_checkpoint=True, which warns and takes the previous one."""
    from safetensors.torch import load_file, save_file

    Trainer(model=tiny_model(), args=args(tmp_path, max_steps=3), train_dataset=docs()).train()
    weights = tmp_path / "checkpoint-3" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] = NAN
    save_file(tensors, weights)

    class NanLoss(Trainer):
        def compute_loss(self, model, batch, n):
            return super().compute_loss(model, batch, n) * NAN

    with pytest.raises(TrainingDivergedError, match=r"the last good checkpoint is .*checkpoint-2\)"):
        NanLoss(model=tiny_model(), args=args(tmp_path, max_steps=5), train_dataset=docs()).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-2")
        )
    caplog.clear()
    out = Trainer(model=tiny_model(seed=3), args=args(tmp_path, max_steps=4), train_dataset=docs()).train(
        resume_from_checkpoint=True
    )
    assert (
        "checkpoint-3 cannot be resumed from (weight model.norm.weight in model.safetensors is NaN or infinite)"
        in caplog.text
    )
    assert "resuming from" in caplog.text and out.global_step == 4
    assert math.isfinite(out.training_loss)


@pytest.mark.parametrize("seed", [2**70, -1, "7", 1.5, True])
def test_seed_out_of_range_everywhere(seed):
    from staticformers.training.trainer import set_seed

    with pytest.raises(ValueError, match=r"seed=.* must be an integer from 0 to 2\*\*64 - 1\."):
        set_seed(seed)
    with pytest.raises(ValueError, match=r"seed=.* must be an integer from 0 to 2\*\*64 - 1\."):
        tiny_model().generate(torch.tensor([[1, 2]]), max_new_tokens=1, do_sample=True, seed=seed, disable_compile=True)
    with pytest.raises(ValueError, match=r"seed=.* must be an integer from 0 to 2\*\*64 - 1\."):
        AutoModelForCausalLM.from_config(tiny_model().config, seed=seed)


# ---- data that carries no loss, labels outside the vocabulary ------------------------------------
@pytest.mark.parametrize("case", ["labels all -100", "EOS alone"])
def test_data_with_no_loss_token_is_refused_before_any_step(tmp_path, case):
    """Every label -100, or rows holding a single token (EOS alone: nothing to predict after the shift):
    refused before the model is touched, where it used to log a loss of 0.0 for every step."""
    if case == "labels all -100":
        data = [{"input_ids": d["input_ids"], "labels": [-100] * len(d["input_ids"])} for d in docs()]
    else:
        data = [{"input_ids": [2]} for _ in range(24)]
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError,
        match=r"^None of the 24 rows of the training data has a token that carries loss "
        r"\(every label is -100 after the shift",
    ):
        Trainer(model=model, args=args(tmp_path), train_dataset=data).train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_batch_with_no_loss_token_is_refused_at_its_step(tmp_path):
    """Some rows carry loss, but the first batch (4 rows, no shuffling) is only rows without: that step is
    refused with the count of such rows, and the data's warning named them first."""
    data = [{"input_ids": [2, 3, 4], "labels": [-100, -100, -100]} for _ in range(4)] + docs(8)
    from staticformers.training.data import StaticBatchSampler

    class InOrder(Trainer):
        def get_train_sampler(self, rows):
            return StaticBatchSampler(rows.num_rows, 4, shuffle=False, drop_last=True)

    trainer = InOrder(model=tiny_model(), args=args(tmp_path, max_steps=2), train_dataset=data)
    with pytest.raises(
        ValueError,
        match=r"^Optimizer step 1 has no token that carries loss in its whole batch \(4 of "
        r"the 12 training rows have none",
    ):
        trainer.train()


@pytest.mark.parametrize("bad", [64, 600, -5])
def test_labels_outside_the_vocabulary_are_refused(tmp_path, bad):
    data = docs()
    data[3] = {"input_ids": data[3]["input_ids"], "labels": list(data[3]["input_ids"])}
    data[3]["labels"][1] = bad
    with pytest.raises(
        ValueError,
        match=rf"^The training data hold a label {bad} \(row \d+\), neither -100 \(no loss\) "
        rf"nor a token id of this model's vocabulary of 64 ids",
    ):
        Trainer(model=tiny_model(), args=args(tmp_path), train_dataset=data).train()
