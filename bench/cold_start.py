"""A/B of two source trees' start-up: process start to the first token from an empty compile cache, then warm.

Start-up is the figure a first run pays: imports, the load, every graph and kernel the first token needs compiled.
`bench/peers.py` measures it against the other engines once a run (its round 0); this measures a change to it,
alternating the trees (A B A B ...) in fresh processes, each importing its tree's `src/` (as `bench/ab.py` does).
Each round gives each side a new, empty `STATICFORMERS_CACHE` and `TORCHINDUCTOR_CACHE_DIR` (the **cold** start),
then a second process over the same folders (the **warm** start). The child times from its first line, before
`import torch`, to the end of a one-token `generate`, then a 17-token `generate` of the same prompt, whose greedy
tokens the report compares with side A's first. CPU pressure is logged around every process. Prints one JSON object.

    python bench/cold_start.py --a ../base --b . --model smollm2 --dtype bfloat16 --rounds 3 --out <report>
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CHILD = r"""
import time
t0 = time.time()
import json, sys, torch
from staticformers import AutoModelForCausalLM
ref, dtype, batch, prompt = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gguf = sys.argv[5] if len(sys.argv) > 5 else None
ids = torch.randint(1, 32000, (batch, prompt), generator=torch.Generator().manual_seed(1))
model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, **({"gguf_file": gguf} if gguf else {}))
t_loaded = time.time()
with torch.no_grad():
    model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, eos_token_id=None)
    t_first = time.time()
    out = model.generate(input_ids=ids, max_new_tokens=17, do_sample=False, eos_token_id=None)
    t_more = time.time()
print(json.dumps({
    "load_s": t_loaded - t0,
    "start_to_first_token_s": t_first - t0,
    "then_17_tokens_s": t_more - t_first,
    "tokens": out[0, prompt:].tolist(),
}))
"""


def agreeing(a: list, b: list) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list | None = None) -> dict:
    from ab import run_child
    from reference import build_reference, emit, pressure, real_model, reference_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="the tree before (its src/ is imported)")
    p.add_argument("--b", required=True, help="the tree after")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "reference"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="A B pairs of cold (then warm) processes")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.model == "smollm2":
        ref, gguf = real_model()
    else:
        ref, gguf = build_reference(reference_dir("41m")), ""
    report: dict = {
        "a": os.path.abspath(args.a),
        "b": os.path.abspath(args.b),
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt": args.prompt,
        "pressure_before": pressure(),
        "runs": {"a": [], "b": []},
    }
    child_args = [ref, args.dtype, args.batch, args.prompt] + ([gguf] if gguf else [])
    for rnd in range(args.rounds):
        for side in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
            caches = tempfile.mkdtemp(prefix=f"cold-{side}-")
            env = {"STATICFORMERS_CACHE": caches, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor")}
            try:
                record = {"round": rnd}
                for kind in ("cold", "warm"):
                    record[kind] = run_child(getattr(args, side), CHILD, child_args, **env)
                    record[f"pressure_after_{kind}"] = pressure()
            finally:
                shutil.rmtree(caches, ignore_errors=True)
            report["runs"][side].append(record)
            print(
                f"round {rnd} {side}: cold {record['cold']['start_to_first_token_s']:.1f} s, "
                f"warm {record['warm']['start_to_first_token_s']:.1f} s [{record['pressure_after_warm']}]",
                file=sys.stderr,
                flush=True,
            )
    for side, runs in report["runs"].items():
        report[side] = {
            kind: round(statistics.median(r[kind]["start_to_first_token_s"] for r in runs), 2)
            for kind in ("cold", "warm")
        }
    report["b_over_a"] = {k: round(report["b"][k] / report["a"][k], 3) for k in ("cold", "warm")}
    first = report["runs"]["a"][0]["cold"]["tokens"]
    report["leading_tokens_as_a_first"] = {  # bf16 roundings of two trees may break a near-tie differently
        side: [agreeing(first, r[kind]["tokens"]) for r in runs for kind in ("cold", "warm")]
        for side, runs in report["runs"].items()
    }
    report["pressure_after"] = pressure()
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
