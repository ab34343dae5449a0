"""Block KV caches (`kv_blocks`): each request holds the pool blocks its tokens fill, read through a block table.

Checked against full forwards without any cache (greedy tokens) and against the loop on static caches: mixed
traffic with chunks and speculation, a pool so small that rows are preempted and resumed by recomputation
(greedy and seeded sampling finish identically), latent attention, the pool never leaking a block (checked after
every step), no graph compiled after warm-up, more rows running than static caches of the same bytes hold, and
every refusal in one sentence."""

from __future__ import annotations

import random

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.api.generate import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.kv_blocks import BlockAllocator, blocks_for
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.sampling import SamplingParams
from staticformers.generation.speculative.prompt_lookup import PromptLookup
from staticformers.generation.speculative.step import Speculator
from staticformers.models.block_kv_cache import BlockKVCache, KVBlocks
from staticformers.models.kv_cache import KVCache

EAGER = CompileConfig(backend="eager")
BLOCK = 16
CHUNK = 16


def plan():
    return ShapePlan(batch_sizes=[1, 2, 4, 8], prompt_lengths=[16, 32], kv_lengths=[64, 128], max_model_len=128,
                     extend_widths=((CHUNK, 1),))


def prompts(lengths, seed=0, vocab=128):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy(model, prompt, n):
    out = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(prompt):]


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, plan())
    return model, engine, compile_settings(model, GenerationConfig(), EAGER)


def run(loop, arrivals: dict, max_steps: int = 5_000) -> dict:
    """Step the loop, adding `arrivals[step]` before each step; after every step the pool's account matches the
    rows' blocks (no leak, nothing held twice). Returns id -> tokens and records the most rows running."""
    out, step, loop.most_running = {}, 0, 0
    while arrivals or not loop.idle:
        for request in arrivals.pop(step, []):
            loop.add(request)
        for event in loop.step():
            assert event.error is None, event.error
            out.setdefault(event.request_id, []).append(event.token)
        held = [b for r in loop.rows.values() for b in r.blocks]
        assert len(held) == len(set(held)) == loop.blocks_used, "a block leaked or is held twice"
        assert all(not r.blocks for r in loop.waiting)
        loop.most_running = max(loop.most_running, loop.running)
        step += 1
        assert step < max_steps
    assert loop.blocks_used == 0
    return out


def test_tokens_equal_full_forwards_and_static_caches_under_mixed_traffic(qwen3):
    """Prompts of 1..90 tokens (long ones chunked) joining at different steps, on a pool large enough that no row
    is preempted: every request's tokens equal its greedy full-forward tokens and the static loop's."""
    model, engine, settings = qwen3
    lengths, answers = [30, 5, 90, 17, 1, 33, 9, 64], [9, 20, 7, 12, 15, 4, 30, 11]
    rows = prompts(lengths, seed=1)

    def arrivals():
        return {i * 2: [GenerationRequest(p, n, request_id=i)] for i, (p, n) in enumerate(zip(rows, answers))}

    blocks = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=64, kv_block_size=BLOCK)
    got = run(blocks, arrivals())
    assert blocks.preemptions == 0
    static = run_static(GenerationLoop(engine, settings, chunked_prefill=CHUNK), arrivals())
    for i, (p, n) in enumerate(zip(rows, answers)):
        assert got[i] == static[i] == greedy(model, p, n), i


def run_static(loop, arrivals):
    out, step = {}, 0
    while arrivals or not loop.idle:
        for request in arrivals.pop(step, []):
            loop.add(request)
        for event in loop.step():
            assert event.error is None, event.error
            out.setdefault(event.request_id, []).append(event.token)
        step += 1
    return out


def test_a_small_pool_preempts_the_newest_rows_and_they_finish_identically(qwen3):
    """Six requests of up to 70 positions each on a pool of 10 blocks of 16 (160 positions): rows are preempted,
    resumed by prefilling their prompt and what they generated, and every request's greedy tokens are its full
    forward's; seeded sampling rows give the tokens they give on a pool that never preempts."""
    model, engine, settings = qwen3
    rows = prompts([20, 40, 12, 33, 27, 8], seed=2)
    news = [30, 25, 40, 20, 35, 45]

    def arrivals(sampled):
        out = {}
        for i, (p, n) in enumerate(zip(rows, news)):
            params = SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=100 + i) if sampled and i % 2 \
                else SamplingParams()
            out.setdefault(i // 2, []).append(GenerationRequest(p, n, params, request_id=i))
        return out

    small = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=10, kv_block_size=BLOCK)
    got = run(small, arrivals(False))
    assert small.preemptions > 0
    for i, (p, n) in enumerate(zip(rows, news)):
        assert got[i] == greedy(model, p, n), i
    small_sampled = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=10, kv_block_size=BLOCK)
    sampled = run(small_sampled, arrivals(True))
    assert small_sampled.preemptions > 0
    roomy = run(GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=64, kv_block_size=BLOCK),
                arrivals(True))
    assert sampled == roomy


def test_more_rows_run_than_static_caches_of_the_same_bytes_hold(qwen3):
    """A pool of the bytes of one static row of 128 positions (8 blocks of 16) runs 4 short requests at once;
    static caches of those bytes hold one row."""
    model, engine, settings = qwen3
    per_row = KVCache.bytes_for(model, 1, 128)
    blocks = KVBlocks.blocks_in(model, per_row, BLOCK)
    assert blocks == 7  # the null block is counted against the budget
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=blocks, kv_block_size=BLOCK)
    rows = prompts([10, 12, 9, 11], seed=3)
    got = run(loop, {0: [GenerationRequest(p, 6, request_id=i) for i, p in enumerate(rows)]})
    assert loop.most_running == 4 and loop.preemptions == 0
    for i, p in enumerate(rows):
        assert got[i] == greedy(model, p, 6)


def test_speculation_runs_on_block_caches(qwen3):
    """Prompt-lookup speculation (k=3) on a small pool: the verify step's positions are reserved before it runs;
    tokens equal full forwards."""
    model, engine, settings = qwen3
    rows = [(list(range(5, 25)) * 3)[:50], prompts([30], seed=4)[0]]
    speculator = Speculator(PromptLookup(3))
    loop = GenerationLoop(engine, settings, speculator=speculator, chunked_prefill=CHUNK, kv_blocks=9,
                          kv_block_size=BLOCK)
    got = run(loop, {0: [GenerationRequest(p, 30, request_id=i) for i, p in enumerate(rows)]})
    assert speculator.num_accepted_tokens > 0
    for i, p in enumerate(rows):
        assert got[i] == greedy(model, p, 30), i


def test_random_traffic_with_cancels_and_preemption(qwen3):
    """Random joins, cancels and lengths on a pool that runs out: every request that is not cancelled gets its
    greedy tokens; a cancelled one gets a prefix of them; nothing leaks (checked after every step)."""
    model, engine, settings = qwen3
    rng = random.Random(7)
    pool = [(p, greedy(model, p, 40)) for p in prompts([3, 14, 26, 41, 60], seed=5)]
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=12, kv_block_size=BLOCK)
    wanted, got, cancelled, step, rid = {}, {}, set(), 0, 0
    held_counts = []
    while step < 400 or not loop.idle:
        if step < 400 and rng.random() < 0.15:
            prompt, answer = pool[rng.randrange(len(pool))]
            n = rng.randint(1, 40)
            loop.add(GenerationRequest(prompt, n, request_id=rid))
            wanted[rid] = answer[:n]
            rid += 1
        if rid and rng.random() < 0.03:
            victim = rng.randrange(rid)
            if loop.cancel(victim):
                cancelled.add(victim)
        for event in loop.step():
            assert event.error is None, event.error
            got.setdefault(event.request_id, []).append(event.token)
        held = [b for r in loop.rows.values() for b in r.blocks]
        assert len(held) == len(set(held)) == loop.blocks_used
        held_counts.append(loop.blocks_used)
        step += 1
        assert step < 5_000
    assert loop.blocks_used == 0 and loop.preemptions > 0 and max(held_counts) <= 12
    for r, answer in wanted.items():
        tokens = got.get(r, [])
        if r in cancelled:
            assert tokens == answer[:len(tokens)], r
        else:
            assert tokens == answer, r


def test_nothing_compiles_after_warm_up_under_joins_moves_and_preemption(qwen3):
    """The same traffic twice on a small pool: the second pass (preemptions, joins, batch moves) adds no graph."""
    model, engine, settings = qwen3
    rows = prompts([20, 40, 12, 33, 27, 8, 50], seed=6)

    def arrivals():
        return {i: [GenerationRequest(p, 25, request_id=i)] for i, p in enumerate(rows)}

    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=10, kv_block_size=BLOCK)
    first = run(loop, arrivals())
    graphs = engine.graph_count()
    preempted = loop.preemptions
    assert run(loop, arrivals()) == first
    assert engine.graph_count() == graphs and loop.preemptions == 2 * preempted > 0


@pytest.mark.parametrize("family", ["deepseek-v3", "gemma2", "mistral-window"])
def test_latent_attention_and_sliding_windows_on_block_caches(tiny_checkpoints, family):
    """DeepSeek-V3's latent cache (keys only, the values a view of them) and sliding-window layers (Gemma 2's
    alternating, Mistral's window of 5) through blocks, on a pool that preempts: tokens equal full forwards'."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    engine = engine_for(model, plan())
    settings = compile_settings(model, GenerationConfig(), EAGER)
    rows = prompts([20, 7, 45], seed=8)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=8, kv_block_size=BLOCK)
    got = run(loop, {i: [GenerationRequest(p, 20, request_id=i)] for i, p in enumerate(rows)})
    for i, p in enumerate(rows):
        assert got[i] == greedy(model, p, 20), i


def test_block_cache_reads_what_a_static_cache_reads():
    """The same writes through `update` and `insert` into a static cache and into a block cache whose rows hold
    scattered pool blocks: the keys and values each returns are equal at every written position."""
    torch.manual_seed(0)
    static = KVCache(1, 2, 2, 32, 4, torch.float32, torch.device("cpu"))
    pool = KVBlocks(1, 9, 8, 2, 4, torch.float32, torch.device("cpu"))
    blocks = BlockKVCache(pool, 2, 32)
    blocks.write_table({0: [7, 2, 5], 1: [1, 9, 3, 4]})
    k, v = torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4)
    slots = torch.tensor([1, 0])
    static.insert(slots, 0, k, v)
    blocks.insert(slots, 0, k, v)
    step_k, step_v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    positions = torch.tensor([[10, 11, 12], [10, 11, 12]])
    want = static.update(0, step_k, step_v, positions)
    have = blocks.update(0, step_k, step_v, positions)
    for w, h in zip(want, have):
        assert torch.equal(w[:, :, :13], h[:, :, :13])
    assert blocks.update(0, step_k, step_v, positions)[0].shape == (2, 2, 32, 4)


def test_the_allocator_hands_out_each_block_once():
    a = BlockAllocator(5)
    first = a.take(3)
    assert first == [1, 2, 3] and a.free == 2 and a.used == 3
    a.give_back([2])
    assert a.take(2) == [2, 4]
    with pytest.raises(ValueError, match="3 blocks asked, 1 free"):
        a.take(3)
    with pytest.raises(ValueError, match="Block 2 was given back but is not held"):
        a.give_back([2, 2])
    assert blocks_for(0, 16) == 0 and blocks_for(16, 16) == 1 and blocks_for(17, 16) == 2


def test_refusals_in_one_sentence(qwen3, tiny_checkpoints):
    model, engine, settings = qwen3
    with pytest.raises(ValueError, match="kv_blocks=0 must be a positive number of blocks"):
        GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=0)
    with pytest.raises(ValueError, match="kv_block_size=48 does not divide the plan's KV lengths"):
        GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=8, kv_block_size=48)
    with pytest.raises(ValueError, match="prefix caching .* cannot run with kv_blocks"):
        GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=8, prefix_caching=True)
    with pytest.raises(ValueError, match="turn chunked prefill on with kv_blocks"):
        GenerationLoop(engine, settings, kv_blocks=8, kv_block_size=BLOCK)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=3, kv_block_size=BLOCK)
    with pytest.raises(ValueError, match="needs 59 cache positions, 4 blocks of 16, and the KV pool has 3"):
        loop.add(GenerationRequest(list(range(3, 23)), 40))
    assert loop.idle
    hybrid = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3_5"))
    hybrid_engine = engine_for(hybrid, plan())
    with pytest.raises(ValueError, match="linear-attention layers keep one state per request"):
        GenerationLoop(hybrid_engine, settings, chunked_prefill=CHUNK, kv_blocks=8, kv_block_size=BLOCK)
