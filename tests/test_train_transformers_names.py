"""transformers' everyday TrainingArguments names: each one is applied, or refused with one sentence saying why."""

import json
from types import SimpleNamespace

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from staticformers.training import trainer as trainer_module
from staticformers.training.transformers_names import apply_tf32

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def tiny_model():
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
    return AutoModelForCausalLM.from_config(cfg, seed=0)


def docs(n=32):
    return [{"input_ids": [(s + i) % (VOCAB - 1) + 1 for i in range(6 + s % 9)], "source": f"doc{s}"} for s in range(n)]


def args_for(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        max_length=16,
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
    )
    return TrainingArguments(**{**base, **kw})


def train(tmp_path, **kw):
    trainer = Trainer(model=tiny_model(), args=args_for(tmp_path, **kw), train_dataset=docs())
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(fp16=True), "bf16=True"),
        (dict(fp16_full_eval=True), "bf16=True"),
        (dict(optim="adafactor"), "optimizers=(optimizer, scheduler)"),
        (dict(optim="sgd"), "AdamW"),
        (dict(optim_args="foo=1"), "adam_beta1"),
        (dict(tf32=True), "CUDA matmul mode"),
        (dict(dataloader_num_workers=4), "no DataLoader"),
        (dict(dataloader_persistent_workers=True), "no data-loading workers"),
        (dict(dataloader_prefetch_factor=2), "no data-loading workers"),
        (dict(remove_unused_columns=False), "no data_collator"),
        (dict(label_names=["target"]), "rename the column to labels"),
        (dict(push_to_hub=True), "upload_folder"),
        (dict(auto_find_batch_size=True), "part of every compiled shape"),
        (dict(load_best_model_at_end=True), "trainer_state.json"),
        (dict(metric_for_best_model="eval_loss"), "trainer_state.json"),
        (dict(save_strategy="best"), "trainer_state.json"),
        (dict(label_smoothing_factor=0.1), "plain token cross-entropy"),
        (dict(ddp_find_unused_parameters=True), "DistributedDataParallel is not used"),
        (dict(ddp_bucket_cap_mb=25), "DistributedDataParallel is not used"),
        (dict(ddp_broadcast_buffers=False), "DistributedDataParallel is not used"),
        (dict(ddp_static_graph=True), "DistributedDataParallel is not used"),
        (dict(ddp_backend="nccl"), "'gloo'"),
        (dict(ddp_timeout=60), "init_process_group(timeout=...)"),
        (dict(gradient_checkpointing_kwargs={"use_reentrant": True}), "use_reentrant=False"),
        (dict(gradient_checkpointing_kwargs={"preserve_rng_state": False}), "use_reentrant=False"),
        (dict(lr_scheduler_kwargs={"power": 2.0}), "takes none"),
        (dict(lr_scheduler_type="cosine", lr_scheduler_kwargs={"min_lr": 0.0}), "takes num_cycles"),
        (dict(logging_strategy="sometimes"), "no, steps, epoch"),
        (dict(report_to="wandb"), "metrics.jsonl"),
        (dict(report_to=["tensorboard", "mlflow"]), "metrics.jsonl"),
        (dict(report_to="carrier-pigeon"), '"tensorboard"'),
        (dict(evaluation_strategy="steps", eval_strategy="epoch"), "old name"),
    ],
)
def test_refused_with_one_sentence(tmp_path, kwargs, words):
    with pytest.raises(ValueError) as err:
        TrainingArguments(output_dir=str(tmp_path), **kwargs)
    message = str(err.value)
    assert words in message and message.endswith(".") and message.count(". ") == 0, message
    assert next(iter(kwargs)) in message


def test_defaults_and_harmless_values_are_accepted(tmp_path):
    """Every name at transformers' default, or at the value that says what happens here anyway."""
    args = TrainingArguments(
        output_dir=str(tmp_path),
        fp16=False,
        tf32=False,
        optim="adamw_torch",
        dataloader_num_workers=0,
        remove_unused_columns=True,
        label_names=["labels"],
        push_to_hub=False,
        ddp_backend="gloo",
        ddp_timeout=1800,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        do_train=True,
        do_eval=False,
        local_rank=-1,
        dataloader_pin_memory=True,
    )
    assert args.do_train and args.optim == "adamw_torch"
    assert json.loads(args.to_json_string())["optim"] == "adamw_torch"


def test_hub_token_is_never_written(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), hub_token="hf_secret", hub_model_id="me/model")
    assert "hf_secret" not in args.to_json_string() and args.to_dict()["hub_token"] == "<HUB_TOKEN>"


def test_evaluation_strategy_is_the_old_name_of_eval_strategy(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), evaluation_strategy="steps", eval_steps=2)
    assert args.eval_strategy == "steps"


def test_warmup_steps_below_one_is_a_fraction_as_in_transformers_5(tmp_path):
    import transformers

    for value in (0.1, 0.25, 3):
        ours = TrainingArguments(output_dir=str(tmp_path), warmup_steps=value).get_warmup_steps(25)
        # transformers' own method on a namespace (its TrainingArguments needs accelerate to be built)
        theirs = transformers.TrainingArguments.get_warmup_steps(SimpleNamespace(warmup_steps=value), 25)
        assert ours == theirs, value


def test_lr_scheduler_kwargs_num_cycles_matches_transformers(tmp_path):
    from transformers.optimization import get_cosine_schedule_with_warmup

    trainer = train(
        tmp_path, max_steps=12, lr_scheduler_type="cosine", warmup_steps=2, lr_scheduler_kwargs={"num_cycles": 1.5}
    )
    ours = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=12, num_cycles=1.5)
    theirs = []
    for _ in range(12):
        theirs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)  # the same formula in float64
    assert min(ours[4:]) < 1e-4 < max(ours[8:])  # 1.5 cycles: down to 0 and up again


@pytest.mark.parametrize("optim, fused", [("adamw_torch_fused", True), ("adamw_torch", False)])
def test_optim_picks_the_adamw_implementation(tmp_path, optim, fused):
    trainer = train(tmp_path, max_steps=1, optim=optim)
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert bool(trainer.optimizer.defaults["fused"]) is fused


@pytest.mark.parametrize("strategy, expected", [("steps", [1, 2, 3, 4, 5, 6]), ("epoch", [3, 6]), ("no", [6])])
def test_logging_strategy(tmp_path, strategy, expected):
    # 12 documents, one padded row each: 3 batches of 4 per epoch, 6 steps = 2 epochs
    trainer = Trainer(
        model=tiny_model(),
        train_dataset=docs(12),
        args=args_for(tmp_path, max_steps=6, logging_strategy=strategy, logging_steps=1),
    )
    trainer.train()
    logged = [e["step"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    assert logged == expected  # the last step is always logged, so the run's last loss is never lost


def test_run_name_titles_the_loss_curve(tmp_path, monkeypatch):
    titles = []
    real = trainer_module.write_loss_curve
    monkeypatch.setattr(
        trainer_module,
        "write_loss_curve",
        lambda path, history, title: titles.append(title) or real(path, history, title),
    )
    train(tmp_path, max_steps=2, run_name="counting-run")
    assert titles == ["counting-run"]


def test_unused_columns_never_reach_the_model(tmp_path):
    """remove_unused_columns=True (the default) is what happens: the "source" column of docs() is not read."""
    trainer = train(tmp_path, max_steps=2, remove_unused_columns=True)
    assert set(trainer.get_train_rows().batch([0]).keys()) <= {"input_ids", "labels", "position_ids"}


def test_tf32_sets_the_cuda_flags_as_transformers_does():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        apply_tf32(torch.device("cpu"), True)
        assert torch.backends.cuda.matmul.allow_tf32 is False  # the CPU has no TF32
        apply_tf32(torch.device("cuda", 0), True)
        assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
        apply_tf32(torch.device("cuda", 0), None)  # None leaves them
        assert torch.backends.cuda.matmul.allow_tf32 is True
        apply_tf32(torch.device("cuda", 0), False)
        assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_pin_memory_pins_only_for_a_cuda_copy(tmp_path):
    class Tensor:  # records what move_batch does with a batch tensor
        def __init__(self):
            self.calls = []

        def pin_memory(self):
            self.calls.append("pin")
            return self

        def to(self, device, non_blocking=False):
            self.calls.append(("to", device.type, non_blocking))
            return self

    trainer = Trainer(model=tiny_model(), args=args_for(tmp_path), train_dataset=docs())
    t = Tensor()
    trainer.move_batch({"input_ids": t})
    assert t.calls == [("to", "cpu", True)]  # nothing to pin for on the CPU
    trainer.device = torch.device("cuda", 0)
    t = Tensor()
    trainer.move_batch({"input_ids": t})
    assert t.calls == ["pin", ("to", "cuda", True)]
    trainer.args.dataloader_pin_memory = False
    t = Tensor()
    trainer.move_batch({"input_ids": t})
    assert t.calls == [("to", "cuda", True)]


def test_gradient_checkpointing_with_transformers_kwargs(tmp_path):
    model = tiny_model()
    trainer = Trainer(
        model=model,
        train_dataset=docs(),
        args=args_for(
            tmp_path, max_steps=1, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        ),
    )
    trainer.train()
    assert model.model.gradient_checkpointing is True
