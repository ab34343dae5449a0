"""A torchrun worker for tests/test_distributed.py: several layouts checked in one 4-rank launch.

Usage: torchrun --nproc_per_node=4 tests/distributed_worker.py QWEN3_CHECKPOINT LLAMA_CHECKPOINT QWEN2_CHECKPOINT OUT_DIR

One launch costs ~8 s of startup on the shared 2-core CPU, so one launch runs every layout in turn
(each `from_pretrained` builds its own mesh over the same 4 ranks):
1. tp2 x fsdp2: train STEPS steps, saving a DCP checkpoint after RESUME_AT; export a HF checkpoint.
2. tp4 and tp2 x fsdp2 on a Llama: greedy tokens by the model's forward and by `model.generate`;
   a Qwen2 (q/k/v biases) at tp4: logits.
3. tp4: train.
4. fsdp4: train; then a fresh model resumes the tp2 x fsdp2 checkpoint and trains the remaining steps.
5. HSDP (dp_replicate 2 x fsdp 2), FSDP2 CPU offload, FSDP2 bf16 mixed precision: train.
Each rank writes OUT_DIR/rank{r}.json; the test compares them with one process.
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
from staticformers.distributed.dcp_checkpoint import load_checkpoint, save_checkpoint
from staticformers.distributed.training_support import clip_grad_norm_, data_parallel_info, reduce_mean

STEPS, RESUME_AT, BATCH, SEQ, LR, MAX_NORM = 5, 3, 4, 16, 1e-2, 0.5
PROMPT = [[3, 17, 42, 9, 77, 5]]
NEW_TOKENS = 8
PROBE = list(range(1, 17))


def batch(step: int, vocab: int) -> torch.Tensor:
    """The same global batch for a step in every run (single process or any layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)


def train_steps(model, optimizer, steps, clip=clip_grad_norm_) -> list[float]:
    """Steps `steps` (indices) of the shared recipe on this rank's data shard; returns global mean losses."""
    rank, size = data_parallel_info(model)
    losses = []
    model.train()
    for step in steps:
        ids = batch(step, model.config.vocab_size)
        rows = ids.chunk(size)[rank]
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        clip(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(reduce_mean(loss, model)))
    return losses


def greedy(model, prompt, n) -> list[int]:
    """Greedy continuation by full forward passes (no cache): the oracle any engine must match."""
    ids = torch.tensor(prompt)
    model.eval()
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt[0]) :].tolist()


def local_bytes(model, optimizer) -> dict:
    from torch.distributed.tensor import DTensor

    def size(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = {id(p): p for p in model.parameters()}.values()
    optim = sum(size(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"param_bytes": sum(size(p) for p in params), "optim_bytes": optim}


def generate(model):
    """`model.generate` greedy tokens (eager: an inductor compile costs ~60 s here), or why it failed."""
    try:
        out_ids = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, disable_compile=True)
    except Exception as err:  # reported to the test, which shows it
        return f"{type(err).__name__}: {err}"
    return out_ids[0, len(PROMPT[0]) :].tolist()


def load(path, **sizes):
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(**sizes)
    )
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, f"untied at {sizes}"
    return model


def main(path: str, gen_path: str, bias_path: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    result: dict = {}
    # 1. tp2 x fsdp2: train, checkpoint mid-way, export HF
    model = load(path, tp_size=2, fsdp_size=2)
    opt = make_optimizer(model)
    losses = train_steps(model, opt, range(RESUME_AT))
    save_checkpoint(os.path.join(out, "dcp"), model, opt, extra={"step": RESUME_AT})
    losses += train_steps(model, opt, range(RESUME_AT, STEPS))
    result["tp2_fsdp2"] = {"losses": losses, **local_bytes(model, opt)}
    model.eval()
    with torch.no_grad():
        result["tp2_fsdp2_trained_logits"] = model(input_ids=torch.tensor([PROBE])).logits[0].tolist()
    model.save_pretrained(os.path.join(out, "hf"))
    del model, opt
    gc.collect()

    # 2. tp4 (and tp2 x fsdp2) inference on an untied Llama, whose greedy tokens vary (tied tiny models repeat)
    for layout, sizes in (("tp4", {"tp_size": 4}), ("tp2_fsdp2", {"tp_size": 2, "fsdp_size": 2})):
        model = load(gen_path, **sizes)
        result[f"{layout}_greedy"] = greedy(model, PROMPT, NEW_TOKENS)
        with torch.no_grad():
            result[f"{layout}_logits"] = model(input_ids=torch.tensor(PROMPT)).logits[0, -1].tolist()
        result[f"{layout}_generate"] = generate(model)
        del model
        gc.collect()

    # Qwen2 (q/k/v biases, split with their columns) at tp4: the prompt's logits
    model = load(bias_path, tp_size=4)
    with torch.no_grad():
        result["qwen2_tp4_logits"] = model(input_ids=torch.tensor(PROMPT)).logits[0, -1].tolist()
    del model
    gc.collect()

    # 3. tp4: train the Qwen3 model
    model = load(path, tp_size=4)
    opt = make_optimizer(model)
    result["tp4"] = {"losses": train_steps(model, opt, range(STEPS)), **local_bytes(model, opt)}
    del model, opt
    gc.collect()

    # 4. fsdp4: train; resume the tp2 x fsdp2 checkpoint
    model = load(path, fsdp_size=4)
    opt = make_optimizer(model)
    result["fsdp4"] = {"losses": train_steps(model, opt, range(STEPS)), **local_bytes(model, opt)}
    del model, opt
    gc.collect()
    model = load(path, fsdp_size=4)
    opt = make_optimizer(model)
    extra = load_checkpoint(os.path.join(out, "dcp"), model, opt)
    result["resumed_fsdp4"] = {"losses": train_steps(model, opt, range(extra["step"], STEPS))}
    del model, opt

    gc.collect()

    # 5. HSDP, FSDP2 CPU offload, FSDP2 mixed precision (bf16 compute over fp32 shards)
    for name, sizes, steps in (
        ("hsdp2x2", {"dp_replicate_size": 2, "fsdp_size": 2}, STEPS),
        ("fsdp4_offload", {"fsdp_size": 4, "fsdp_cpu_offload": True}, 2),
        ("tp2_fsdp2_bf16", {"tp_size": 2, "fsdp_size": 2, "fsdp_mixed_precision": True}, 2),
    ):
        model = load(path, **sizes)
        opt = make_optimizer(model)
        result[name] = {
            "losses": train_steps(model, opt, range(steps)),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        }
        del model, opt
        gc.collect()

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dmesh.shutdown()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:5])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
