"""A torchrun worker for tests/test_distributed_trainer.py: the Trainer on a partitioned model.

Usage: torchrun --nproc_per_node=4 tests/distributed_trainer_worker.py CHECKPOINT OUT_DIR

1. tp2 x fsdp2: train MAX_STEPS with clipping and padded rows, a checkpoint every SAVE_STEPS, then
   evaluate, save_model (one Hugging Face checkpoint).
2. fsdp4, decoder blocks compiled (aot_eager: AOTAutograd without inductor's minutes): resume the
   tp2 x fsdp2 checkpoint at SAVE_STEPS and finish.
Each rank writes OUT_DIR/trainer_rank{r}.json (the logged losses and gradient norms).
With --nproc_per_node=1 it resumes the tp2 x fsdp2 checkpoint in one process instead.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch

from staticformers import AutoModelForCausalLM, DistributedConfig, TrainingArguments
from staticformers.distributed import mesh as dmesh
from staticformers import Trainer

MAX_STEPS, SAVE_STEPS, GLOBAL_BATCH = 4, 2, 4
LEARNING_RATE = 1e-3


def docs(vocab: int, n: int = 24, seed: int = 0) -> list[dict]:
    """Documents of varied lengths: rows are padded, so token counts differ between ranks."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, vocab, (int(k),), generator=g).tolist()}
        for k in torch.randint(4, 30, (n,), generator=g)
    ]


def args_for(output_dir: str, per_device: int, **kw) -> TrainingArguments:
    base = dict(
        output_dir=output_dir,
        max_length=32,
        per_device_train_batch_size=per_device,
        max_steps=MAX_STEPS,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        disable_tqdm=True,
        learning_rate=LEARNING_RATE,
        max_grad_norm=0.5,
        seed=0,
        report_to=[],
    )
    return TrainingArguments(**{**base, **kw})


def history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return {
        "steps": [h["step"] for h in logs],
        "losses": [h["loss"] for h in logs],
        "grad_norms": [h["grad_norm"] for h in logs],
    }


def resume_in_one_process(path: str, out: str) -> None:
    """`torchrun --nproc_per_node=1`: the tp2 x fsdp2 Trainer checkpoint resumed by one process."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=DistributedConfig())
    trainer = Trainer(
        model=model, args=args_for(os.path.join(out, "one"), GLOBAL_BATCH), train_dataset=docs(model.config.vocab_size)
    )
    trainer.train(resume_from_checkpoint=os.path.join(out, "tp2_fsdp2", f"checkpoint-{SAVE_STEPS}"))
    with open(os.path.join(out, "trainer_one.json"), "w") as f:
        json.dump(history(trainer), f)
    del trainer, model
    dmesh.shutdown()


def main(path: str, out: str) -> None:
    if os.environ["WORLD_SIZE"] == "1":
        return resume_in_one_process(path, out)
    rank = int(os.environ["RANK"])
    result = {}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)
    )
    data = docs(model.config.vocab_size)
    trainer = Trainer(model=model, args=args_for(os.path.join(out, "tp2_fsdp2"), GLOBAL_BATCH // 2), train_dataset=data)
    trainer.train()
    result["tp2_fsdp2"] = history(trainer)
    result["trainer_class"] = type(trainer).__name__
    result["distributed"] = type(trainer.distributed).__name__
    result["eval_loss"] = trainer.evaluate(eval_dataset=docs(model.config.vocab_size, n=10, seed=1))["eval_loss"]
    trainer.save_model(os.path.join(out, "final"))
    del trainer, model
    gc.collect()

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=4)
    )
    trainer = Trainer(
        model=model,
        args=args_for(
            os.path.join(out, "fsdp4"), GLOBAL_BATCH // 4, torch_compile=True, torch_compile_backend="aot_eager"
        ),
        train_dataset=data,
    )
    trainer.train(resume_from_checkpoint=os.path.join(out, "tp2_fsdp2", f"checkpoint-{SAVE_STEPS}"))
    result["resumed_fsdp4"] = history(trainer)
    result["compiled_blocks"] = sum(
        hasattr(layer, "_compiled_call_impl") and layer._compiled_call_impl is not None for layer in model.model.layers
    )
    del trainer, model
    with open(os.path.join(out, f"trainer_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dmesh.shutdown()


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
