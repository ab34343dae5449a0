"""A torchrun worker for tests/test_distributed_families.py: the newer families partitioned over 2 ranks.

Usage: torchrun --nproc_per_node=2 tests/distributed_families_worker.py SPEC_JSON OUT_DIR

SPEC_JSON lists the runs: `{"name", "path", "distributed": DistributedConfig's arguments, "lora": target
module names or null, "grads": parameters whose whole gradient to report, "local": parameters whose local shard's
shape to report, "states": a linear-attention layer whose cached states' shape (one row) to report, or null,
"dcp": whether to save a DCP checkpoint of the loaded model too}`. Among them: Phi-3 at tensor parallel 2 (its checkpoint stores q, k and v in one
`qkv_proj` and gate/up in one `gate_up_proj`: each rank reads its heads of each part from the fused
tensor), GLM-4, Granite and SmolLM3 at tensor parallel 2, gpt-oss at tensor parallel 2 (its attention sinks
split over the heads) and at expert parallel 2 with FSDP (its expert biases split with the experts), Qwen3.5 and
Qwen3-Next at tensor parallel 2 (their Gated DeltaNet layers split over their key heads). Per
run: the prompt's last logits, `model.generate`'s greedy tokens (and the shapes this rank holds), one training
step's loss (with a LoRA adapter where the spec names targets) and the named gradients, and a `save_pretrained` of the
partitioned model. Each rank writes
OUT_DIR/rank{r}.json.
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
from staticformers.distributed.dcp_checkpoint import save_checkpoint
from staticformers.distributed.training_support import reduce_mean

PROMPT = [[3, 17, 42, 9, 77, 5]]
NEW_TOKENS = 8
TRAIN = torch.arange(2, 34).view(2, 16) % 128


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def cached_states(model, layer) -> list | None:
    """The shapes of one row's conv and recurrent states of linear-attention layer `layer` in the cache `generate`
    used (None: no layer asked)."""
    if layer is None:
        return None
    from staticformers.generation.engines import engine_for

    cache = next(iter(engine_for(model).caches.values()))
    return [list(cache.keys[layer].shape[1:]), list(cache.values[layer].shape[1:])]


def run(spec: dict, out: str) -> dict:
    model = AutoModelForCausalLM.from_pretrained(
        spec["path"], dtype=torch.float32, distributed_config=DistributedConfig(**spec["distributed"])
    )
    result = {}
    with torch.no_grad():
        result["logits"] = model(input_ids=torch.tensor(PROMPT)).logits[0, -1].tolist()
    ids = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, disable_compile=True)
    result["generate"] = ids[0, len(PROMPT[0]) :].tolist()
    params = dict(model.named_parameters())
    result["local"] = {name: list(_local(params[name]).shape) for name in spec.get("local", [])}
    result["states"] = cached_states(model, spec.get("states"))
    model.save_pretrained(os.path.join(out, spec["name"] + "_saved"))
    if spec.get("dcp"):  # a sharded checkpoint of the model as loaded (the test resumes it in one process)
        save_checkpoint(os.path.join(out, spec["name"] + "_dcp"), model)
    if spec.get("lora"):
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=spec["lora"], init_lora_weights=False))
    model.train()
    loss = model(input_ids=TRAIN, labels=TRAIN).loss
    loss.backward()
    result["loss"] = float(reduce_mean(loss.detach(), model))
    params = dict(model.named_parameters())
    result["grads"] = {name: _full(params[name].grad).tolist() for name in spec.get("grads", [])}
    del model
    gc.collect()
    return result


def main(spec_file: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    with open(spec_file) as f:
        specs = json.load(f)
    result = {spec["name"]: run(spec, out) for spec in specs}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dmesh.shutdown()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:3])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
