"""LoRA fine-tuning on the Trainer: a tiny model learns a synthetic task with the adapter alone; the base
is bit for bit unchanged, takes no gradient and gets no optimizer state; a bf16 base is never copied;
checkpoints hold the adapter alone (PEFT's files) and resume exactly; compiled training builds a fixed set
of graphs; the CLI's --lora-* flags; refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, LoraConfig, Trainer, TrainingArguments
from staticformers.adapters.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS

pytestmark = pytest.mark.usefixtures("one_thread")

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model(seed=0, dtype=None, initializer_range=0.02):
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
        initializer_range=initializer_range,
    )
    return AutoModelForCausalLM.from_config(cfg, seed=seed, dtype=dtype)


CYCLE = [7, 19, 3, 42, 28]


def counting_docs(n=48, seed=0):
    """A synthetic task: a cycle of five ids from a random phase (the base model knows nothing of it)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": [CYCLE[(int(s) + j) % 5] for j in range(20)]} for s in torch.randint(0, 5, (n,), generator=g)]


def args_for(path, **kw):
    base = dict(
        output_dir=str(path),
        max_length=20,
        per_device_train_batch_size=8,
        max_steps=6,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=2e-2,
        seed=0,
        report_to=[],
    )
    return TrainingArguments(**{**base, **kw})


def with_adapter(model, seed=1, **kw):
    torch.manual_seed(seed)
    model.add_adapter(LoraConfig(**{**dict(r=8, lora_alpha=16, target_modules=ALL7), **kw}))
    return model


def frozen(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_the_adapter_alone_learns_and_the_base_is_untouched(tmp_path):
    # embeddings of std 0.2 (not 0.02): the tied head can then give the cycle's next id a clear margin
    model = with_adapter(tiny_model(initializer_range=0.2))
    base = frozen(model)
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    trainer = Trainer(
        model=model, args=args_for(tmp_path, max_steps=40, lr_scheduler_type="constant"), train_dataset=counting_docs()
    )
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    assert losses[-1] < 0.02 * losses[0], losses  # learned: near zero, from about ln(64) and more
    after = frozen(model)
    assert after.keys() == base.keys() and all(torch.equal(after[n], base[n]) for n in base)
    assert all(p.grad is None for p in model.parameters())
    changed = [n for n, p in model.named_parameters() if "lora_B" in n and not torch.equal(p, lora_before[n])]
    assert len(changed) == 2 * len(ALL7)
    trainable = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert trainer.master.names == [n for n, _ in model.named_parameters() if "lora_" in n]
    assert {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == trainable
    assert len(trainer.optimizer.state) == len(trainable)
    assert out.global_step == 40


def test_a_bf16_base_is_never_copied_and_the_adapter_keeps_fp32_masters(tmp_path):
    model = with_adapter(tiny_model(dtype=torch.bfloat16))
    base = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters() if "lora_" not in n}
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)  # PEFT's autocast
    trainer = Trainer(model=model, args=args_for(tmp_path, bf16=True), train_dataset=counting_docs())
    trainer.train()
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert p.dtype == torch.float32  # its master value, given back
        else:
            assert p.dtype == torch.bfloat16 and p.data_ptr() == base[n][0] and torch.equal(p, base[n][1]), n
    assert all(m.dtype == torch.float32 for m in trainer.master.master)


def test_a_float32_base_trained_in_bf16_gets_its_values_back(tmp_path):
    model = with_adapter(tiny_model())
    base = frozen(model)
    Trainer(model=model, args=args_for(tmp_path, bf16=True, max_steps=2), train_dataset=counting_docs()).train()
    after = frozen(model)
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], base[n]) for n in base)


def test_checkpoints_hold_the_adapter_alone_and_resume_exactly(tmp_path):
    def run(out, resume=None):
        model = with_adapter(tiny_model())
        trainer = Trainer(
            model=model,
            args=args_for(
                out,
                max_steps=6,
                save_strategy="steps",
                save_steps=3,
                lr_scheduler_type="cosine",
                warmup_steps=1,
                weight_decay=0.01,
            ),
            train_dataset=counting_docs(),
        )
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer

    whole, t1 = run(tmp_path / "whole")
    files = set(os.listdir(tmp_path / "whole" / "checkpoint-3"))
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= files and not any(n.startswith("model") for n in files)
    resumed, t2 = run(tmp_path / "again", resume=str(tmp_path / "whole" / "checkpoint-3"))
    for (n, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), n
    full = [h["loss"] for h in t1.state.log_history if "grad_norm" in h]
    resumed_log = [h["loss"] for h in t2.state.log_history if "grad_norm" in h]  # steps 1-3 from the checkpoint
    assert resumed_log == full
    t1.save_model(str(tmp_path / "final"))
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= set(os.listdir(tmp_path / "final"))
    again = tiny_model()
    again.load_adapter(tmp_path / "final")
    x = torch.tensor([counting_docs(1, seed=5)[0]["input_ids"]])
    with torch.no_grad():
        assert torch.equal(again(x).logits, whole(x).logits)


def test_compiled_lora_training_builds_a_fixed_set_of_graphs(tmp_path, monkeypatch):
    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")
    model = with_adapter(tiny_model())
    trainer = Trainer(
        model=model,
        args=args_for(tmp_path, torch_compile=True, torch_compile_backend="aot_eager", max_steps=4),
        train_dataset=counting_docs(),
    )
    trainer.train()
    stats = trainer.compile_stats()
    assert stats["train_graphs"] == 2  # one layer region every layer shares, the head with the loss
    eager = with_adapter(tiny_model())
    reference = Trainer(model=eager, args=args_for(tmp_path / "eager", max_steps=4), train_dataset=counting_docs())
    reference.train()
    compiled = [h["loss"] for h in trainer.state.log_history if "grad_norm" in h]
    plain = [h["loss"] for h in reference.state.log_history if "grad_norm" in h]
    assert compiled == pytest.approx(plain, rel=2e-5)


def test_frozen_or_several_trainable_adapters_are_refused(tmp_path):
    model = with_adapter(tiny_model())
    model.save_pretrained(tmp_path / "adapter")
    frozen_model = tiny_model()
    frozen_model.load_adapter(tmp_path / "adapter")  # is_trainable=False: for inference
    with pytest.raises(ValueError, match="adapters are frozen .* is_trainable=True"):
        Trainer(model=frozen_model, args=args_for(tmp_path / "x"), train_dataset=counting_docs()).train()
    trainable = tiny_model()
    trainable.load_adapter(tmp_path / "adapter", is_trainable=True)
    assert sum(p.requires_grad for p in trainable.parameters()) == 4 * len(ALL7)
    trainable.load_adapter(tmp_path / "adapter", adapter_name="other", is_trainable=True)
    with pytest.raises(ValueError, match="are all trainable: train one adapter at a time"):
        Trainer(model=trainable, args=args_for(tmp_path / "y"), train_dataset=counting_docs()).train()
    inactive = tiny_model()
    inactive.load_adapter(tmp_path / "adapter")
    inactive.load_adapter(tmp_path / "adapter", adapter_name="other", is_trainable=True)
    with pytest.raises(ValueError, match="'other' is trainable but not active.* model.set_adapter\\('other'\\)"):
        Trainer(model=inactive, args=args_for(tmp_path / "z"), train_dataset=counting_docs()).train()


def test_the_cli_trains_an_adapter(tmp_path, capsys):
    from staticformers.commands.cli import main

    folder = tmp_path / "base"
    tiny_model().save_pretrained(folder)
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in counting_docs(16)))
    out = tmp_path / "out"
    rc = main(
        [
            "train",
            str(folder),
            "--data",
            str(data),
            "--output-dir",
            str(out),
            "--max-length",
            "20",
            "--max-steps",
            "2",
            "--batch-size",
            "4",
            "--no-save",
            "--quiet",
            "--lora-r",
            "4",
            "--lora-target",
            "q_proj,v_proj,down_proj",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    per_layer = 4 * (64 + 64) + 4 * (64 + 32) + 4 * (128 + 64)  # q_proj, v_proj, down_proj: r x (in + out)
    assert summary["adapter"] == {"r": 4, "lora_alpha": 8, "trainable_parameters": 2 * per_layer}
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert not os.path.exists(out / "model.safetensors")
    assert main(["train", str(folder), "--data", str(data), "--lora-alpha", "16"]) == 2
    assert "--lora-alpha sets up a LoRA adapter, which needs its rank: add --lora-r" in capsys.readouterr().err
    assert main(["train", str(folder), "--data", str(data), "--lora-r", "0"]) == 2
    assert "r=0 must be a positive integer" in capsys.readouterr().err
