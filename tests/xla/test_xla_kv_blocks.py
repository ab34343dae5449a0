"""Block KV caches on XLA, counted by XLA itself (`UncachedCompile`): once mixed traffic (joins, leaves, chunked
prompts, preemptions on a pool that runs out) has warmed the plan, the same mix with other tokens compiles nothing: the block table is data, the gather and the indexed stores are of fixed shape.
Greedy tokens equal the static loop's on the same device. (Speculation is left out here: what a row accepts
depends on its tokens, so the mix of a second pass would not be the first's; tests/test_kv_blocks.py runs it.)"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed here: `make test-xla` runs these in its own venv")

import torch  # noqa: E402

from staticformers import ShapePlan  # noqa: E402
from staticformers.generation.engines import compile_settings, engine_for  # noqa: E402
from staticformers.backends.xla import runtime  # noqa: E402
from staticformers.generation.generation_config import GenerationConfig  # noqa: E402
from staticformers.generation.loop import GenerationLoop, GenerationRequest  # noqa: E402
from staticformers.generation.sampling import SamplingParams  # noqa: E402

from loop_driver import run_loop  # noqa: E402
from xla_support import plan as suite_plan  # noqa: E402


def traffic(seed: int) -> dict:
    """Prompts of 5..40 tokens (the prompt bucket is 16: longer ones chunk) arriving over the steps, greedy and
    seeded sampling mixed; the shape of the mix is the same for every seed, the tokens are not."""
    values = torch.Generator().manual_seed(seed)
    arrivals: dict = {}
    for i, (own, new, step) in enumerate([(12, 20, 0), (40, 12, 0), (9, 24, 2), (5, 16, 3), (30, 10, 6), (7, 20, 9)]):
        prompt = torch.randint(3, 128, (own,), generator=values).tolist()
        params = SamplingParams(do_sample=True, seed=seed + i) if i % 2 else SamplingParams()
        arrivals.setdefault(step, []).append(GenerationRequest(prompt, new, params, request_id=i))
    return arrivals


def test_block_caches_compile_nothing_once_warm_under_preemption(xla_models):
    model, _, _ = xla_models("qwen3")
    plan = ShapePlan(
        batch_sizes=[2, 4], prompt_lengths=[16], kv_lengths=[32, 64], max_model_len=64, extend_widths=[(8, 1)]
    )
    engine = engine_for(model, plan)
    settings = compile_settings(model, GenerationConfig())
    static = run_loop(GenerationLoop(engine, settings, chunked_prefill=8), traffic(seed=1))
    loop = GenerationLoop(engine, settings, chunked_prefill=8, kv_blocks=8, kv_block_size=8)
    warm = run_loop(loop, traffic(seed=1))
    preempted = loop.preemptions
    before = runtime.counters()
    out = run_loop(loop, traffic(seed=2))
    grown = runtime.counters() - before
    engine_for(model, suite_plan())  # the session's model goes back to the suite's plan, on static caches
    engine.use_blocks(None)
    assert warm == static
    assert len(out) == 6 and preempted > 0 and loop.preemptions > preempted and loop.blocks_used == 0
    assert grown.uncached_compiles == 0, grown
