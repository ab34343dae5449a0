"""How many requests a byte budget runs at once on a model that mixes sliding-window and full-attention layers, with
its window layers' KV blocks as a group of their own against one group for every layer (issue 41).

Why it exists: with one group, every layer of a Gemma-3-shaped model keeps every block of a row's context, though
five of its six layers read only the last window. With two (`generation/kv_blocks.py`'s `window_group`), the window
layers' pool holds what the rows' windows need (`window_pool_blocks`) and the budget's other bytes go to the full
layers' pool (`KVBlocks.blocks_in`), so the same bytes hold more of the rows' contexts. This drives the generation
loop in-process over the capacity workload's requests (`bench/kv_capacity.py`: long-tail prompts, all queued at
once, greedy) at each budget, once with one group (the loop's window group switched off by a patch) and once with
two, and counts per step: the rows running and waiting, the preemptions, the steps. Counts, not times: each arm's
figures are the same on any machine. Both arms' tokens are compared request by request (they must be equal).

    python bench/kv_window_group.py --size gemma3-50m --requests 64 --divisors 8 4 --out FILE
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from kv_capacity import capacity_jobs, kv_budget, length_summary  # noqa: E402
from reference import build_reference, emit, pressure  # noqa: E402


def drive(loop, jobs: list) -> dict:
    """Every job queued at once, the loop stepped until idle: each request's tokens and the per-step counts."""
    from staticformers.generation.loop import GenerationRequest

    for i, (prompt, new) in enumerate(jobs):
        loop.add(GenerationRequest(prompt, new, request_id=i))
    tokens: dict = {}
    running, waiting, steps = [], [], 0
    start = time.perf_counter()
    while not loop.idle:
        for event in loop.step():
            if event.error is not None:
                raise event.error
            tokens.setdefault(event.request_id, []).append(event.token)
        running.append(loop.running)
        waiting.append(len(loop.waiting))
        steps += 1
    return {
        "tokens": tokens,
        "steps": steps,
        "running_max": max(running),
        "running_mean": round(statistics.mean(running), 2),
        "waiting_mean": round(statistics.mean(waiting), 2),
        "preemptions": loop.preemptions,
        "seconds": round(time.perf_counter() - start, 1),  # this machine's, for orientation only
    }


def arm(model, plan, settings, jobs: list, budget: int, block_size: int, slots: int, grouped: bool) -> dict:
    """One loop over `jobs` on a pool of `budget` bytes: the window layers in a group of their own, or not."""
    from staticformers.generation import loop as loop_module
    from staticformers.generation.engines import engine_for
    from staticformers.generation.chunking import widest_steps
    from staticformers.generation.kv_blocks import window_spec
    from staticformers.models.block_kv_cache import KVBlocks

    def window(n: int):
        return window_spec(model.config, n, slots, widest_steps(plan, None, True), plan.max_model_len, block_size)

    blocks = KVBlocks.blocks_in(model, budget, block_size, window=window if grouped else None)
    engine = engine_for(model, plan)
    engine.reset()  # no pool of the other arm's
    with mock.patch.object(loop_module, "window_spec", window_spec if grouped else lambda *a, **k: None):
        loop = loop_module.GenerationLoop(
            engine, settings, max_batch_size=slots, chunked_prefill=True, kv_blocks=blocks, kv_block_size=block_size
        )
        spec = loop._window_spec
        out = drive(loop, jobs)
    out["blocks"] = blocks
    out["window_blocks"] = spec[1] if spec is not None else None
    out["pool_bytes"] = KVBlocks.bytes_for(model, blocks, block_size, window=spec)
    out["pool_positions_full_layers"] = blocks * block_size
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="gemma3-50m", help="a reference size that mixes window and full layers")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--slots", type=int, default=16, help="rows at most (the server's --max-batch-size)")
    p.add_argument("--divisors", type=int, nargs="+", default=[8, 4], help="budgets: 16 static rows' bytes over each")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from staticformers import AutoModelForCausalLM
    from staticformers.generation.chunking import chunk_width, serving_chunk_tokens
    from staticformers.generation.engines import compile_settings
    from staticformers.generation.generation_config import GenerationConfig
    from staticformers.generation.kv_blocks import window_group
    from staticformers.generation.plan import ShapePlan

    model = AutoModelForCausalLM.from_pretrained(build_reference(size=args.size))
    group = window_group(model.config)
    if group is None:
        raise SystemExit(f"{args.size} does not mix window and full-attention layers: pick gemma3-50m or gptoss50m.")
    plan = ShapePlan(max_model_len=args.max_model_len, max_batch_size=args.slots).bind(
        model.config.max_position_embeddings
    )
    plan = plan.with_chunk_tokens(serving_chunk_tokens(plan, None))  # the server's chunk budget
    settings = compile_settings(model, GenerationConfig(disable_compile=True))
    jobs = capacity_jobs(
        args.requests,
        model.config.vocab_size,
        args.seed,
        (16, min(1800, args.max_model_len - 129), 96.0, 1.2),
        (16, 128),
        args.max_model_len,
    )
    report: dict = {
        "size": args.size,
        "window_layers": list(group[0]),
        "window": group[1],
        "layers": model.config.num_hidden_layers,
        "slots": args.slots,
        "chunk": chunk_width(plan, None),  # the widest: a batch of 1's (each batch bucket has its own)
        "block_size": args.block_size,
        "lengths": length_summary(jobs),
        "pressure_before": pressure(),
        "budgets": [],
        "command": " ".join(["python", "bench/kv_window_group.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    for divisor in args.divisors:
        budget = kv_budget(model.config, model.dtype, 16, args.max_model_len, divisor, args.block_size)
        one = arm(model, plan, settings, jobs, budget["bytes"], args.block_size, args.slots, grouped=False)
        two = arm(model, plan, settings, jobs, budget["bytes"], args.block_size, args.slots, grouped=True)
        same = one.pop("tokens") == two.pop("tokens")
        entry = {
            "budget": budget,
            "one_group": one,
            "two_groups": two,
            "tokens_equal": same,
            "full_layer_blocks_ratio": round(two["blocks"] / one["blocks"], 3),
            "running_mean_ratio": round(two["running_mean"] / one["running_mean"], 3),
            "steps_ratio": round(two["steps"] / one["steps"], 3),
        }
        report["budgets"].append(entry)
        print(
            f"budget {budget['mib']} MiB: blocks {one['blocks']} -> {two['blocks']} (window pool "
            f"{two['window_blocks']}), running mean {one['running_mean']} -> {two['running_mean']}, max "
            f"{one['running_max']} -> {two['running_max']}, preemptions {one['preemptions']} -> "
            f"{two['preemptions']}, steps {one['steps']} -> {two['steps']}, tokens equal: {same}",
            flush=True,
        )
        if not same:
            raise SystemExit("the two arms' tokens differ: a defect")
    report["pressure_after"] = pressure()
    report["torch"] = torch.__version__
    emit(report, args.out)


if __name__ == "__main__":
    main()
