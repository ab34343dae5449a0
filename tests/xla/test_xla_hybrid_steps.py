"""A hybrid model (Qwen3.5) on XLA through chunked prefill and prompt-lookup speculation together, counted by XLA
itself (`UncachedCompile`): the counted positions, the per-position states of a verify step and their rollback are
graphs of fixed shape, so traffic that warmed them compiles nothing when it runs again with other tokens; and every
request gets transformers' greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed here: `make test-xla` runs these in its own venv")

import torch  # noqa: E402

from staticformers import ShapePlan  # noqa: E402
from staticformers.generation.engines import compile_settings, engine_for  # noqa: E402
from staticformers.backends.xla import runtime  # noqa: E402
from staticformers.generation.generation_config import GenerationConfig  # noqa: E402
from staticformers.generation.loop import GenerationLoop, GenerationRequest  # noqa: E402
from staticformers.generation.speculative.prompt_lookup import PromptLookup  # noqa: E402
from staticformers.generation.speculative.step import Speculator  # noqa: E402

from loop_driver import run_loop  # noqa: E402
from xla_support import hf_greedy  # noqa: E402


def traffic(seed: int) -> tuple[dict, dict]:
    """Prompts of 6..30 tokens (the prompt bucket is 16, chunks 8), most repeating a span so that lookups propose,
    arriving over the steps; the mix's shape is the same for every seed, the tokens are not."""
    values = torch.Generator().manual_seed(seed)
    arrivals, prompts = {}, {}
    for i, (span, repeats, own, new, step) in enumerate(
        [(5, 4, 2, 8, 0), (0, 0, 30, 5, 0), (6, 2, 0, 7, 3), (4, 3, 11, 6, 5)]
    ):
        part = torch.randint(3, 128, (span,), generator=values).tolist()
        prompt = part * repeats + torch.randint(3, 128, (own,), generator=values).tolist()
        prompts[i] = (prompt, new)
        arrivals.setdefault(step, []).append(GenerationRequest(prompt, new, request_id=i))
    return arrivals, prompts


def test_chunks_and_verification_on_a_hybrid_compile_nothing_once_warm(xla_models):
    model, hf, _ = xla_models("qwen3_5")
    engine = engine_for(
        model,
        ShapePlan(batch_sizes=[2], prompt_lengths=[16], kv_lengths=[48], max_model_len=48, extend_widths=[(8, 1)]),
    )
    spec = Speculator(PromptLookup(3))
    loop = GenerationLoop(engine, compile_settings(model, GenerationConfig()), speculator=spec, chunked_prefill=8)
    arrivals, _ = traffic(seed=1)
    run_loop(loop, arrivals)
    arrivals, prompts = traffic(seed=2)
    before = runtime.counters()
    out = run_loop(loop, arrivals)
    grown = runtime.counters() - before
    assert grown.uncached_compiles == 0, grown
    assert loop.chunks > 0 and spec.num_accepted_tokens > 0
    for i, (prompt, new) in prompts.items():
        assert out[i] == hf_greedy(hf, prompt, new), i
