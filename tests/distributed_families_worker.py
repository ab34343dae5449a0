"""A torchrun worker for tests/test_distributed_families.py: Phi-3 and GLM-4 at tensor parallel 2.

Usage: torchrun --nproc_per_node=2 tests/distributed_families_worker.py PHI3_CHECKPOINT GLM4_CHECKPOINT OUT_DIR

Phi-3's checkpoint stores q, k and v in one `qkv_proj` (and gate/up in one `gate_up_proj`): each rank reads its
heads of each part from the fused tensor. Per family: the prompt's last logits, `model.generate`'s greedy tokens,
one training step's loss (Phi-3 with a LoRA adapter under PEFT's fused names), and a `save_pretrained` of the
partitioned model. Each rank writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch

from staticformers import AutoModelForCausalLM, DistributedConfig, LoraConfig
from staticformers.distributed import mesh as dmesh
from staticformers.distributed.training_support import reduce_mean

PROMPT = [[3, 17, 42, 9, 77, 5]]
NEW_TOKENS = 8
TRAIN = torch.arange(2, 34).view(2, 16) % 128


def run(path: str, out: str, name: str, lora: bool) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_size=2))
    result = {}
    with torch.no_grad():
        result["logits"] = model(input_ids=torch.tensor(PROMPT)).logits[0, -1].tolist()
    ids = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, disable_compile=True)
    result["generate"] = ids[0, len(PROMPT[0]):].tolist()
    model.save_pretrained(os.path.join(out, name))
    if lora:
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"],
                                     init_lora_weights=False))
    model.train()
    loss = model(input_ids=TRAIN, labels=TRAIN).loss
    loss.backward()
    result["loss"] = float(reduce_mean(loss.detach(), model))
    del model
    gc.collect()
    return result


def main(phi3: str, glm4: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    result = {"phi3": run(phi3, out, "phi3_saved", lora=True), "glm4": run(glm4, out, "glm4_saved", lora=False)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dmesh.shutdown()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:4])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
