"""A torchrun worker for tests/test_distributed_gemma.py: Gemma 2 and Gemma 3 at tp2 (2 ranks).

Usage: torchrun --nproc_per_node=2 tests/distributed_gemma_worker.py OUT_DIR CHECKPOINT...

For each checkpoint: the logits of a prompt longer than the windows, `model.generate`'s greedy tokens, and
the losses of two AdamW steps, at tp_size=2. Each rank writes OUT_DIR/rank{r}.json; the test compares them
with one process.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch

from staticformers import AutoModelForCausalLM, DistributedConfig
from staticformers.distributed import mesh as dmesh

PROMPT = [[3, 17, 42, 9, 77, 5, 11, 90, 23, 64, 8, 31]]
NEW_TOKENS = 8
STEPS = 2


def rows(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + step))


def run(model) -> dict:
    """What the test compares: logits, greedy tokens, training losses (the same recipe in one process)."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits[0].tolist()
    out = model.generate(
        torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, disable_compile=True, eos_token_id=None
    )
    tokens = out[0, len(PROMPT[0]) :].tolist()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=rows(step), labels=rows(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    del opt
    return {"logits": logits, "tokens": tokens, "losses": losses}


def main(out: str, *paths: str) -> None:
    rank = int(os.environ["RANK"])
    result = {}
    for path in paths:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2)
        )
        weight = model.model.layers[0].self_attn.q_proj.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        result[path] = {**run(model), "q_proj_rows": local.shape[0]}
        del model
        gc.collect()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dmesh.shutdown()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
