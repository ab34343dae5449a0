"""The server on block caches (`--num-gpu-blocks-override`, `--kv-cache-memory-bytes`, `--gpu-memory-utilization`),
through the `openai` client on 127.0.0.1: concurrent greedy answers equal `generate()` on a pool so small that
requests are preempted and resumed, /metrics reports the pool's use and the preemptions, a request larger than
the pool is a 400 naming it, and the three sizes resolve to blocks (or are refused in one sentence)."""

from __future__ import annotations

import threading

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig  # noqa: E402
from staticformers.models.block_kv_cache import KVBlocks  # noqa: E402
from staticformers.serving.kv_budget import kv_blocks, parse_bytes  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402

EAGER = CompileConfig(backend="eager")
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tiny import save_served

    return save_served("qwen3", tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(folder)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"staticformers:{name}{{") or line.startswith(f"staticformers:{name} ")
    )


def test_concurrent_answers_on_a_small_pool_equal_generate(model, folder):
    """Six concurrent completions of 24-40 tokens on a pool of 6 blocks of 16 positions (4 slots): requests are
    preempted and resumed, and each answer's tokens equal `generate()`'s; the pool is empty afterwards."""
    tok = AutoTokenizer.from_pretrained(folder)
    opts = ServeOptions(
        model=folder,
        served_model_name="tiny",
        backend="eager",
        max_batch_size=4,
        block_size=16,
        num_gpu_blocks_override=6,
    )
    loop = build_loop(model, opts)
    server = Server(build_state(model, tok, loop, opts), grace=2.0)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        prompts = ["The for statement", "A while loop runs", "Functions return", "Lists hold", "Sets of", "Import"]
        lengths = [30, 40, 24, 36, 28, 32]
        got: dict = {}

        def ask(i):
            r = client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0, extra_body={"ignore_eos": True}
            )
            got[i] = r.choices[0]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert len(got) == len(prompts)
        for i, p in enumerate(prompts):
            ids = tok(p)["input_ids"]
            want = model.generate(
                torch.tensor([ids]), max_new_tokens=lengths[i], do_sample=False, compile_config=EAGER, eos_token_id=None
            )[0, len(ids) :].tolist()
            assert got[i].text == tok.decode(want, skip_special_tokens=True), i
        assert metric(server.url, "num_preemptions_total") > 0
        assert metric(server.url, "kv_cache_usage_perc") == 0.0
        assert loop.blocks_used == 0
        too_long = client.with_options(max_retries=0)
        with pytest.raises(openai.BadRequestError, match="the KV pool has 6"):
            too_long.completions.create(model="tiny", prompt="The for statement", max_tokens=120, temperature=0)
    finally:
        server.stop()


def test_prefix_caching_shares_the_pools_blocks(model, folder):
    """--enable-prefix-caching on a block pool: a second request that starts like the first finds its prefix's
    blocks (counted on /metrics in prompt tokens, as vLLM counts), and both answers equal `generate()`'s."""
    tok = AutoTokenizer.from_pretrained(folder)
    opts = ServeOptions(
        model=folder,
        served_model_name="tiny",
        backend="eager",
        max_batch_size=4,
        block_size=16,
        num_gpu_blocks_override=32,
        enable_prefix_caching=True,
    )
    server = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        system = " ".join(["The for statement iterates over the items of any sequence"] * 6)
        for question in (" Lists hold", " Sets of"):
            ids = tok(system + question)["input_ids"]
            want = model.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False, compile_config=EAGER, eos_token_id=None
            )[0, len(ids) :].tolist()
            r = client.completions.create(
                model="tiny", prompt=system + question, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
        assert metric(server.url, "prefix_cache_hits_total") >= 16
    finally:
        server.stop()


def test_the_pool_sizes(model):
    per_block = 16 * KVBlocks.bytes_for(model, 0, 1)  # one position's bytes, null block aside: (0 + 1) x 1
    assert kv_blocks(model, 9, None, None, 16) == 9
    assert kv_blocks(model, None, 11 * per_block, None, 16) == 10  # the null block counts against the budget
    assert kv_blocks(model, None, None, None, 16) is None
    assert kv_blocks(model, None, None, 0.01, 16) >= 1  # the host reports its available memory
    with pytest.raises(ValueError, match="holds no block of 16 positions"):
        kv_blocks(model, None, per_block, None, 16)
    with pytest.raises(ValueError, match="must be a fraction in"):
        kv_blocks(model, None, None, 1.5, 16)
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2GB") == 2 * 10**9 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes("lots")
