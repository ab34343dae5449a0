"""Compile discipline on XLA, counted by XLA itself (`UncachedCompile`): after the plan's shapes are warm,
50 mixed requests (lengths, joins and leaves, sampling settings) compile nothing; a decode step reads
one thing back from the device, the chosen ids (two with logprobs); the plan compiled ahead of time
compiles one XLA graph per declared step, and a second process finds them all in the persistent cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed here: `make test-xla` runs these in its own venv")

import torch  # noqa: E402

from staticformers.generation.engines import compile_settings, engine_for  # noqa: E402
from staticformers.backends.xla import runtime  # noqa: E402
from staticformers.generation.generation_config import GenerationConfig  # noqa: E402
from staticformers.generation.loop import GenerationLoop, GenerationRequest  # noqa: E402
from staticformers.generation.sampling import SamplingParams  # noqa: E402

from loop_driver import run_loop  # noqa: E402
from xla_support import PLAN  # noqa: E402


def schedule(seed: int, n: int = 50) -> dict:
    """`n` requests arriving over the loop's steps; the shape of the mix (lengths, arrival steps, which
    processors each row uses) is the same for every seed, the numbers in it (tokens, seeds, temperatures,
    top-k within its power of two, top-p, logprobs) are not."""
    shape = torch.Generator().manual_seed(0)
    values = torch.Generator().manual_seed(seed)
    arrivals: dict = {}
    step = 0
    for i in range(n):
        length = int(torch.randint(1, 25, (1,), generator=shape))
        new = int(torch.randint(1, 9, (1,), generator=shape))
        kind = i % 4
        prompt = torch.randint(3, 128, (length,), generator=values).tolist()
        u = float(torch.rand((), generator=values))
        if kind == 0:
            params = SamplingParams()
        elif kind == 1:
            params = SamplingParams(do_sample=True, temperature=0.6 + u, seed=int(1000 * u) + seed)
        elif kind == 2:
            params = SamplingParams(do_sample=True, top_k=17 + int(10 * u), top_p=0.8 + 0.1 * u, seed=seed + i)
        else:
            params = SamplingParams(logprobs=2)
        arrivals.setdefault(step, []).append(GenerationRequest(prompt, new, params))
        step += int(torch.randint(0, 4, (1,), generator=shape))
    return arrivals


@pytest.fixture
def loop(xla_models):
    model, _, _ = xla_models("qwen3")
    engine = engine_for(model)
    return GenerationLoop(engine, compile_settings(model, GenerationConfig()))


def test_fifty_mixed_requests_compile_nothing_once_warm(loop):
    warm = run_loop(loop, schedule(seed=1))
    before = runtime.counters()
    out = run_loop(loop, schedule(seed=2))
    grown = runtime.counters() - before
    assert len(warm) == len(out) == 50
    assert grown.uncached_compiles == 0, grown
    assert grown.executions > 0 and grown.cached_compiles > 0  # it ran, on graphs XLA already had


def test_a_decode_step_reads_back_only_the_ids(loop):
    for prompt in ([5, 6, 7], [9, 10], [11, 12, 13, 14]):
        loop.add(GenerationRequest(prompt, 6))
    loop.step()  # the prefill of all three
    loop.step()  # a first decode step: its glue graph compiles here if it is new
    before = runtime.counters()
    events = loop.step()
    grown = runtime.counters() - before
    assert len(events) == 3 and all(e.token is not None for e in events)
    assert grown.transfers_from_device == 1, grown  # the [3] chosen ids, once
    loop.add(GenerationRequest([3, 4], 6, SamplingParams(logprobs=0)))
    while not loop.idle:
        loop.step()
    for prompt in ([5, 6, 7], [9, 10]):
        loop.add(GenerationRequest(prompt, 6, SamplingParams(logprobs=0)))
    loop.step()
    loop.step()
    before = runtime.counters()
    events = loop.step()
    grown = runtime.counters() - before
    assert all(e.logprob is not None for e in events)
    assert grown.transfers_from_device == 2, grown  # the ids and their log-probabilities
    while not loop.idle:
        loop.step()


PRECOMPILE = r"""
import json, sys, os
import torch
from staticformers import AutoModelForCausalLM, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.backends.xla import runtime
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="xla")
engine = engine_for(model, ShapePlan(**json.loads(sys.argv[2])))
before = runtime.counters()
rows = engine.precompile(compile_settings(model, GenerationConfig()))
grown = runtime.counters() - before
declared = len(engine.plan.decode_shapes()) + len(engine.plan.prefill_shapes())
print(json.dumps({"rows": rows, "declared": declared, "uncached": grown.uncached_compiles,
                  "hits": grown.persistent_hits, "unloadable": grown.persistent_found_unloadable,
                  "pjrt": runtime.pjrt_device()}))
"""


def test_precompiled_plan_counts_and_a_second_process_compiles_nothing(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints("llama-tied")  # an architecture no other test here compiles
    env = {**os.environ, "STATICFORMERS_CACHE": str(tmp_path / "cache")}
    reports = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", PRECOMPILE, path, json.dumps(PLAN)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = reports
    assert len(cold["rows"]) == cold["declared"]
    assert [r["graphs"] for r in cold["rows"]] == [1] * cold["declared"]  # one XLA compilation per step
    # the rest of what compiled: each cache's allocation and each prefill's insert into its cache rows
    assert cold["uncached"] >= cold["declared"] and cold["hits"] == cold["unloadable"] == 0
    # the second process finds the steps' graphs in the persistent cache under the same keys (the
    # allocation and insert graphs are XLA's to keep or not); XLA's CPU plugin cannot load an executable
    # back (it compiles again), the accelerators' plugins load them
    found = warm["hits"] + warm["unloadable"]
    assert cold["declared"] <= found <= warm["uncached"] == cold["uncached"], warm
    if warm["pjrt"] != "CPU":
        assert warm["hits"] == found
