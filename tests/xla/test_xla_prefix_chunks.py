"""Chunked prefill and prefix caching on XLA, counted by XLA itself (`UncachedCompile`): once traffic of
chunked prompts (longer than the prompt bucket), prefix hits of every length and misses has warmed the
shapes, the same traffic with other tokens compiles nothing: a hit's block copy and a chunk are graphs
of fixed shape, whatever the hit's or the prompt's length."""

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


def traffic(seed: int) -> dict:
    """Prompts of 5..60 tokens (the prompt bucket is 16), a shared 24-token system prompt in most, arriving
    over the steps; the shape of the mix is the same for every seed, the tokens are not."""
    values = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 128, (24,), generator=values).tolist()
    arrivals: dict = {}
    for i, (shared, own, new, step) in enumerate(
        [(24, 3, 4, 0), (0, 40, 3, 0), (24, 9, 5, 2), (8, 5, 2, 3), (24, 30, 3, 6), (0, 5, 4, 9), (16, 2, 3, 12)]
    ):
        prompt = system[:shared] + torch.randint(3, 128, (own,), generator=values).tolist()
        params = SamplingParams(do_sample=True, seed=seed + i) if i % 2 else SamplingParams()
        arrivals.setdefault(step, []).append(GenerationRequest(prompt, new, params))
    return arrivals


def test_chunks_and_prefix_hits_compile_nothing_once_warm(xla_models):
    model, _, _ = xla_models("qwen3")
    engine = engine_for(
        model,
        ShapePlan(batch_sizes=[2], prompt_lengths=[16], kv_lengths=[64], max_model_len=64, extend_widths=[(8, 1)]),
    )
    loop = GenerationLoop(
        engine, compile_settings(model, GenerationConfig()), chunked_prefill=8, prefix_caching=True, prefix_block_size=4
    )
    warm = run_loop(loop, traffic(seed=1))
    hits = loop.prefix.hits
    before = runtime.counters()
    out = run_loop(loop, traffic(seed=2))
    grown = runtime.counters() - before
    assert len(warm) == len(out) == 7 and loop.chunks > 0 and loop.prefix.hits > hits
    assert grown.uncached_compiles == 0, grown
