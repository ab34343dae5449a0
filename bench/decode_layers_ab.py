"""A/B of a warm bf16 decode step's layers as one call (`backends/cpu/decode_layers.py`) against its regions, in one
process, alternating step by step.

Why in one process: `bench/ab.py --a-env STATICFORMERS_DECODE_LAYERS=0 --control` runs the two in fresh processes,
and on a machine whose memory rate drifts by 20% within minutes its control spread (A2/A) was as large as the effect.
Here one process loads the model once, compiles its steps once, and alternates the same warm step with the one call
on and off (`STATICFORMERS_DECODE_LAYERS`, which a step asks on every call; off, it runs the very regions it falls
back to), so both sides share the weights' placement, the compiled code and the minute; the order flips each round
(on off, off on, ...). Each timed value is
((a `--new`-token generate - a 1-token one) / (new - 1)). The real model is the suite's SmolLM2-135M-Instruct GGUF
(`tests/real_model_cache.py`), bf16 activations over bf16 or weight-only int8 weights (`--weights`; int8's one
call takes one row), over static caches (`generate()`) or a block KV cache (`--blocks`: the generation loop over a
pool of 32-position blocks). Prints one JSON object (`--out` also writes it).

    python bench/decode_layers_ab.py --batches 1 8 --rounds 8 --out bench/results/decode-layers-ab-2026-12-07.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from reference import pool_blocks, pressure, real_model, report  # noqa: E402


def blocks_loop(model, batch: int, prompt: int, new: int):
    """A greedy generation loop over a pool of 32-position blocks holding every row's positions (no preemption), its
    prompts prefilled in one chunk each."""
    from staticformers.generation.engines import compile_settings, engine_for
    from staticformers.generation.generation_config import GenerationConfig
    from staticformers.generation.loop import GenerationLoop

    engine = engine_for(model)
    plan = engine.plan.with_extend_widths((max(prompt, 16), 1))
    blocks = pool_blocks(batch, prompt, new)
    settings = compile_settings(model, GenerationConfig())
    return GenerationLoop(engine, settings, plan=plan, chunked_prefill=True, kv_blocks=blocks, kv_block_size=32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=8, help="on/off pairs per batch")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=65)
    p.add_argument(
        "--weights",
        choices=("bf16", "int8", "int8+head"),
        default="bf16",
        help="bf16 weights, or weight-only int8 (the head exact, or int8 too); activations bf16 either way",
    )
    p.add_argument(
        "--blocks",
        action="store_true",
        help="the generation loop over a block KV cache (blocks of 32, every row's positions) instead of generate()",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from staticformers import AutoModelForCausalLM, QuantizationConfig
    from staticformers.backends.cpu import decode_layers
    from staticformers.generation.requests import GenerationRequest

    built: list = []
    real = decode_layers.layers_stack

    def counted(*a):
        stack = real(*a)
        built.append(stack is not None)
        return stack

    decode_layers.layers_stack = counted  # the regions' module finds it here on each new step
    switch = "STATICFORMERS_DECODE_LAYERS"  # asked on every call of a step (`decode_layers.allowed`)
    folder, gguf = real_model()
    quantization = (
        None
        if args.weights == "bf16"
        else QuantizationConfig("int8_weight_only", include_input_output_embeddings=args.weights == "int8+head")
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf, dtype=torch.bfloat16, quantization_config=quantization
    )
    result: dict = {
        "model": "smollm2",
        "dtype": "bfloat16",
        "weights": args.weights,
        "cache": "blocks" if args.blocks else "static",
        "pressure_before": pressure(),
        "cases": [],
    }
    for batch in args.batches:
        ids = torch.randint(1, 32000, (batch, args.prompt), generator=torch.Generator().manual_seed(1))

        loop = blocks_loop(model, batch, args.prompt, args.new) if args.blocks else None

        def run(n: int, ids=ids, loop=loop) -> float:
            t = time.perf_counter()
            if loop is None:
                model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
            else:
                for row in ids.tolist():
                    loop.add(GenerationRequest(row, n))
                while not loop.idle:
                    loop.step()
            return time.perf_counter() - t

        for side in ("1", "0"):  # compile (or load) and warm every step this batch takes, both ways
            os.environ[switch] = side
            run(args.new), run(1), run(args.new)
        if not any(built):
            raise SystemExit("the one-call decode step did not run here (see decode_layers.py for when it does).")
        steps: dict = {"on": [], "off": []}
        for r in range(args.rounds):
            for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                os.environ[switch] = "1" if side == "on" else "0"
                first, total = run(1), run(args.new)
                steps[side].append((total - first) / (args.new - 1) * 1e3)
        m_on, m_off = statistics.median(steps["on"]), statistics.median(steps["off"])
        case = {
            "batch": batch,
            "step_ms_on": round(m_on, 3),
            "step_ms_off": round(m_off, 3),
            "on_over_off": round(m_on / m_off, 3),
            "pairs_on_faster": sum(a < b for a, b in zip(steps["on"], steps["off"])),
            "all_on": [round(x, 3) for x in steps["on"]],
            "all_off": [round(x, 3) for x in steps["off"]],
            "pressure_after": pressure(),
        }
        result["cases"].append(case)
        print(case, file=sys.stderr, flush=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
