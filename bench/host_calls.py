"""Python function calls per decode step and per prefill of two source trees, counted by cProfile.

A refactor's cost on the host is the Python it adds to each step. Wall-clock A/B runs (`ab.py`) need a
quiet machine to resolve 5%; a call count does not: it is the same whatever else the machine runs. Each
tree runs in its own process (its `src/` on PYTHONPATH) on a tiny Qwen3 checkpoint built by that tree's
`tests/tiny.py`, warms every shape, then counts the calls of generates of 1, 9 and 41 new tokens:
calls per decode step = (calls(41) - calls(9)) / 32. Prints one JSON object.

    python bench/host_calls.py --a ../base --b . --batches 1 8 --backends eager inductor
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ab import run_child  # noqa: E402

CHILD = r"""
import cProfile, json, pstats, sys, torch
sys.path.insert(0, sys.argv[2])
from tiny import save_tiny
from staticformers import AutoModelForCausalLM, CompileConfig
folder, batch, backend = sys.argv[1], int(sys.argv[3]), sys.argv[4]
model = AutoModelForCausalLM.from_pretrained(save_tiny("qwen3", folder))
torch.manual_seed(0)
ids = torch.randint(1, 100, (batch, 16))
config = CompileConfig(backend=backend)
def run(n):
    return model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, compile_config=config)
for n in (1, 9, 41):
    run(n)
def calls(n):
    profile = cProfile.Profile()
    profile.enable()
    run(n)
    profile.disable()
    return pstats.Stats(profile).total_calls
c1, c9, c41 = calls(1), calls(9), calls(41)
print(json.dumps({"prefill_calls": c1, "decode_step_calls": (c41 - c9) / 32}))
"""


def count(tree: str, batch: int, backend: str, work: str) -> dict:
    name = os.path.basename(os.path.abspath(tree))
    return run_child(
        tree,
        CHILD,
        [os.path.join(work, f"tiny-{name}"), os.path.join(tree, "tests"), batch, backend],
        STATICFORMERS_CACHE=os.path.join(work, "cache-" + name),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="the tree before")
    p.add_argument("--b", required=True, help="the tree after")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--backends", nargs="+", default=["eager", "inductor"])
    args = p.parse_args()
    cases = []
    with tempfile.TemporaryDirectory() as work:
        for backend in args.backends:
            for batch in args.batches:
                a, b = count(args.a, batch, backend, work), count(args.b, batch, backend, work)
                cases.append(
                    {
                        "backend": backend,
                        "batch": batch,
                        "a": a,
                        "b": b,
                        "b_over_a_decode_step": round(b["decode_step_calls"] / a["decode_step_calls"], 4),
                        "b_over_a_prefill": round(b["prefill_calls"] / a["prefill_calls"], 4),
                    }
                )
                print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"a": os.path.abspath(args.a), "b": os.path.abspath(args.b), "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
