"""The server with `--enable-prefix-caching` and `--enable-chunked-prefill`: a prompt that hits answers as
when it missed, and `/metrics` counts the prefix cache's queries and hits in prompt tokens
(vLLM's `prefix_cache_queries`, `prefix_cache_hits`, under our prefix)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from loop_driver import run_loop  # noqa: E402
from staticformers.generation.engines import engine_for  # noqa: E402
from staticformers.generation.loop import GenerationLoop, GenerationRequest  # noqa: E402
from staticformers.generation.plan import PlanError  # noqa: E402
from staticformers.generation.sampling import SamplingParams  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state, serving_plan  # noqa: E402


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line.startswith(f"staticformers:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not on /metrics")


def test_prefix_hits_answer_as_misses_and_are_counted_in_tokens(tmp_path):
    from tiny import save_served

    folder = save_served("qwen3", tmp_path / "served")
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    opts = ServeOptions(
        model=folder,
        served_model_name="tiny",
        backend="eager",
        max_batch_size=4,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        block_size=8,
    )
    loop = build_loop(model, opts)
    # 64 tokens a chunk step: a batch of 4 chunks 16 tokens a row, a prompt chunking alone 64
    assert loop.chunk == 64 and [loop.plan.chunk_width_at(b) for b in loop.plan.batch_sizes] == [64, 32, 16]
    server = Server(build_state(model, tok, loop, opts), grace=2.0)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        system = list(range(10, 60))  # 50 prompt tokens shared
        asked = [system + [70, 71], system + [70, 71], system[:20] + [90, 91, 92]]
        texts = [
            client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0).choices[0].text
            for ids in asked
        ]
        assert texts[1] == texts[0]  # computed from the pool's blocks and a 4-token chunk, or all prefilled
        assert metric(server.url, "prefix_cache_queries_total") == sum(len(p) for p in asked)
        assert metric(server.url, "prefix_cache_hits_total") == 0 + 48 + 16
    finally:
        server.stop()
    alone = GenerationLoop(engine_for(model), loop.settings)  # the same engine without a pool: the partial hit's answer
    want = run_loop(alone, {0: [GenerationRequest(asked[2], 6, SamplingParams(), request_id=0)]})[0]
    want = want[: want.index(tok.eos_token_id)] if tok.eos_token_id in want else want
    assert texts[2] == tok.decode(want, skip_special_tokens=True)


def test_a_token_budget_below_one_token_a_row_is_refused(tmp_path):
    from tiny import save_served

    folder = save_served("qwen3", tmp_path / "served")
    model = AutoModelForCausalLM.from_pretrained(folder)
    opts = ServeOptions(model=folder, max_batch_size=8, enable_chunked_prefill=True, max_num_batched_tokens=4)
    with pytest.raises(PlanError, match="--max-num-batched-tokens 4 is less than the largest batch bucket"):
        serving_plan(model, opts)
