"""`bench/generate.py --device xla`: staticformers on XLA's PJRT device beside staticformers on the CPU
and transformers on the CPU, same checkpoint, same process, and the XLA compile seconds of the plan.

What this measures is a CPU emulation of a compile-per-shape device (PJRT_DEVICE=CPU), not a Neuron or
TPU figure: XLA's CPU backend compiles and runs the graphs that an accelerator's plugin would.

- decode tokens/s and time to first token, greedy, `--prompt` tokens then `--new` new ones, batch 1:
  `sf_xla` (openxla per shape, the default), `sf_xla_lazy` (lazy tracing), `sf_cpu` (our CPU backend,
  compile backend `--cpu-backend`, default eager: inductor's compile costs minutes here) and `hf` (transformers'
  default generate on the CPU); A B A B rounds, the median of `--repeats`.
- the plan's XLA compile seconds (`CompileTime`, XLA's own metric) and compilations (`UncachedCompile`):
  `cold` in a fresh process with an empty `$STATICFORMERS_CACHE`; `warm_process` in a second process
  with that cache (XLA's CPU plugin writes executables there but cannot load them back, so it compiles
  again: TPU and Neuron's plugin load them); `warm_in_process` a second engine on the same weights in
  the first process (XLA's in-memory cache answers; Dynamo traces again).

Needs the XLA environment (`make setup-xla`) and run from the repository root:
    PYTHONPATH=src PJRT_DEVICE=CPU ~/.cache/staticformers/venv-xla-*/bin/python bench/generate.py --device xla
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from reference import build_reference, pressure, reference_dir

PLAN_CASE = r"""
import json, sys, time
import torch
from staticformers import AutoModelForCausalLM, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.engine import Engine
from staticformers.backends.xla import runtime
plan = json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="xla")
settings = compile_settings(model, GenerationConfig())
out = {}
for name in ("first", "again_in_process"):
    engine = Engine(model, ShapePlan(**plan))
    before, start = runtime.counters(), time.perf_counter()
    engine.precompile(settings)
    grown = runtime.counters() - before
    out[name] = {"xla_compile_seconds": round(grown.compile_seconds, 3), "xla_compiles": grown.uncached_compiles,
                 "persistent_hits": grown.persistent_hits, "wall_seconds": round(time.perf_counter() - start, 2)}
print(json.dumps(out))
"""


def plan_compile(ref_dir: str, plan: dict) -> dict:
    """The plan's XLA compile seconds: cold, a second process on the same cache, and again in-process."""
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    with tempfile.TemporaryDirectory() as cache:
        env["STATICFORMERS_CACHE"] = cache
        runs = []
        for _ in range(2):
            proc = subprocess.run(
                [sys.executable, "-c", PLAN_CASE, ref_dir, json.dumps(plan)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold = runs[0]["first"]
    return {
        "plan": plan,
        "cold": cold,
        "warm_process": runs[1]["first"],
        "warm_in_process": runs[0]["again_in_process"],
        "warm_in_process_over_cold": round(
            runs[0]["again_in_process"]["xla_compile_seconds"] / max(cold["xla_compile_seconds"], 1e-9), 3
        ),
    }


def timed(fn, device=None) -> float:
    from staticformers.backends.devices import synchronize

    start = time.perf_counter()
    fn()
    if device is not None:
        synchronize(device)
    return time.perf_counter() - start


def speed_case(ref_dir: str, prompt: int, new: int, repeats: int, cpu_backend: str, plan: dict) -> dict:
    import transformers

    from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
    from staticformers.generation.engines import engine_for

    ids = torch.randint(3, 500, (1, prompt), generator=torch.Generator().manual_seed(0))
    xla = AutoModelForCausalLM.from_pretrained(ref_dir, device_map="xla")
    engine_for(xla, ShapePlan(**plan))
    cpu = AutoModelForCausalLM.from_pretrained(ref_dir)
    engine_for(cpu, ShapePlan(**plan))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir).eval()
    xdev = xla.device
    runners = {
        "sf_xla": lambda n: xla.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None),
        "sf_xla_lazy": lambda n: xla.generate(
            ids, max_new_tokens=n, do_sample=False, eos_token_id=None, compile_config=CompileConfig(backend="lazy")
        ),
        "sf_cpu": lambda n: cpu.generate(
            ids, max_new_tokens=n, do_sample=False, eos_token_id=None, compile_config=CompileConfig(backend=cpu_backend)
        ),
        "hf": lambda n: hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        ),
    }
    tokens = {}
    for name, run in runners.items():  # warm-up: every graph of the case compiles here
        tokens[name] = run(new)[0, -new:].tolist()
    times: dict = {name: {"ttft": [], "total": []} for name in runners}
    with torch.no_grad():
        for _ in range(repeats):
            for name, run in runners.items():
                times[name]["ttft"].append(timed(lambda: run(1), xdev if name.startswith("sf_xla") else None))  # noqa: B023
                times[name]["total"].append(timed(lambda: run(new), xdev if name.startswith("sf_xla") else None))  # noqa: B023
    out = {}
    for name, t in times.items():
        ttft, total = statistics.median(t["ttft"]), statistics.median(t["total"])
        out[name] = {
            "ttft_ms": round(1000 * ttft, 2),
            "decode_tok_s": round((new - 1) / max(total - ttft, 1e-9), 1),
            "same_tokens_as_hf": tokens[name] == tokens["hf"],
        }
    for name in ("sf_xla", "sf_xla_lazy", "sf_cpu"):
        out[name]["decode_vs_hf"] = round(out[name]["decode_tok_s"] / out["hf"]["decode_tok_s"], 2)
    return out


def main(args) -> None:
    size = args.size or "tiny"
    ref_dir = reference_dir(size)
    build_reference(ref_dir, size=size)
    new = min(args.new, 64) if args.new == 128 else args.new  # the defaults are the CPU benchmark's
    prompt = min(args.prompt, 32) if args.prompt == 128 else args.prompt
    kv = 1 << (prompt + new - 1).bit_length()
    plan = dict(batch_sizes=[1], prompt_lengths=[1 << (prompt - 1).bit_length()], kv_lengths=[kv], max_model_len=kv)
    report = {
        "device": "xla (PJRT_DEVICE=%s): a CPU emulation of a compile-per-shape device, not a Neuron or TPU "
        "figure" % os.environ.get("PJRT_DEVICE", "CPU"),
        "torch": torch.__version__,
        "model": ref_dir,
        "size": size,
        "prompt": prompt,
        "new": new,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "pressure_before": pressure(),
    }
    report["compile"] = plan_compile(ref_dir, plan)
    report["speed"] = speed_case(ref_dir, prompt, new, args.repeats, args.cpu_backend, plan)
    report["pressure_after"] = pressure()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
