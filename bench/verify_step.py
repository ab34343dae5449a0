"""What a verify step costs against a decode step: the engine's decode `[B, 1]` and extend `[B, k+1]` steps
(every position kept, as speculative verification runs it) timed call by call in one process, on the same
compiled model and cache, interleaved (decode, extend k1, extend k2, ..., decode, ...).

Why: a speculative step at batch 1 gains (tokens per verify) / (verify cost in decode steps); this
script measures the denominator for each k, so `bench/speculative.py`'s ratios can be read, and a change to
the extend step's formulation can be judged on its own. Prints one JSON object (to `--out` as well):
per step, min and median milliseconds over `--calls` calls, the ratio of each extend's median to decode's,
and /proc/pressure/cpu before and after.

    python bench/verify_step.py --batch 1 --k 4 6 8 --calls 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import build_reference, pressure, reference_dir  # noqa: E402
from reference import report as write_report  # noqa: E402

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan  # noqa: E402
from staticformers.generation.engines import compile_settings, engine_for  # noqa: E402
from staticformers.generation.generation_config import GenerationConfig  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 6, 8])
    ap.add_argument("--kv", type=int, default=512)
    ap.add_argument("--position", type=int, default=300, help="each row's length before the step")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--checkpoint", default=None, help="a model folder (default: the 41.6M reference)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    report = {"pressure_before": pressure(), "threads": torch.get_num_threads(), **vars(args)}
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint or build_reference(reference_dir()), dtype=args.dtype)
    plan = ShapePlan(
        batch_sizes=[args.batch],
        prompt_lengths=[16],
        kv_lengths=[args.kv],
        max_model_len=args.kv,
        extend_widths=[(k + 1, k + 1) for k in args.k],
    )
    engine = engine_for(model)
    settings = compile_settings(model, GenerationConfig(), CompileConfig(backend=args.backend))
    cache = engine.cache(args.batch, args.kv)
    b = args.batch
    gen = torch.Generator().manual_seed(0)

    def decode():
        tokens = torch.randint(10, model.config.vocab_size, (b, 1), generator=gen)
        positions = torch.full((b, 1), args.position)
        return engine.decode(settings, cache, tokens, positions)

    def extend(width: int):
        def run():
            tokens = torch.randint(10, model.config.vocab_size, (b, width), generator=gen)
            positions = torch.arange(width).repeat(b, 1) + args.position
            keep = torch.arange(width).repeat(b, 1)
            return engine.extend(settings, cache, tokens, positions, keep, plan=plan)

        return run

    steps = {"decode [%d, 1]" % b: decode, **{f"extend [{b}, {k + 1}]": extend(k + 1) for k in args.k}}
    times = {name: [] for name in steps}
    with torch.no_grad():
        for fn in steps.values():  # compile and warm
            for _ in range(3):
                fn()
        for _ in range(args.calls):
            for name, fn in steps.items():
                start = time.perf_counter()
                out = fn()
                out[0].cpu()
                times[name].append(time.perf_counter() - start)
    first = next(iter(times))
    base = statistics.median(times[first])
    report["steps"] = {
        name: {
            "min_ms": round(min(t) * 1e3, 2),
            "median_ms": round(statistics.median(t) * 1e3, 2),
            "vs_decode": round(statistics.median(t) / base, 2),
        }
        for name, t in times.items()
    }
    report["compile_backend"] = settings.label
    report["pressure_after"] = pressure()
    write_report(report, args.out)


if __name__ == "__main__":
    main()
