"""`staticformers compile PATH`: compile the whole shape plan ahead of time and print it.

Every graph lands in the persistent on-disk cache (`$STATICFORMERS_CACHE`, default
`~/.cache/staticformers`), so a later `generate` in another process compiles nothing it finds there.
"""

from __future__ import annotations

import argparse
import time

from .options import add_threads

HELP = "compile the shape plan ahead of time and print each graph (shape, seconds, cache hit)"


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder or Hub id")
    p.add_argument(
        "--device", default="auto", help="auto (Neuron first, then CUDA, ..., the CPU), neuron, cuda, cpu, ..."
    )
    add_threads(p)
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: the device's)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the plan's longest sequence, at most the model's max_position_embeddings "
        "(default: the smaller of that and 2048)",
    )
    p.add_argument("--batch-sizes", type=_ints, default=None, help="e.g. 1,2,4,8")
    p.add_argument("--prompt-lengths", type=_ints, default=None, help="e.g. 32,64,128")
    p.add_argument("--kv-lengths", type=_ints, default=None, help="e.g. 256,512")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")


def run(args: argparse.Namespace) -> int:
    from ..compilation.compiler import cache_root
    from ..compilation.progress import CompileProgress
    from ..generation.engines import compile_settings, engine_for
    from ..generation.generation_config import CompileConfig, GenerationConfig
    from ..generation.plan import ShapePlan
    from ..api.auto import from_pretrained
    from .options import check_backend, check_device

    check_backend(args.backend)
    check_device(args.device)
    model = from_pretrained(args.model, dtype=args.dtype, device_map=args.device)
    plan = ShapePlan(
        batch_sizes=args.batch_sizes,
        prompt_lengths=args.prompt_lengths,
        kv_lengths=args.kv_lengths,
        max_model_len=args.max_model_len,
    )
    plan = plan.bind(model.config.max_position_embeddings)
    engine = engine_for(model, plan)
    settings = compile_settings(model, GenerationConfig(), CompileConfig(backend=args.backend))
    print(plan)
    print(f"device {model.device}, backend {settings.backend}, cache {cache_root()}")
    if args.dry_run:
        return 0
    print(f"{'step':8s} {'shape':18s} {'seconds':>8s}  {'graphs':>6s}  cache")
    start = time.perf_counter()

    def row_line(row) -> str:
        return (
            f"{row['kind']:8s} {str(row['shape']):18s} {row['seconds']:8.2f}  {row['graphs']:6d}  "
            f"{'hit' if row['cache_hit'] else 'compiled'}"
        )

    show = CompileProgress(
        plan.num_shapes, settings.backend, write=lambda line: print(line, flush=True), describe=row_line
    )
    show.begin()
    rows = engine.precompile(settings, progress=show)
    hits = sum(r["cache_hit"] for r in rows)
    print(
        f"{len(rows)} shapes, {sum(r['graphs'] for r in rows)} graphs in {time.perf_counter() - start:.1f} s "
        f"({hits} shapes from the on-disk cache)"
    )
    return 0
