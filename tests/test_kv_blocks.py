"""Block KV caches (`kv_blocks`): each request holds the pool blocks its tokens fill, read through a block table,
and with prefix caching shares the cached blocks of its prompt's prefix.

Checked against full forwards without any cache (greedy tokens) and against the loop on static caches: mixed
traffic with chunks and speculation, a pool so small that rows are preempted and resumed by recomputation
(greedy and seeded sampling finish identically), latent attention, the pool never leaking a block (checked after
every step), no graph compiled after warm-up, more rows running than static caches of the same bytes hold, and
every refusal in one sentence. Prefix caching by sharing: hits, misses and partial hits give the tokens of no
caching, a hit copies nothing and compiles nothing, blocks two rows share are counted once, a freed row's slot
writes into no block it held, an adapter's prefix serves neither the base nor another adapter, and an adapter
reloaded under its name answers as the new one. The scheduler's property test: random joins under two adapters and
none, cancels, prefix hits, preemption and adapter reloads, against the static loop."""

from __future__ import annotations

import random

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.kv_blocks import NULL_BLOCK, BlockAllocator, blocks_for
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.sampling import SamplingParams
from staticformers.generation.speculative.prompt_lookup import PromptLookup
from staticformers.generation.speculative.step import Speculator
from staticformers.models.block_kv_cache import BlockKVCache, KVBlocks
from staticformers.models.kv_cache import KVCache

EAGER = CompileConfig(backend="eager")
BLOCK = 16
CHUNK = 16


def plan(batch_sizes=(1, 2, 4, 8), kv_lengths=(64, 128)):
    return ShapePlan(
        batch_sizes=list(batch_sizes),
        prompt_lengths=[16, 32],
        kv_lengths=list(kv_lengths),
        max_model_len=128,
        extend_widths=((CHUNK, 1),),
    )


def prompts(lengths, seed=0, vocab=128):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy(model, prompt, n):
    out = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(prompt) :]


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
        if loop.blocks is not None:
            for group in loop.scheduler.groups:  # the model's blocks, and a window group's where it has one
                held = [b for r in loop.rows.values() for b in getattr(r, group.attr) if b != NULL_BLOCK]
                assert len(held) == group.pool.references and len(set(held)) == group.pool.used, "a block leaked"
                assert all(not getattr(r, group.attr) for r in loop.waiting)
            if len(loop.scheduler.groups) > 1:  # the same logical blocks in each group
                assert all(len(r.blocks) == len(r.window_blocks) for r in loop.rows.values())
        loop.most_running = max(loop.most_running, loop.running)
        step += 1
        assert step < max_steps
    assert loop.blocks_used == 0
    assert all(group.pool.used == 0 for group in getattr(loop.scheduler, "groups", []))
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
    static = run(GenerationLoop(engine, settings, chunked_prefill=CHUNK), arrivals())
    for i, (p, n) in enumerate(zip(rows, answers)):
        assert got[i] == static[i] == greedy(model, p, n), i


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
            params = (
                SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=100 + i)
                if sampled and i % 2
                else SamplingParams()
            )
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
    roomy = run(
        GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=64, kv_block_size=BLOCK), arrivals(True)
    )
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


def test_a_prompt_chunks_apart_from_the_decoding_rows(qwen3, monkeypatch):
    """Three rows decoding and a 70-token prompt joining: its chunks run in a batch of 1 over the KV length its own
    context needs, each after a decode step of the batch (the decoding rows take a token every loop step, and no
    chunk step computes a chunk's width for them); the tokens are full forwards'."""
    model, engine, settings = qwen3
    short, long = prompts([6, 7, 9], seed=21), prompts([70], seed=22)[0]
    shapes = []
    extend = engine.extend

    def spying(settings_, cache, tokens, *rest, **kw):
        shapes.append((cache.batch, cache.max_length, tokens.shape[1]))
        return extend(settings_, cache, tokens, *rest, **kw)

    monkeypatch.setattr(engine, "extend", spying)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=64, kv_block_size=8)
    for i, p in enumerate(short):
        loop.add(GenerationRequest(p, 40, request_id=i))
    got: dict = {}
    for _ in range(3):  # their prefill and first decode steps
        for event in loop.step():
            got.setdefault(event.request_id, []).append(event.token)
    loop.add(GenerationRequest(long, 5, request_id="long"))
    tokens_per_step = []
    while not loop.idle:
        events = loop.step()
        tokens_per_step.append(sum(e.request_id == 0 for e in events))
        for event in events:
            got.setdefault(event.request_id, []).append(event.token)
    # after the admission's first 16 tokens, chunks at 16, 32, 48 and 64: K follows the long row's own context
    assert shapes == [(1, 64, CHUNK)] * 3 + [(1, 128, CHUNK)]
    assert tokens_per_step[0] == 0 and all(tokens_per_step[1 : 1 + len(shapes)])  # a token at every chunk's step
    for i, p in enumerate(short):
        assert got[i] == greedy(model, p, 40), i
    assert got["long"] == greedy(model, long, 5)


def test_a_chunk_budget_widens_a_lone_prompts_chunks_and_rows_finish_as_full_forwards(qwen3, monkeypatch):
    """With a chunk budget of 64 tokens (widths 32, 32, 16 and 8 at batches 1, 2, 4 and 8; the largest prompt bucket
    caps the first two): a 70-token prompt joining three decoding rows prefills 32 tokens, then chunks apart 32 at a
    time (one width for every batch took 16: four chunk steps, not two). Five long prompts at once on a pool small
    enough to preempt: a prefilling row preempted widens the others' next chunks, and no chunk writes a position its
    row holds no block for; every request's tokens are its full forward's, nothing leaks, and the same traffic again
    compiles nothing."""
    model, engine, settings = qwen3
    budget = plan().with_chunk_tokens(64)
    assert [budget.chunk_width_at(b) for b in budget.batch_sizes] == [32, 32, 16, 8]
    shapes, unheld, first_chunks = [], [], []
    extend, prefill = engine.extend, engine.prefill

    def held(cache, row: int, positions) -> None:  # on block caches a row writes only into blocks it holds
        table = cache.table.cpu() if isinstance(cache, BlockKVCache) else None
        if table is not None and (table[row] != NULL_BLOCK).any():  # (a free row writes into the null block)
            unheld.extend(p for p in positions if table[row, p // BLOCK] == NULL_BLOCK)

    def spying(settings_, cache, tokens, positions, *rest, **kw):
        shapes.append((cache.batch, cache.max_length, tokens.shape[1]))
        for i in range(cache.batch):
            held(cache, i, positions[i].tolist())
        return extend(settings_, cache, tokens, positions, *rest, **kw)

    def prefilling(settings_, prompts_, cache, slots, *rest, **kw):
        first_chunks.append(max(len(p) for p in prompts_))
        for p, slot in zip(prompts_, slots):
            held(cache, slot, range(len(p)))
        return prefill(settings_, prompts_, cache, slots, *rest, **kw)

    monkeypatch.setattr(engine, "extend", spying)
    monkeypatch.setattr(engine, "prefill", prefilling)
    short, long = prompts([6, 7, 9], seed=21), prompts([70], seed=22)[0]
    loop = GenerationLoop(engine, settings, plan=budget, chunked_prefill=True, kv_blocks=64, kv_block_size=BLOCK)
    arrivals = {0: [GenerationRequest(p, 12, request_id=i) for i, p in enumerate(short)]}
    got = run(loop, {**arrivals, 3: [GenerationRequest(long, 5, request_id="long")]})
    assert shapes == [(1, 64, 32), (1, 128, 32)] and first_chunks == [9, 32]  # the long prompt joins alone
    assert got["long"] == greedy(model, long, 5)
    assert all(got[i] == greedy(model, p, 12) for i, p in enumerate(short))

    rows, news = prompts([80, 80, 50, 70, 90], seed=0), [11, 24, 6, 17, 9]

    def traffic():
        return {0: [GenerationRequest(p, n, request_id=i) for i, (p, n) in enumerate(zip(rows, news))]}

    small = GenerationLoop(engine, settings, plan=budget, chunked_prefill=True, kv_blocks=10, kv_block_size=BLOCK)
    widened = []
    make_room = small._make_room

    def counting(slots):
        before = small.scheduler.chunk_now()
        make_room(slots)
        widened.append(small.scheduler.chunk_now() > before)

    monkeypatch.setattr(small, "_make_room", counting)
    start = len(first_chunks)
    first = run(small, traffic())
    assert small.preemptions > 0 and any(widened) and not unheld
    assert {t for _, _, t in shapes[2:]} >= {16, 32}  # chunks of four rows, then of fewer
    assert first_chunks[start] == 8  # five rows joining at once: a batch of 8's first chunks, 64 / 8 tokens each
    for i, (p, n) in enumerate(zip(rows, news)):
        assert first[i] == greedy(model, p, n), i
    graphs, preempted = engine.graph_count(), small.preemptions
    assert run(small, traffic()) == first
    assert engine.graph_count() == graphs and small.preemptions == 2 * preempted and not unheld

    # static caches (the batch's own step chunks at its bucket's width), and prefixes shared under the budget
    static = run(GenerationLoop(engine, settings, plan=budget, chunked_prefill=True), traffic())
    assert static == first
    system = prompts([40], seed=3)[0]
    shared = [system + p for p in prompts([3, 9, 20], seed=4)]
    pool = GenerationLoop(
        engine, settings, plan=budget, chunked_prefill=True, kv_blocks=12, kv_block_size=BLOCK, prefix_caching=True
    )
    got = run(pool, {i * 3: [GenerationRequest(p, 10, request_id=i)] for i, p in enumerate(shared)})
    assert pool.prefix_counts()[1] > 0 and not unheld
    assert all(got[i] == greedy(model, p, 10) for i, p in enumerate(shared))


def test_decoding_rows_split_by_context(tiny_checkpoints, monkeypatch):
    """Three short rows and one with a 300-token prompt decoding together (K = 512): a gather of 512 positions per
    row reads far more than the tiny model's weights, so the decode steps run the short rows over K = 64 in a batch
    of 4 and the long one alone over K = 512 (`step_split.py`); the tokens are full forwards'."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    wide = ShapePlan(
        batch_sizes=[1, 2, 4],
        prompt_lengths=[16, 32],
        kv_lengths=[64, 512],
        max_model_len=512,
        extend_widths=((CHUNK, 1),),
    )
    engine = engine_for(model, wide)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    rows = prompts([6, 7, 9, 300], seed=23)
    shapes = []
    decode = engine.decode

    def spying(settings_, cache, *rest, **kw):
        shapes.append((cache.batch, cache.max_length))
        return decode(settings_, cache, *rest, **kw)

    monkeypatch.setattr(engine, "decode", spying)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=96, kv_block_size=8)
    got = run(loop, {0: [GenerationRequest(p, 20, request_id=i) for i, p in enumerate(rows)]})
    assert (4, 64) in shapes and (1, 512) in shapes and (4, 512) not in shapes
    for i, p in enumerate(rows):
        assert got[i] == greedy(model, p, 20), i


def test_speculation_runs_on_block_caches(qwen3):
    """Prompt-lookup speculation (k=3) on a small pool: the verify step's positions are reserved before it runs;
    tokens equal full forwards."""
    model, engine, settings = qwen3
    rows = [(list(range(5, 25)) * 3)[:50], prompts([30], seed=4)[0]]
    speculator = Speculator(PromptLookup(3))
    loop = GenerationLoop(
        engine, settings, speculator=speculator, chunked_prefill=CHUNK, kv_blocks=9, kv_block_size=BLOCK
    )
    got = run(loop, {0: [GenerationRequest(p, 30, request_id=i) for i, p in enumerate(rows)]})
    assert speculator.num_accepted_tokens > 0
    for i, p in enumerate(rows):
        assert got[i] == greedy(model, p, 30), i


@pytest.mark.parametrize("shared", [False, True], ids=["no-prefix-caching", "prefix-caching"])
def test_random_traffic_with_cancels_and_preemption(qwen3, shared):
    """Random joins, cancels and lengths on a pool that runs out (with prefix caching, half the prompts share a
    32-token start): every request that is not cancelled gets its greedy tokens; a cancelled one gets a prefix of
    them; nothing leaks (checked after every step)."""
    model, engine, settings = qwen3
    rng = random.Random(7)
    system = tokens(32, 9)
    starts = prompts([3, 14, 26, 41, 60], seed=5) + [system + p for p in prompts([2, 9, 20], seed=6)]
    pool = [(p, greedy(model, p, 40)) for p in starts]
    loop = GenerationLoop(
        engine, settings, chunked_prefill=CHUNK, kv_blocks=12, kv_block_size=BLOCK, prefix_caching=shared
    )
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
        assert len(held) == loop.blocks.references and len(set(held)) == loop.blocks_used
        held_counts.append(loop.blocks_used)
        step += 1
        assert step < 5_000
    assert loop.blocks_used == 0 and loop.preemptions > 0 and max(held_counts) <= 12
    assert not shared or loop.prefix_counts()[1] > 0
    for r, answer in wanted.items():
        have = got.get(r, [])
        if r in cancelled:
            assert have == answer[: len(have)], r
        else:
            assert have == answer, r


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
    with pytest.raises(
        ValueError,
        match=r"The KV block size 48 \(kv_block_size, the server's --block-size\) "
        r"does not divide the plan's KV lengths",
    ):
        GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=8, kv_block_size=48)
    with pytest.raises(ValueError, match="turn chunked prefill on with kv_blocks"):
        GenerationLoop(engine, settings, kv_blocks=8, kv_block_size=BLOCK)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=3, kv_block_size=BLOCK)
    with pytest.raises(ValueError, match="needs 59 cache positions, 4 blocks of 16 at once, and the KV pool has 3"):
        loop.add(GenerationRequest(list(range(3, 23)), 40))
    assert loop.idle
    hybrid = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3_5"))
    hybrid_engine = engine_for(hybrid, plan())
    with pytest.raises(ValueError, match="linear-attention layers keep one state per request"):
        GenerationLoop(hybrid_engine, settings, chunked_prefill=CHUNK, kv_blocks=8, kv_block_size=BLOCK)


def tokens(n, seed, vocab=128):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_by_one(loop, requests) -> dict:
    """Each request alone, in order, on the same loop (its cached blocks left by the ones before)."""
    out = {}
    for r in requests:
        out.update(run(loop, {0: [r]}))
    return out


def sharing(engine, settings, blocks=64, **kw):
    return GenerationLoop(
        engine, settings, chunked_prefill=CHUNK, prefix_caching=True, kv_blocks=blocks, kv_block_size=8, **kw
    )


def test_prefix_hits_share_blocks_and_give_the_tokens_of_no_caching(qwen3):
    """Misses, hits and partial hits (blocks of 8) one after another, greedy and seeded: the tokens of no caching,
    counted as vLLM counts (prompt tokens looked up and found); a hit adds no graph."""
    model, engine, settings = qwen3
    system = tokens(40, 0)
    prompts = [
        system + tokens(5, 1),
        system + tokens(10, 2),
        system[:20] + tokens(10, 3),
        tokens(20, 4),
        system + tokens(5, 1),
        system,
    ]

    def requests():
        return [
            GenerationRequest(
                p,
                6,
                SamplingParams(do_sample=True, temperature=0.8, top_k=30, seed=11 + i) if i % 2 else SamplingParams(),
                request_id=i,
            )
            for i, p in enumerate(prompts)
        ]

    plain = one_by_one(GenerationLoop(engine, settings, chunked_prefill=CHUNK), requests())
    loop = sharing(engine, settings)
    warm = one_by_one(sharing(engine, settings), requests())
    graphs = engine.graph_count()
    assert one_by_one(loop, requests()) == warm == plain
    assert engine.graph_count() == graphs
    assert loop.prefix_counts() == (45 + 50 + 30 + 20 + 45 + 40, 0 + 40 + 16 + 0 + 40 + 32)
    assert loop.blocks.cached > 0 and loop.blocks.used == 0


def test_a_freed_rows_slot_writes_no_block_it_held(qwen3):
    """A row ends while others keep decoding: every step writes every row of the batch, a free one at position 0,
    so the freed slot's table must no longer name the blocks it held (its cached prefix's first block would be
    overwritten). A later hit on that prefix gives the tokens of no caching, and the slot's table row is null."""
    from staticformers.models.block_kv_cache import NULL_BLOCK

    model, engine, settings = qwen3
    system = tokens(40, 7)
    short, later = system + tokens(3, 8), system + tokens(4, 10)
    longs = {f"long{i}": tokens(11, 9 + 10 * i) for i in range(3)}  # four rows: the batch of 4 stays when one ends
    loop = sharing(engine, settings)
    loop.add(GenerationRequest(short, 2, request_id="short"))
    for name, prompt in longs.items():
        loop.add(GenerationRequest(prompt, 20, request_id=name))
    got: dict = {}
    freed = None
    checked = 0
    while not loop.idle:
        slots, ended = {r.request.request_id: s for s, r in loop.rows.items()}, freed
        for event in loop.step():
            got.setdefault(event.request_id, []).append(event.token)
            if event.request_id == "short" and event.finish_reason is not None:
                freed = slots["short"]
        if ended is not None and loop.running:  # a step has run since it ended
            assert ended not in loop.rows and (loop.cache.table[ended] == NULL_BLOCK).all()
            checked += 1
    assert checked > 5
    assert got["short"] == greedy(model, short, 2)
    assert all(got[name] == greedy(model, prompt, 20) for name, prompt in longs.items())
    hits = loop.prefix_counts()[1]
    assert run(loop, {0: [GenerationRequest(later, 6, request_id="later")]})["later"] == greedy(model, later, 6)
    assert loop.prefix_counts()[1] == hits + 40


def test_rows_running_together_hold_one_copy_of_their_shared_prefix(qwen3):
    """Three requests with a 64-token system prompt, the second and third arriving once the first's prompt is in:
    while they run, the prefix's 8 blocks are held by all three (references counted per row, blocks once)."""
    model, engine, settings = qwen3
    system = tokens(64, 5)
    prompts = [system + tokens(3, 6 + i) for i in range(3)]
    loop = sharing(engine, settings)
    arrivals = {
        0: [GenerationRequest(prompts[0], 30, request_id=0)],
        6: [GenerationRequest(p, 20, request_id=i + 1) for i, p in enumerate(prompts[1:])],
    }
    most_shared = 0
    out, step = {}, 0
    while arrivals or not loop.idle:
        for r in arrivals.pop(step, []):
            loop.add(r)
        for e in loop.step():
            out.setdefault(e.request_id, []).append(e.token)
        most_shared = max(most_shared, loop.blocks.references - loop.blocks.used)
        step += 1
    assert most_shared >= 2 * 8
    for i, p in enumerate(prompts):
        assert out[i] == greedy(model, p, 30 if i == 0 else 20), i
    assert loop.prefix_counts()[1] == 2 * 64


def adapter_model(tiny_checkpoints, tmp_path):
    """A tiny Qwen3 batching adapters a and b (the same LoRA weights under two names, from folder "old"), and the
    folders of two different adapters ("old", "new") to load."""
    from staticformers import LoraConfig

    path = tiny_checkpoints("qwen3")
    folders = {}
    for name, seed in (("old", 1), ("new", 2)):
        donor = AutoModelForCausalLM.from_pretrained(path)
        torch.manual_seed(seed)
        donor.add_adapter(
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
        )
        with torch.no_grad():
            for n, p in donor.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        folders[name] = tmp_path / name
        donor.save_pretrained(folders[name])
    model = AutoModelForCausalLM.from_pretrained(path)
    model.load_adapter(str(folders["old"]), adapter_name="a")
    model.load_adapter(str(folders["old"]), adapter_name="b")
    model.enable_adapter_batching(max_adapters=2)
    return model, folders


def test_a_reloaded_adapter_answers_as_the_new_one_and_prefixes_stay_per_adapter(tiny_checkpoints, tmp_path):
    """Adapters a and b (the same weights under two names), the base, then a reloaded under its name from other
    files: an adapter's cached prefix serves neither the base nor the other adapter, and after the reload a's
    answer is the new adapter's, not one computed from the old one's cached keys and values."""
    model, folders = adapter_model(tiny_checkpoints, tmp_path)
    engine = engine_for(model, plan())
    settings = compile_settings(model, GenerationConfig(), EAGER)
    system = tokens(40, 30)
    order = [("a", 1), ("__base__", 2), ("b", 3), ("a", 4), ("__base__", 5)]

    def requests():
        return [
            GenerationRequest(system + tokens(4, s), 5, request_id=i, adapter=name) for i, (name, s) in enumerate(order)
        ]

    plain = one_by_one(GenerationLoop(engine, settings, chunked_prefill=CHUNK), requests())
    assert plain[0] != plain[1]  # the adapter changes the tokens
    loop = sharing(engine, settings)
    hits = []
    for r in requests():
        before = loop.prefix_counts()[1]
        assert one_by_one(loop, [r]) == {r.request_id: plain[r.request_id]}
        hits.append(loop.prefix_counts()[1] - before)
    assert hits == [0, 0, 0, 40, 40]  # a, base and b each computed their own; a and base then hit their own
    from staticformers.adapters.bank import bank_of

    bank_of(model).load("a", str(folders["new"]))  # reloaded under its name, in place
    again = GenerationRequest(system + tokens(4, 1), 5, request_id="again", adapter="a")
    got = one_by_one(loop, [again])["again"]
    fresh = one_by_one(
        GenerationLoop(engine, settings, chunked_prefill=CHUNK),
        [GenerationRequest(system + tokens(4, 1), 5, request_id="again", adapter="a")],
    )["again"]
    assert got == fresh != plain[0]


def test_new_weights_drop_the_cached_keys(qwen3):
    model, engine, settings = qwen3
    system = tokens(40, 40)
    loop = sharing(engine, settings)
    one_by_one(loop, [GenerationRequest(system + [3], 2)])
    assert loop.blocks.cached == 5
    original = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)  # in place: the version counter moves
        changed = one_by_one(loop, [GenerationRequest(system + [4], 3, request_id="x")])
        assert loop.prefix_counts()[1] == 0
        assert changed["x"] == greedy(model, system + [4], 3)
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(original)


def test_the_kv_length_follows_the_rows_contexts_not_their_needs(qwen3):
    """A request of 10 prompt tokens and 100 new ones needs 109 positions: static caches give its batch K = 128 from
    its prefill; block caches start at K = 64 (what it holds) and move up when its context reaches 64, a table copy,
    with the same tokens."""
    model, engine, settings = qwen3
    prompt = prompts([10], seed=12)[0]
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=16, kv_block_size=BLOCK)
    loop.add(GenerationRequest(prompt, 100, request_id=0))
    got, lengths = [], []
    while not loop.idle:
        got += [e.token for e in loop.step()]
        if loop.cache is not None:
            lengths.append(loop.cache.max_length)
    assert lengths[0] == 64 and lengths[-1] == 128 and loop.moves == 1
    assert got == greedy(model, prompt, 100)


def test_random_traffic_with_adapters_reloads_shared_prefixes_and_preemption(tiny_checkpoints, tmp_path):
    """The scheduler's property test: random joins under adapters a, b and none, cancels, prefix hits on a shared
    system prompt, a pool small enough to preempt, and adapter a reloaded from other files whenever no request names
    it (as the server allows): every request that is not cancelled gets the tokens the loop on static caches without
    prefix caching gives it under the adapter as it was when the request came; a cancelled one a prefix of them;
    nothing leaks (checked after every step)."""
    from staticformers.adapters.bank import bank_of

    model, folders = adapter_model(tiny_checkpoints, tmp_path)
    engine = engine_for(model, plan())
    settings = compile_settings(model, GenerationConfig(), EAGER)
    system = tokens(32, 41)
    starts = prompts([5, 19, 37], seed=42) + [system + p for p in prompts([3, 11], seed=43)]
    adapters = ["a", "b", "__base__"]

    def expected(version):  # every (prompt, adapter)'s 24 tokens with a loaded from `version`
        bank_of(model).load("a", str(folders[version]))
        jobs = [
            GenerationRequest(p, 24, request_id=(i, name), adapter=name)
            for i, p in enumerate(starts)
            for name in adapters
        ]
        return run(GenerationLoop(engine, settings, chunked_prefill=CHUNK), {0: jobs})

    oracle = {"new": expected("new"), "old": expected("old")}  # a is "old" again when the traffic starts
    assert oracle["new"][(0, "a")] != oracle["old"][(0, "a")]
    rng = random.Random(5)
    loop = sharing(engine, settings, blocks=14, max_batch_size=4)
    version, reloads, wanted, got, cancelled, rid, step = "old", 0, {}, {}, set(), 0, 0
    draining = False  # a reload of a is due: new requests name b or none until no request names a
    while step < 300 or not loop.idle:
        if step < 300 and rng.random() < 0.2:
            i, name = rng.randrange(len(starts)), rng.choice(adapters[1:] if draining else adapters)
            n = rng.randint(1, 24)
            loop.add(GenerationRequest(starts[i], n, request_id=rid, adapter=name))
            wanted[rid] = oracle[version][(i, name)][:n]
            rid += 1
        if rid and rng.random() < 0.02:
            victim = rng.randrange(rid)
            if loop.cancel(victim):
                cancelled.add(victim)
        draining = draining or rng.random() < 0.03
        if draining and not loop.uses_adapter("a"):
            version = "new" if version == "old" else "old"
            bank_of(model).load("a", str(folders[version]))
            reloads, draining = reloads + 1, False
        for event in loop.step():
            assert event.error is None, event.error
            got.setdefault(event.request_id, []).append(event.token)
        held = [b for r in loop.rows.values() for b in r.blocks]
        assert len(held) == loop.blocks.references and len(set(held)) == loop.blocks_used, "a block leaked"
        assert all(not r.blocks for r in loop.waiting)
        step += 1
        assert step < 5_000
    assert loop.blocks_used == 0 and loop.preemptions > 0 and reloads >= 2 and loop.prefix_counts()[1] > 0
    for r, answer in wanted.items():
        have = got.get(r, [])
        assert have == answer[: len(have)] if r in cancelled else have == answer, r
