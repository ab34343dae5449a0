"""A torchrun worker for tests/test_distributed_quantization.py: weight-only int8 under tensor parallel.

Usage: torchrun --nproc_per_node=2 tests/distributed_quant_worker.py CHECKPOINT INT8_CHECKPOINT OUT_DIR

At tp_size=2 on gloo, two loads in one launch (one launch costs most of the test's time):
1. CHECKPOINT (fp32) quantised to int8 as it loads (`quantization_config` with `distributed_config`);
2. INT8_CHECKPOINT, a `pack-quantized` int8 checkpoint saved by one process, loaded as stored.
For each: the prompt's logits, greedy tokens by full forward passes and by `model.generate` (the engine, whose
CPU int8 kernel must leave a tensor-parallel layer to its own hooks), and the placements and local shapes of
a colwise (q_proj) and a rowwise (o_proj) projection's int8 weight and scales. Then FSDP over the int8
checkpoint, which is refused (the sentence is recorded). Each rank writes
OUT_DIR/rank{r}.json; the test compares them with the same int8 model in one process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from staticformers import AutoModelForCausalLM, DistributedConfig, QuantizationConfig
from staticformers.distributed import mesh as dmesh

PROMPT = [[3, 17, 42, 9, 77, 5]]
NEW_TOKENS = 8


def greedy(model, prompt, n) -> list[int]:
    """Greedy continuation by full forward passes (no cache)."""
    ids = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt[0]) :].tolist()


def shards(model) -> dict:
    """{parameter: [placements, local shape, dtype]} of layer 0's q_proj and o_proj."""
    attn = model.model.layers[0].self_attn
    out = {}
    for name, layer in (("q_proj", attn.q_proj), ("o_proj", attn.o_proj)):
        for pname in ("weight", "weight_scale"):
            p = getattr(layer, pname)
            out[f"{name}.{pname}"] = [
                [str(pl) for pl in getattr(p, "placements", ())],
                list(p.to_local().shape),
                str(p.dtype),
            ]
    return out


def run(model) -> dict:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits[0].tolist()
    generated = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, disable_compile=True)
    return {
        "logits": logits,
        "greedy": greedy(model, PROMPT, NEW_TOKENS),
        "shards": shards(model),
        "generate": generated[0, len(PROMPT[0]) :].tolist(),
    }


def main(path: str, int8_path: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    tp2 = DistributedConfig(tp_size=2)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=tp2, quantization_config=QuantizationConfig("int8_weight_only")
    )
    result = {"quantized_at_load": run(model)}
    del model
    model = AutoModelForCausalLM.from_pretrained(int8_path, dtype=torch.float32, distributed_config=tp2)
    result["saved_int8"] = run(model)
    try:  # FSDP over a quantized model: refused
        AutoModelForCausalLM.from_pretrained(
            int8_path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=2)
        )
        result["fsdp_refused"] = None
    except ValueError as err:
        result["fsdp_refused"] = str(err)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del model
    dmesh.shutdown()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:4])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
