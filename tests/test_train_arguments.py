"""TrainingArguments: transformers' names, the device and compile backend found by themselves, sentences for bad values."""

import pytest
import torch

from staticformers import TrainingArguments


def test_defaults_on_this_machine(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path))
    assert args.device == torch.device("cpu")
    assert args.torch_compile is False and args.torch_compile_backend == "inductor"
    assert args.dataloader_drop_last is True  # differs from transformers on purpose: no ragged batch
    assert args.report_to == [] and args.max_length == 1024 and args.packing is False
    assert args.per_device_train_batch_size == 8 and args.lr_scheduler_type == "linear"
    # TRL SFTConfig's defaults: full loss, except the completion only for prompt-completion data
    assert args.assistant_only_loss is False and args.completion_only_loss is None and args.chat_template_path is None


def test_the_compile_backend_variable_reaches_the_trainer(tmp_path, monkeypatch):
    """`STATICFORMERS_COMPILE_BACKEND` chooses the Trainer's default backend as it does generation's; an explicit
    `torch_compile_backend` wins."""
    monkeypatch.setenv("STATICFORMERS_COMPILE_BACKEND", "eager")
    assert TrainingArguments(output_dir=str(tmp_path)).torch_compile_backend == "eager"
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="aot_eager")
    assert args.torch_compile_backend == "aot_eager"


def test_seed_snippets_detect_neuron(fake_neuron, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True)
    assert str(args.device).startswith("neuron")
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, torch_compile=True)
    assert args.torch_compile_backend == "neuron"
    assert TrainingArguments(output_dir=str(tmp_path), use_cpu=True).device == torch.device("cpu")


def test_backend_given_turns_compile_on(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="aot_eager")
    assert args.torch_compile and args.torch_compile_backend == "aot_eager"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(per_device_train_batch_size=0), "positive integer"),
        (dict(max_length=1), "at least 2"),
        (dict(lr_scheduler_type="polynomial"), "linear, cosine"),
        (dict(warmup_steps=2, warmup_ratio=0.1), "not both"),
        (dict(lr_scheduler_type="constant", warmup_steps=3), "constant_with_warmup"),
        (dict(eval_strategy="sometimes"), "no, steps, epoch"),
        (dict(save_total_limit=0), "at least 1"),
        (dict(max_steps=0), "positive number"),
        (dict(num_train_epochs=0), "trains nothing"),
        (dict(report_to="wandb"), "tensorboard"),
        (dict(packing_strategy="ffd"), "bfd"),
        (dict(assistant_only_loss="yes"), "must be True or False"),
        (dict(completion_only_loss=1), "must be True, False or None"),
        (dict(chat_template_path="no/such/template.jinja"), "does not exist: give a .jinja file"),
        (dict(adam_beta2=1.0), "[0, 1)"),
        (dict(max_grad_norm=-1.0), "negative"),
    ],
)
def test_invalid_values_get_a_sentence(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=None) as err:
        TrainingArguments(output_dir=str(tmp_path), **kwargs)
    assert words in str(err.value)
    assert str(err.value).endswith(".")


def test_report_to_and_fractional_steps(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="all", warmup_ratio=0.1)
    assert args.report_to == ["tensorboard"]
    assert args.get_warmup_steps(25) == 3
    assert args.resolved_steps(0.25, 40) == 10 and args.resolved_steps(7, 40) == 7
    assert '"max_length": 1024' in args.to_json_string()
