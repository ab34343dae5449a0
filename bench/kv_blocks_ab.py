"""A/B of the KV cache's two kinds on the reference model: static rows against a pool of blocks, decode and TTFT.

Block caches (`GenerationLoop(kv_blocks=N)`) write each step's keys and values through a block table and gather
every row's blocks before attention: the same graphs, one gather more per layer. This measures what that costs,
in fresh processes alternating the kinds (A = static, B = blocks, and with `--control` A again as a2, the spread a
b/a must be read against), each process driving the generation loop itself: `batch` requests of a
`--prompt`-token prompt, time to first token (every row's first token) and the decode step ((a `--new`-token
run - a 1-token run) / (new - 1)), medians over repeats inside a process, then over processes. The pool holds
every row's positions (no preemption), so the figures are the table's and the gather's cost alone. The ceiling
is `bench/ab.py`'s GEMV over the weights' bytes, measured in the same run. Prints one JSON object.

    python bench/kv_blocks_ab.py --rounds 6 --control --dtypes float32 bfloat16 --batches 1 8 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ab import gemv_ms, parameter_count, run_child, summarise  # noqa: E402

CHILD = r"""
import json, statistics, sys, time, torch
from staticformers import AutoModelForCausalLM
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
ref, dtype, batch, repeats, prompt, new, blocks = sys.argv[1:8]
dtype, batch, repeats, prompt, new, blocks = getattr(torch, dtype), int(batch), int(repeats), int(prompt), int(new), int(blocks)
torch.manual_seed(1)
ids = torch.randint(1, 32000, (batch, prompt)).tolist()
model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype)
engine = engine_for(model)
plan = engine.plan.with_extend_widths((max(prompt, 16), 1))  # chunks no wider than the prompt: one prefill
loop = GenerationLoop(engine, compile_settings(model, GenerationConfig()), plan=plan, chunked_prefill=True,
                      kv_blocks=blocks or None, kv_block_size=32)
def run(n):
    t = time.perf_counter()
    for row in ids:
        loop.add(GenerationRequest(row, n))
    first, events = None, 0
    while not loop.idle:
        events += len(loop.step())
        if first is None and events >= batch:
            first = time.perf_counter() - t
    assert events == batch * n
    return first, time.perf_counter() - t
start = time.perf_counter()
run(new); run(1); run(new); run(1)
warm = time.perf_counter() - start
ttft, total = [], []
for _ in range(repeats):
    ttft.append(run(1)[1])
    total.append(run(new)[1])
t1, tn = statistics.median(ttft), statistics.median(total)
print(json.dumps({"ttft_ms": t1 * 1e3, "step_ms": (tn - t1) / (new - 1) * 1e3, "warm_s": warm,
                  "kind": "blocks" if blocks else "static", "preemptions": loop.preemptions}))
"""


def main() -> None:
    from reference import SIZES, build_reference, emit, pool_blocks, pressure, reference_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="A B (A) processes per case")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--control", action="store_true", help="static again after each blocks process (side a2)")
    p.add_argument("--size", default="41m", choices=sorted(SIZES), help="the reference model (reference.py)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    ref = build_reference(reference_dir(args.size), size=args.size)
    rows = parameter_count(ref) // 512
    tree = os.path.dirname(HERE)
    result = {
        "size": args.size,
        "prompt": args.prompt,
        "new": args.new,
        "pressure_before": pressure(),
        "ceiling_gemv_ms": {d: gemv_ms(d, rows) for d in args.dtypes},
        "cases": [],
    }
    for dtype in args.dtypes:
        for batch in args.batches:
            blocks = pool_blocks(batch, args.prompt, args.new)
            sides = ("a", "b", "a2") if args.control else ("a", "b")
            runs: dict = {side: [] for side in sides}
            for _ in range(args.rounds):
                for side in sides:
                    runs[side].append(
                        run_child(
                            tree,
                            CHILD,
                            [ref, dtype, batch, args.repeats, args.prompt, args.new, blocks if side == "b" else 0],
                        )
                    )
            case = {
                "dtype": dtype,
                "batch": batch,
                "kv_blocks": blocks,
                "pressure_after": pressure(),
                **summarise(runs),
            }
            for side, rs in runs.items():
                case[side]["preemptions"] = sum(r["preemptions"] for r in rs)
            if batch == 1:
                ceiling = result["ceiling_gemv_ms"][dtype]["ceiling"]
                case["step_vs_gemv_ceiling"] = {s: round(ceiling / case[s]["step_ms"], 3) for s in sides}
            result["cases"].append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
    result["ceiling_gemv_ms_after"] = {d: gemv_ms(d, rows) for d in args.dtypes}
    result["pressure_after"] = pressure()
    emit(result, args.out)


if __name__ == "__main__":
    main()
