"""A/B of a warm bf16 decode step's layers as one call (`backends/cpu/decode_layers.py`) against its regions, in one
process, alternating step by step.

Why in one process: `bench/ab.py --a-env STATICFORMERS_DECODE_LAYERS=0 --control` runs the two in fresh processes,
and on a machine whose memory rate drifts by 20% within minutes its control spread (A2/A) was as large as the effect.
Here one process loads the model once, compiles its steps once, and alternates the same warm step with the one call
on and off (the off side runs the very regions the step falls back to), so both sides share the weights' placement,
the compiled code and the minute; the order flips each round (on off, off on, ...). Each timed value is
((a `--new`-token generate - a 1-token one) / (new - 1)). The real model is the suite's SmolLM2-135M-Instruct GGUF
(`tests/real_model_cache.py`), bf16. Prints one JSON object (`--out` also writes it).

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

from reference import pressure, real_model, report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=8, help="on/off pairs per batch")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=65)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from staticformers import AutoModelForCausalLM
    from staticformers.backends.cpu import regions

    on = [True]
    built: list = []
    real = regions.layers_stack

    def switched(*a):
        stack = real(*a)
        built.append(stack is not None)
        return None if stack is None else (lambda *b: stack(*b) if on[0] else None)

    regions.layers_stack = switched
    folder, gguf = real_model()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16)
    result: dict = {"model": "smollm2", "dtype": "bfloat16", "pressure_before": pressure(), "cases": []}
    for batch in args.batches:
        ids = torch.randint(1, 32000, (batch, args.prompt), generator=torch.Generator().manual_seed(1))

        def run(n: int, ids=ids) -> float:
            t = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
            return time.perf_counter() - t

        run(args.new), run(1), run(args.new)  # compile (or load) and warm every step this batch takes
        if not any(built):
            raise SystemExit("the one-call decode step did not run here (see decode_layers.py for when it does).")
        steps: dict = {"on": [], "off": []}
        for r in range(args.rounds):
            for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                on[0] = side == "on"
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
