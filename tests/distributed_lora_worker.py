"""A torchrun worker for tests/test_distributed_lora.py: LoRA fine-tuning of a model partitioned tp2 x fsdp2.

Usage: torchrun --nproc_per_node=4 tests/distributed_lora_worker.py CHECKPOINT OUT_DIR

Every rank seeds the same RNG and adds the same adapter (rank 0's weights are broadcast anyway) to the
partitioned model; the Trainer trains it MAX_STEPS with a checkpoint at SAVE_STEPS (the adapter alone),
`save_model` gathers the adapter (PEFT's files on rank 0), and a second run resumes the checkpoint in the
same layout. Rank 0 writes OUT_DIR/lora.json (losses, gradient norms, the resumed losses, which
parameters train and how they are placed).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch

from staticformers import AutoModelForCausalLM, DistributedConfig, LoraConfig, Trainer
from staticformers.distributed import mesh as dmesh
from distributed_trainer_worker import GLOBAL_BATCH, SAVE_STEPS, args_for, docs, history

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=ALL7, init_lora_weights=False)


def add_adapter(model) -> None:
    torch.manual_seed(0)
    model.add_adapter(lora_config())


def placements(model) -> dict:
    """name -> DTensor placements of the first layer's adapter weights (how tp and fsdp split them)."""
    out = {}
    for n, p in model.named_parameters():
        if n.startswith("model.layers.0.") and "lora_" in n:
            out[n] = [str(x) for x in p.placements]
    return out


def main(path: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    layout = DistributedConfig(tp_size=2, fsdp_size=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=layout)
    add_adapter(model)
    result = {
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "placements": placements(model),
    }
    data = docs(model.config.vocab_size)
    trainer = Trainer(model=model, args=args_for(os.path.join(out, "run"), GLOBAL_BATCH // 2), train_dataset=data)
    trainer.train()
    result["run"] = history(trainer)
    result["checkpoint_files"] = sorted(os.listdir(os.path.join(out, "run", f"checkpoint-{SAVE_STEPS}")))
    # every adapter weight gathered by DTensor itself: what save_model must write, bit for bit
    gathered = {
        f"base_model.model.{n}".replace(".default", ""): p.full_tensor().detach().clone()
        for n, p in model.named_parameters()
        if "lora_" in n
    }
    if rank == 0:
        from safetensors.torch import save_file

        save_file(gathered, os.path.join(out, "gathered.safetensors"))
    trainer.save_model(os.path.join(out, "final"))
    del trainer, model
    gc.collect()

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=layout)
    add_adapter(model)
    trainer = Trainer(model=model, args=args_for(os.path.join(out, "resumed"), GLOBAL_BATCH // 2), train_dataset=data)
    trainer.train(resume_from_checkpoint=os.path.join(out, "run", f"checkpoint-{SAVE_STEPS}"))
    result["resumed"] = history(trainer)
    del trainer, model
    if rank == 0:
        with open(os.path.join(out, "lora.json"), "w") as f:
            json.dump(result, f)
    dmesh.shutdown()


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
