"""Distributed benchmark: per-rank memory and step time for 1, 2 and 4 processes, against transformers.

On the ~41.6M-parameter Qwen3-shaped reference checkpoint (bench/reference.py), for each layout it
launches `torchrun --nproc_per_node=N` (gloo on the CPU) for staticformers and for transformers'
own `DistributedConfig` path, alternating who goes first, in `--repeats` rounds (medians; memory is
the maximum), and records per rank: peak RSS (ru_maxrss) after loading
and at the end, parameter bytes held (local shards), optimizer-state bytes, the median step time of
the timed steps (forward, backward, AdamW) and the losses (global batch 4 x 128 tokens, split over
the data-parallel ranks). One JSON object is printed; `/proc/pressure/cpu` is sampled before and
after, since the 2 cores are shared.

    python bench/distributed.py                    # 1, 2, 4 processes, fsdp layouts + tp2 x fsdp2, 2 rounds
    python bench/distributed.py --steps 3 --repeats 1 --layouts fsdp1 fsdp2
"""

from __future__ import annotations

import os
import sys


import argparse
import json
import resource
import statistics
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# name -> (processes, tp_size, fsdp_size)
LAYOUTS = {"fsdp1": (1, 1, 1), "fsdp2": (2, 1, 2), "fsdp4": (4, 1, 4), "tp2_fsdp2": (4, 2, 2)}
GLOBAL_BATCH, SEQ = 4, 128


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---------------------------------------------------------------------------------------------
# worker (one rank)
# ---------------------------------------------------------------------------------------------
def worker(impl: str, layout: str, path: str, out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    _, tp, fsdp = LAYOUTS[layout]
    rss_start = _rss_mib()
    t0 = time.perf_counter()
    if impl == "ours":
        from staticformers import AutoModelForCausalLM, DistributedConfig

        dc = DistributedConfig(tp_size=tp, fsdp_size=fsdp) if world > 1 else None
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=dc)
    else:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        kwargs = {}
        if world > 1:
            kwargs["distributed_config"] = DistributedConfig(tp_size=tp, fsdp_size=fsdp)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    load_seconds = time.perf_counter() - t0
    rss_loaded = _rss_mib()
    model.train()

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = {id(p): p for p in model.parameters()}.values()
    param_bytes = sum(local(p).numel() * local(p).element_size() for p in params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    dp_rank, dp = (rank // tp, world // tp) if world > 1 else (0, 1)
    losses, times = [], []
    vocab = model.config.vocab_size
    for step in range(steps + 1):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g).chunk(dp)[dp_rank]
        if dist.is_initialized():
            dist.barrier()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - t)
        value = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    optim_bytes = sum(
        local(v).numel() * local(v).element_size()
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    result = {
        "rank": rank,
        "load_seconds": round(load_seconds, 2),
        "rss_start_mib": round(rss_start),
        "rss_after_load_mib": round(rss_loaded),
        "peak_rss_mib": round(_rss_mib()),
        "param_bytes": param_bytes,
        "optim_bytes": optim_bytes,
        "step_seconds": round(statistics.median(times[1:]), 3),
        "first_step_seconds": round(times[0], 3),
        "losses": [round(x, 6) for x in losses],
    }
    with open(os.path.join(out, f"{impl}_{layout}_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del model, opt
    if dist.is_initialized():
        import gc

        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def launch(impl: str, layout: str, path: str, out: str, steps: int, timeout: int) -> dict:
    nproc = LAYOUTS[layout][0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src")}
    me = os.path.abspath(__file__)
    args = ["--worker", impl, "--layout", layout, "--model", path, "--out", out, "--steps", str(steps)]
    if nproc == 1:
        cmd = [sys.executable, me, *args]
    else:
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "torchrun"),
            f"--nproc_per_node={nproc}",
            "--standalone",
            me,
            *args,
        ]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        errors = [line for line in tail if "Error" in line or "error" in line]
        return {"ok": False, "wall_seconds": round(wall, 1), "error": (errors[-1] if errors else tail[-1])[:600]}
    ranks = []
    for r in range(nproc):
        with open(os.path.join(out, f"{impl}_{layout}_rank{r}.json")) as f:
            ranks.append(json.load(f))
    return {
        "ok": True,
        "processes": nproc,
        "wall_seconds": round(wall, 1),
        "peak_rss_mib_per_rank_max": max(r["peak_rss_mib"] for r in ranks),
        "rss_after_load_mib_per_rank_max": max(r["rss_after_load_mib"] for r in ranks),
        "param_mib_per_rank_max": round(max(r["param_bytes"] for r in ranks) / 2**20, 2),
        "optim_mib_per_rank_max": round(max(r["optim_bytes"] for r in ranks) / 2**20, 2),
        "load_seconds": max(r["load_seconds"] for r in ranks),
        "step_seconds": ranks[0]["step_seconds"],
        "first_step_seconds": ranks[0]["first_step_seconds"],
        "losses": ranks[0]["losses"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--impls", nargs="+", default=["ours", "transformers"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every launch (medians, A B / B A order)")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--model", default=None)
    parser.add_argument("--worker", choices=["ours", "transformers"])
    parser.add_argument("--layout", choices=list(LAYOUTS))
    parser.add_argument("--out")
    a = parser.parse_args()
    if a.worker:
        worker(a.worker, a.layout, a.model, a.out, a.steps)
        return
    sys.path.insert(0, HERE)
    from reference import build_reference, pressure

    path = a.model or build_reference()
    out = tempfile.mkdtemp(prefix="sf-bench-dist-")
    report = {
        "model": path,
        "global_batch": [GLOBAL_BATCH, SEQ],
        "steps": a.steps,
        "pressure_before": pressure(),
        "runs": {},
    }
    rounds: dict = {}
    for rep in range(a.repeats):
        for i, layout in enumerate(a.layouts):
            impls = a.impls if (i + rep) % 2 == 0 else list(reversed(a.impls))  # alternate who goes first
            for impl in impls:
                run = launch(impl, layout, path, out, a.steps, a.timeout)
                rounds.setdefault(f"{impl}/{layout}", []).append(run)
                print(json.dumps({f"{impl}/{layout}": run}), file=sys.stderr, flush=True)
        report.setdefault("pressure_after_round", []).append(pressure())
    for key, runs in rounds.items():
        ok = [r for r in runs if r.get("ok")]
        if not ok:
            report["runs"][key] = runs[0]
            continue
        merged = dict(ok[0])
        merged["repeats"] = len(ok)
        for field in ("step_seconds", "first_step_seconds", "load_seconds", "wall_seconds"):
            merged[field] = round(statistics.median(r[field] for r in ok), 3)
        merged["step_seconds_all"] = [r["step_seconds"] for r in ok]
        for field in ("peak_rss_mib_per_rank_max", "rss_after_load_mib_per_rank_max"):
            merged[field] = max(r[field] for r in ok)
        report["runs"][key] = merged
    report["pressure_after"] = pressure()
    base = report["runs"].get("ours/fsdp1", {})
    for run in report["runs"].values():
        if run.get("ok") and base.get("ok"):
            run["max_loss_diff_vs_ours_fsdp1"] = round(
                max(abs(x - y) for x, y in zip(run["losses"], base["losses"])), 7
            )
    for layout in a.layouts:
        ours, theirs = report["runs"].get(f"ours/{layout}"), report["runs"].get(f"transformers/{layout}")
        if ours and theirs and ours.get("ok") and theirs.get("ok"):
            report.setdefault("ratios", {})[layout] = {
                "peak_rss_ours_over_transformers": round(
                    ours["peak_rss_mib_per_rank_max"] / theirs["peak_rss_mib_per_rank_max"], 3
                ),
                "step_time_transformers_over_ours": round(theirs["step_seconds"] / ours["step_seconds"], 3),
            }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
