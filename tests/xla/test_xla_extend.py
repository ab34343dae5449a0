"""The extend step on XLA (what speculative verification and chunked prefill run): one XLA compilation per
declared extend shape, none when it runs again with other tokens, positions and kept indices, and the
logits of transformers' forward over the whole sequence."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed here: `make test-xla` runs these in its own venv")

import torch  # noqa: E402

from staticformers.generation.engines import compile_settings  # noqa: E402
from staticformers.backends.xla import runtime  # noqa: E402
from staticformers.generation.engine import Engine  # noqa: E402
from staticformers.generation.generation_config import GenerationConfig  # noqa: E402
from staticformers.generation.plan import ShapePlan  # noqa: E402

from xla_support import PLAN  # noqa: E402

import tolerances as tol  # noqa: E402


def test_extend_compiles_once_per_shape_and_gives_transformers_logits(xla_models):
    model, hf, _ = xla_models("qwen3")
    engine = Engine(model, ShapePlan(**PLAN, extend_widths=[(4, 4)]))
    settings = compile_settings(model, GenerationConfig())
    device = model.device
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 9, 12, 7)]
    cache = engine.cache(4, 40)
    results, grown = [], []
    with torch.no_grad():
        engine.prefill(settings, prompts, cache, [0, 1, 2, 3])
        for step in range(3):  # three different extensions of every row, each from its own position
            tokens = torch.randint(3, 128, (4, 4), generator=gen)
            positions = torch.tensor([[len(p) + 4 * step + j for j in range(4)] for p in prompts])
            before = runtime.counters()
            _, logits = engine.extend(
                settings, cache, tokens.to(device), positions.to(device), torch.arange(4).repeat(4, 1).to(device)
            )
            engine.backend.flush(device)
            results.append((tokens, logits.cpu()))
            grown.append(runtime.counters() - before)
    assert grown[0].uncached_compiles >= 1
    assert [g.uncached_compiles for g in grown[1:]] == [0, 0], grown
    for i, p in enumerate(prompts):
        ids = p + sum((t[i].tolist() for t, _ in results), [])
        with torch.no_grad():
            full = hf(torch.tensor([ids])).logits[0]
        for step, (_, logits) in enumerate(results):
            start = len(p) + 4 * step
            tol.assert_close(logits[i], full[start : start + 4])
