"""A/B of two source trees (or two environments) on the reference model: decode and time to first token, interleaved.

A refactor must prove it costs nothing. This runs the same measurement in fresh processes, alternating
the trees (A B A B ...), each process importing its tree's `src/` (PYTHONPATH), on the 41.6M reference
checkpoint (`reference.py`): per (dtype, batch), time to first token (`generate(max_new_tokens=1)`)
and the decode step ((128-token generate - 1-token generate) / 127), medians over repeats inside a
process, then medians over processes. The ceiling is measured in the same run on the same bytes: a
GEMV over a matrix the size of the weights (81,250 x 512 for the 41.6M model; `--size` picks another), which fits the same
cache levels as the weights do, as `torch.mv` and as a compiled reduction (the faster counts). Prints
one JSON object.

`--model smollm2` runs the suite's real model instead (SmolLM2-135M-Instruct from its GGUF,
`tests/real_model_cache.py`); `--quantization int8` loads both sides with int8 weights. `--a-env` / `--b-env
NAME=VALUE` give a side environment variables of its own, so one tree against itself measures a setting (`--b`
defaults to `--a`).

    python bench/ab.py --a ../base --b . --rounds 8 --control --dtypes float32 bfloat16 --batches 1 8
    python bench/ab.py --a . --model smollm2 --a-env STATICFORMERS_PACKED_WEIGHTS=0 --control --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PROMPT, NEW = 128, 128

CHILD = r"""
import json, statistics, sys, time, torch
from staticformers import AutoModelForCausalLM
ref, dtype, batch, repeats = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gguf = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-" else None
kwargs = {"gguf_file": gguf} if gguf else {}
if len(sys.argv) > 6 and sys.argv[6] == "int8":
    from staticformers import QuantizationConfig
    kwargs["quantization_config"] = QuantizationConfig("int8_weight_only")
torch.manual_seed(1)
ids = torch.randint(1, 32000, (batch, %d))
model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, **kwargs)
def run(n):
    t = time.perf_counter()
    out = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    assert out.shape == (batch, %d + n)
    return time.perf_counter() - t
start = time.perf_counter()
run(%d); run(1); run(%d); run(1)
warm = time.perf_counter() - start
ttft, total = [], []
for _ in range(repeats):
    ttft.append(run(1))
    total.append(run(%d))
t1, tn = statistics.median(ttft), statistics.median(total)
print(json.dumps({"ttft_ms": t1 * 1e3, "step_ms": (tn - t1) / %d * 1e3, "warm_s": warm}))
""" % (PROMPT, PROMPT, NEW, NEW, NEW, NEW - 1)


def parameter_count(folder: str) -> int:
    """The values a checkpoint's safetensors files hold (what one decode step reads at batch 1)."""
    from safetensors import safe_open

    total = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def gemv_ms(dtype_name: str, rows: int = 81_250, cols: int = 512, repeats: int = 21) -> dict:
    """Median milliseconds of reading a `rows x cols` matrix (the bytes of the weights) once as a GEMV:
    `torch.mv`, and the same product as an inductor-compiled multiply-and-sum (on some CPUs the BLAS's
    GEMV is far from the memory's speed); the ceiling is the faster of the two."""
    import torch

    from ceilings import host_matrix

    dtype = getattr(torch, dtype_name)
    w = host_matrix(rows, cols, torch.randn(rows, cols).to(dtype))  # in huge pages, as the model's weights are
    x = torch.randn(cols).to(dtype)
    reduce = torch.compile(lambda w, x: (w.float() * x.float()).sum(-1), backend="inductor", dynamic=False)

    def median(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    out = {"mv": median(lambda: torch.mv(w, x)), "reduction": median(lambda: reduce(w, x))}
    out["ceiling"] = min(out.values())
    return {k: round(v, 3) for k, v in out.items()}


def run_child(tree: str, script: str, args: list, **env) -> dict:
    """Run `script` (Python source) in a fresh process importing `tree`'s `src/`, with `args` and extra
    environment `env`; returns the JSON object its last line prints."""
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"), **env)
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True, timeout=1800
    )
    if out.returncode:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(
    tree: str,
    ref: str,
    dtype: str,
    batch: int,
    repeats: int,
    gguf: str = "",
    env: dict | None = None,
    quantization: str = "none",
) -> dict:
    return run_child(tree, CHILD, [ref, dtype, batch, repeats, gguf or "-", quantization], **(env or {}))


def gguf_values(path: str) -> int:
    """The values a GGUF file's tensors hold (what one decode step reads at batch 1, the tied head once)."""
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


def env_pairs(items: list) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--a-env/--b-env take NAME=VALUE, got {item!r}.")
        out[name] = value
    return out


def summarise(runs: dict) -> dict:
    """Each side's medians over its processes (`runs`: side -> the children's JSON objects), its step times, and
    the ratios b/a (and a2/a with a control) of the step and the time to first token."""
    out: dict = {}
    for side, rs in runs.items():
        out[side] = {k: round(statistics.median(r[k] for r in rs), 3) for k in ("ttft_ms", "step_ms")}
        out[side]["all_step_ms"] = [round(r["step_ms"], 3) for r in rs]
    for side in [s for s in ("b", "a2") if s in runs]:
        out[f"{side}_over_a_step"] = round(out[side]["step_ms"] / out["a"]["step_ms"], 3)
        out[f"{side}_over_a_ttft"] = round(out[side]["ttft_ms"] / out["a"]["ttft_ms"], 3)
    return out


def main() -> None:
    from reference import SIZES, build_reference, pressure, real_model, reference_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="the tree before (its src/ is imported)")
    p.add_argument("--b", default=None, help="the tree after (default: --a, for an A/B of environments)")
    p.add_argument("--a-env", nargs="+", default=[], metavar="NAME=VALUE", help="environment of side A (and A2)")
    p.add_argument("--b-env", nargs="+", default=[], metavar="NAME=VALUE", help="environment of side B")
    p.add_argument(
        "--model",
        default="reference",
        choices=["reference", "smollm2"],
        help="reference: --size's checkpoint; smollm2: the suite's real model (its GGUF)",
    )
    p.add_argument("--rounds", type=int, default=3, help="A B pairs of processes per case")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument(
        "--control",
        action="store_true",
        help='an A/A control in the same run: each round runs A, B, then A again (side "a2"); '
        "a2/a is the spread a refactor's b/a must be read against",
    )
    p.add_argument("--size", default="41m", choices=sorted(SIZES), help="the reference model (reference.py)")
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8"],
        help='int8: QuantizationConfig("int8_weight_only") on both sides (the bf16 GEMV ceiling is then not reported '
        "against)",
    )
    args = p.parse_args()
    args.b = args.b or args.a
    envs = {"a": env_pairs(args.a_env), "b": env_pairs(args.b_env)}
    envs["a2"] = envs["a"]
    gguf = ""
    if args.model == "smollm2":
        ref, gguf = real_model()
        rows = gguf_values(os.path.join(ref, gguf)) // 512
    else:
        ref = build_reference(reference_dir(args.size), size=args.size)
        rows = parameter_count(ref) // 512  # the ceiling reads as many values as the model has weights
    result = {
        "a": os.path.abspath(args.a),
        "b": os.path.abspath(args.b),
        "a_env": envs["a"],
        "b_env": envs["b"],
        "model": args.model if args.model == "smollm2" else args.size,
        "quantization": args.quantization,
        "pressure_before": pressure(),
        "ceiling_gemv_ms": {d: gemv_ms(d, rows) for d in args.dtypes},
        "cases": [],
    }
    for dtype in args.dtypes:
        for batch in args.batches:
            sides = ("a", "b", "a2") if args.control else ("a", "b")
            runs = {side: [] for side in sides}
            for _ in range(args.rounds):
                for side in sides:
                    runs[side].append(
                        child(
                            args.a if side == "a2" else getattr(args, side),
                            ref,
                            dtype,
                            batch,
                            args.repeats,
                            gguf,
                            envs[side],
                            args.quantization,
                        )
                    )
            case = {"dtype": dtype, "batch": batch, "pressure_after": pressure(), **summarise(runs)}
            if batch == 1 and args.quantization == "none":
                case["b_step_vs_gemv_ceiling"] = round(
                    result["ceiling_gemv_ms"][dtype]["ceiling"] / case["b"]["step_ms"], 3
                )
            result["cases"].append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
    result["ceiling_gemv_ms_after"] = {d: gemv_ms(d, rows) for d in args.dtypes}
    result["pressure_after"] = pressure()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
