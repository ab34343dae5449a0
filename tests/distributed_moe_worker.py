"""A torchrun worker for tests/test_distributed_moe.py: expert parallelism on a tiny Qwen3-MoE, one 4-rank launch.

Usage: torchrun --nproc_per_node=4 tests/distributed_moe_worker.py CHECKPOINT OUT_DIR

The checkpoint has the load-balancing loss on (output_router_logits), so every loss below includes it.
1. fsdp4 x ep2 (efsdp 2): train STEPS steps of the shared recipe (tests/distributed_worker.py), a DCP
   checkpoint after RESUME_AT; greedy tokens through `model.generate`; a Hugging Face export.
2. fsdp4 x ep4 (efsdp 1: each expert on one rank): train; a fresh model resumes the ep2 checkpoint.
3. tp2 x fsdp2 x ep2 (the EP group is the TP group: the batch split over TP before the exchange), and
   the same with ep_implementation="all_reduce": train.
4. The Trainer at fsdp4 x ep2 with its decoder blocks compiled (aot_eager).
Each rank writes OUT_DIR/rank{r}.json; the test compares them with one process.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch

import distributed_trainer_worker as T
import distributed_worker as W
from staticformers import AutoModelForCausalLM, DistributedConfig, Trainer
from staticformers.distributed import mesh as dmesh
from staticformers.distributed.dcp_checkpoint import load_checkpoint, save_checkpoint


def load(path, **sizes):
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(**sizes)
    )


def expert_shard_rows(model) -> list:
    """The experts this rank holds of layer 0 (its shard's rows of the stacked experts), as [first, count]."""
    from torch.distributed.tensor import DTensor

    p = model.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(p, DTensor), type(p)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return [int(offset[0]), int(shape[0])]


def main(path: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    result: dict = {}

    # 1. fsdp4 x ep2
    model = load(path, fsdp_size=4, ep_size=2)
    result["ep2_rows"] = expert_shard_rows(model)
    opt = W.make_optimizer(model)
    losses = W.train_steps(model, opt, range(W.RESUME_AT))
    save_checkpoint(os.path.join(out, "dcp"), model, opt, extra={"step": W.RESUME_AT})
    losses += W.train_steps(model, opt, range(W.RESUME_AT, W.STEPS))
    result["fsdp4_ep2"] = {"losses": losses}
    model.eval()
    with torch.no_grad():
        result["ep2_trained_logits"] = model(input_ids=torch.tensor([W.PROBE])).logits[0].tolist()
    result["ep2_generate"] = W.generate(model)
    model.save_pretrained(os.path.join(out, "hf"))
    del model, opt
    gc.collect()

    # 2. fsdp4 x ep4: train; resume the ep2 checkpoint
    model = load(path, fsdp_size=4, ep_size=4)
    result["ep4_rows"] = expert_shard_rows(model)
    opt = W.make_optimizer(model)
    result["fsdp4_ep4"] = {"losses": W.train_steps(model, opt, range(W.STEPS))}
    del model, opt
    gc.collect()
    model = load(path, fsdp_size=4, ep_size=4)
    opt = W.make_optimizer(model)
    extra = load_checkpoint(os.path.join(out, "dcp"), model, opt)
    result["resumed_ep4"] = {"losses": W.train_steps(model, opt, range(extra["step"], W.STEPS))}
    del model, opt
    gc.collect()

    # 3. tp2 x fsdp2 x ep2, both exchanges
    for name, implementation in (("tp2_fsdp2_ep2", "auto"), ("tp2_fsdp2_ep2_all_reduce", "all_reduce")):
        model = load(path, tp_size=2, fsdp_size=2, ep_size=2, ep_implementation=implementation)
        opt = W.make_optimizer(model)
        result[name] = {"losses": W.train_steps(model, opt, range(W.STEPS))}
        del model, opt
        gc.collect()

    # 4. the Trainer, decoder blocks compiled
    model = load(path, fsdp_size=4, ep_size=2)
    trainer = Trainer(
        model=model,
        args=T.args_for(
            os.path.join(out, "trainer"),
            T.GLOBAL_BATCH // 4,
            torch_compile=True,
            torch_compile_backend="aot_eager",
            save_strategy="no",
        ),
        train_dataset=T.docs(model.config.vocab_size),
    )
    trainer.train()
    result["trainer_ep2"] = T.history(trainer)
    del trainer, model
    gc.collect()

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dmesh.shutdown()


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
