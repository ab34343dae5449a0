"""Load time and peak RSS of the 41.6M reference checkpoint: staticformers vs transformers.

Each load runs in a fresh child process (peak RSS is per process), interleaved ours / theirs,
repeated; the report gives medians and ratios as JSON. RSS is read from /proc (VmHWM), and the
figure that matters is the rise during the load above the process after imports. A second figure is
the rise after one forward pass: weights that stay memory-mapped count only once they are read.

    .venv/bin/python bench/load.py [--repeats 5] [--out bench/results/load.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from reference import build_reference, pressure  # noqa: E402


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:  # resets VmHWM to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def child(impl: str, dtype: str, path: str) -> None:
    import torch

    if impl == "ours":
        from staticformers import AutoModelForCausalLM
    else:
        from transformers import AutoModelForCausalLM
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(2)
    _reset_peak()
    before = _vm("VmRSS:")
    t0 = time.perf_counter()
    extra = (
        {"device_map": "cpu"} if impl == "ours" else {}
    )  # transformers needs accelerate for device_map; CPU is its default
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **extra)
    seconds = time.perf_counter() - t0
    peak = _vm("VmHWM:")
    with torch.no_grad():  # touch every weight: memory-mapped weights count only once read
        model(input_ids=torch.ones(1, 8, dtype=torch.long))
    after_forward = _vm("VmRSS:")
    params = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    print(
        json.dumps(
            {
                "seconds": seconds,
                "rss_before": before,
                "peak_rss": peak,
                "rise": peak - before,
                "after_forward_rise": after_forward - before,
                "param_bytes": params,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "load.json"))
    args = ap.parse_args()
    path = build_reference()
    ckpt_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    runs: dict = {}
    pressure_before = pressure()
    for _ in range(args.repeats):
        for dtype in ("float32", "bfloat16"):
            for impl in ("ours", "transformers"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", impl, dtype, path], capture_output=True, text=True, check=True
                ).stdout
                runs.setdefault(f"{impl}/{dtype}", []).append(json.loads(out.strip().splitlines()[-1]))
    report = {
        "checkpoint_bytes": ckpt_bytes,
        "pressure_before": pressure_before,
        "pressure_after": pressure(),
        "repeats": args.repeats,
        "results": {},
    }
    for key, rs in runs.items():
        report["results"][key] = {
            "seconds_median": statistics.median(r["seconds"] for r in rs),
            "rise_median_mb": statistics.median(r["rise"] for r in rs) / 1e6,
            "peak_rss_median_mb": statistics.median(r["peak_rss"] for r in rs) / 1e6,
            "rss_rise_after_forward_median_mb": statistics.median(r["after_forward_rise"] for r in rs) / 1e6,
            "param_mb": rs[0]["param_bytes"] / 1e6,
        }
    for dtype in ("float32", "bfloat16"):
        ours, theirs = report["results"][f"ours/{dtype}"], report["results"][f"transformers/{dtype}"]
        report[f"ratios_{dtype}"] = {
            "load_speedup_vs_transformers": theirs["seconds_median"] / ours["seconds_median"],
            "rss_rise_ours_over_theirs": ours["rise_median_mb"] / theirs["rise_median_mb"],
            "rss_rise_ours_over_checkpoint": ours["rise_median_mb"] * 1e6 / ckpt_bytes,
            "rss_after_forward_ours_over_theirs": ours["rss_rise_after_forward_median_mb"]
            / theirs["rss_rise_after_forward_median_mb"],
        }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
