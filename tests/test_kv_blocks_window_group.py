"""A model that mixes sliding-window and full-attention layers keeps its window layers' KV blocks as a group of their
own (`generation/kv_blocks.py`'s `window_group`, the scheduler's `BlockGroup`, `models/block_kv_cache.py`'s second
table).

Gemma 2, Gemma 3 and gpt-oss (tiny random checkpoints, windows of 4-5 positions) on pools of 16- and 8-position
blocks. Checked: the full layers keep every block of a row while its window layers hold at most `window_blocks`
after any step, the window layers' pool is the smaller one and so is the pool's memory, and every request's tokens
equal its full forward's: with several rows together, with rows preempted and resumed, and
with prefix caching (a hit holds the full layers' blocks of the whole prefix and the window layers' of its last
window only). The pools' accounts are checked after every step by `test_kv_blocks.run` (no leak in either group,
nothing held twice, the same logical blocks in both)."""

from __future__ import annotations

import pytest

from staticformers import AutoModelForCausalLM
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.kv_blocks import NULL_BLOCK, blocks_for, window_blocks, window_group, window_pool_blocks
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.prefix_cache import adapter_key, block_keys
from staticformers.models.block_kv_cache import KVBlocks
from test_kv_blocks import BLOCK, CHUNK, EAGER, greedy, plan, prompts, run, tokens

MIXED = ("gemma2", "gemma3", "gpt-oss")


def window_plan():
    """`test_kv_blocks.plan`'s shapes, at the batches and the cache length these tests run: each shape is a graph
    that Dynamo traces, most of these tests' time."""
    return plan(batch_sizes=(2, 4), kv_lengths=(128,))


@pytest.fixture(scope="module", params=MIXED)
def mixed(request, tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(request.param))
    return model, engine_for(model, window_plan()), compile_settings(model, GenerationConfig(), EAGER)


def held(blocks) -> int:
    return sum(b != NULL_BLOCK for b in blocks)


def run_counting(loop, arrivals: dict) -> tuple[dict, int, int]:
    """`run`, recording the most blocks one row held after any step in the full layers and in the window layers, and
    the steps after which the window layers' pool was the fuller one (`loop.window_fuller`); the pool's use the
    server reports is the fuller pool's after every step."""
    most_full = most_window = 0
    loop.window_fuller = 0
    step = loop.step

    def counted():
        nonlocal most_full, most_window
        events = step()
        for r in loop.rows.values():
            most_full = max(most_full, held(r.blocks))
            most_window = max(most_window, held(r.window_blocks))
        full, window = (g.pool.used / g.pool.blocks for g in loop.scheduler.groups)
        assert loop.kv_usage == max(full, window)
        loop.window_fuller += window > full
        return events

    loop.step = counted
    return run(loop, arrivals), most_full, most_window


def test_only_models_mixing_window_and_full_layers_have_a_window_group(tiny_checkpoints):
    """The group is the layers that attend a window, with the largest of their windows; a model whose layers all
    slide (Mistral's window) or none do (Qwen3) has none."""
    for family in MIXED:
        config = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family)).config
        windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        sliding = tuple(i for i, w in enumerate(windows) if w is not None)
        assert 0 < len(sliding) < len(windows), family
        assert window_group(config) == (sliding, max(w for w in windows if w is not None)), family
    for family in ("mistral-window", "qwen3"):
        assert window_group(AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family)).config) is None


def test_window_layers_give_back_their_blocks_and_rows_finish_as_full_forwards(mixed):
    """Three requests of 7-45 prompt tokens and 60 new each (up to 7 blocks of 16) at most 4 rows at once, on a pool
    of 24 blocks: the window layers' pool holds 12 (4 rows at their widest window), so the pool takes less memory
    than one group of 24; each row's full layers end holding all its blocks, its window layers never more than
    `window_blocks`; no row is preempted, and every token is the full forward's."""
    model, engine, settings = mixed
    layers, window = window_group(model.config)
    bound = window_blocks(window, CHUNK, BLOCK)
    rows = prompts([20, 45, 7], seed=8)

    loop = GenerationLoop(engine, settings, max_batch_size=4, chunked_prefill=CHUNK, kv_blocks=24, kv_block_size=BLOCK)
    count = window_pool_blocks(24, window, 4, CHUNK, window_plan().max_model_len, BLOCK)
    assert loop.window_blocks is not None and loop.window_blocks.blocks == count == 4 * bound < 24
    arrivals = {i: [GenerationRequest(p, 60, request_id=i)] for i, p in enumerate(rows)}
    got, most_full, most_window = run_counting(loop, arrivals)
    assert most_full == blocks_for(45 + 60 - 1, BLOCK) and 0 < most_window <= bound and loop.preemptions == 0
    assert loop.window_fuller > 0  # early on, the rows' windows are most of their blocks, in a pool half the size
    pool = engine.blocks
    assert pool is not None and pool.nbytes == KVBlocks.bytes_for(model, 24, BLOCK, window=(layers, count))
    assert pool.nbytes < KVBlocks.bytes_for(model, 24, BLOCK)
    assert [pool.keys[i].shape[0] for i in layers] == [count + 1] * len(layers)
    for i, p in enumerate(rows):
        assert got[i] == greedy(model, p, 60), i


def test_a_chunk_budgets_window_pool_holds_its_widest_step_not_every_row_at_its_widest_chunk():
    """Under a chunk budget of 512 over 16 slots, B rows chunk 512 / B tokens together: the window pool holds the most
    any such step holds (one row's 512-token window beside 15 decoding rows, or 16 rows of 32), not 16 rows at 512."""
    steps = ((1, 512), (2, 256), (4, 128), (8, 64), (16, 32))
    assert window_pool_blocks(10**6, 16, 16, steps, 0, 16) == 64 == window_pool_blocks(10**6, 16, 16, 32, 0, 16)
    assert window_pool_blocks(10**6, 16, 16, 512, 0, 16) == 16 * window_blocks(16, 512, 16) == 544
    # the other rows' step is their verify step's when speculating
    assert window_pool_blocks(10**6, 16, 2, ((1, 64),), 0, 16, ahead=5) == window_blocks(16, 64, 16) + window_blocks(
        16, 5, 16
    )


@pytest.mark.parametrize("mixed", ["gpt-oss"], indirect=True)  # the groups' account is the same for every family
def test_rows_preempted_for_either_group_resume_identically(mixed):
    """Five requests (up to 6 blocks of 16 each) on a pool of 10, at most 4 rows at once: the newest rows are
    preempted, give back their blocks in both groups, resume by prefilling what they had, and every request's tokens
    are its full forward's."""
    model, engine, settings = mixed
    _, window = window_group(model.config)
    rows = prompts([30, 12, 50, 25, 9], seed=9)
    news = [40, 55, 30, 45, 50]
    loop = GenerationLoop(engine, settings, max_batch_size=4, chunked_prefill=CHUNK, kv_blocks=10, kv_block_size=BLOCK)
    got, _, most_window = run_counting(
        loop, {0: [GenerationRequest(p, n, request_id=i) for i, (p, n) in enumerate(zip(rows, news))]}
    )
    assert loop.preemptions > 0 and most_window <= window_blocks(window, CHUNK, BLOCK)
    for i, (p, n) in enumerate(zip(rows, news)):
        assert got[i] == greedy(model, p, n), i


def test_a_prefix_hit_holds_the_whole_prefix_in_full_layers_and_its_last_window_in_window_layers(mixed):
    """Prefix caching by shared blocks (blocks of 8): the same 60-token prompt twice hits 56 tokens. The second row's
    full layers hold the first row's 7 cached blocks; its window layers hold only the cached blocks of the last
    window before position 56 (the others null, never computed again). Both runs give the full forward's tokens, and
    a row that drops its prefix's window blocks first (another prompt taking the window pool's cached blocks) hits
    less, with the same tokens."""
    model, engine, settings = mixed
    _, window = window_group(model.config)
    prompt = tokens(60, 6)
    loop = GenerationLoop(
        engine, settings, chunked_prefill=CHUNK, prefix_caching=True, kv_blocks=12, kv_block_size=8, max_batch_size=2
    )
    first, _, _ = run_counting(loop, {0: [GenerationRequest(prompt, 20, request_id=0)]})
    shared = []
    take = loop.scheduler._share_prefix

    def spy(row):
        n = take(row)
        shared.append((n, list(row.blocks), list(row.window_blocks)))
        return n

    loop.scheduler._share_prefix = spy
    second, _, most_window = run_counting(loop, {0: [GenerationRequest(prompt, 20, request_id=1)]})
    answer = greedy(model, prompt, 20)
    assert first[0] == second[1] == answer
    assert loop.prefix_counts() == (120, 56)
    n, full, windowed = shared[0]
    behind = max(56 - window + 1, 0) // 8
    assert n == 7 and held(full) == 7 and windowed[:behind] == [NULL_BLOCK] * behind and held(windowed) == 7 - behind
    assert most_window <= window_blocks(window, CHUNK, 8)
    # the window layers' cached block of the prefix's last block dropped: the hit is cut back to the longest prefix
    # whose last window both groups still hold (6 blocks: their window's blocks are cached), with the same tokens
    keys = block_keys(prompt, adapter_key(None, 0, 0), 8)
    group = loop.scheduler.groups[1]
    group.pool._uncache(group.pool.peek(keys[:7])[6])
    third, _, _ = run_counting(loop, {0: [GenerationRequest(prompt, 20, request_id=2)]})
    assert third[2] == answer and shared[-1][0] == 6 and loop.prefix_counts() == (180, 104)
    # and with none of the window layers' blocks cached, nothing is shared (no block's window is empty)
    group.pool.forget()
    fourth, _, _ = run_counting(loop, {0: [GenerationRequest(prompt, 20, request_id=3)]})
    assert fourth[3] == answer and shared[-1][0] == 0 and loop.prefix_counts() == (240, 104)


def test_a_memory_budget_gives_a_mixed_model_more_blocks_and_the_server_precompiles_its_pool(tiny_checkpoints):
    """`--kv-cache-memory-bytes` on Gemma 2: the window layers' smaller pool leaves the full layers more blocks than
    one group of the same bytes holds, the largest count whose pools fit (one more does not). The server's loop tells
    the engine its pool (both groups) before the precompile, so serving a request compiles nothing more and
    allocates no second pool."""
    pytest.importorskip("fastapi")
    from staticformers.serving.kv_budget import kv_blocks
    from staticformers.serving.server import ServeOptions, build_loop

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("gemma2"))
    budget = KVBlocks.bytes_for(model, 40, 16)  # one group of 40 blocks
    options = ServeOptions(
        model=tiny_checkpoints("gemma2"),
        kv_cache_memory_bytes=budget,
        block_size=16,
        max_batch_size=2,
        max_model_len=128,
        backend="eager",
        precompile=True,
    )
    loop = build_loop(model, options)
    engine = loop.engine
    spec = loop._window_spec
    blocks = loop.blocks.blocks
    assert spec is not None and spec[1] < blocks and blocks > 40
    assert KVBlocks.bytes_for(model, blocks, 16, window=spec) <= budget
    bigger = window_pool_blocks(blocks + 1, window_group(model.config)[1], 2, loop.chunk, 128, 16)
    assert KVBlocks.bytes_for(model, blocks + 1, 16, window=(spec[0], bigger)) > budget
    assert kv_blocks(model, None, budget, None, 16) == 40  # no window group asked for: one group's count
    graphs = engine.graph_count()
    assert graphs > 0 and list(engine.pools) == [engine.block_spec]
    got = run(loop, {0: [GenerationRequest(tokens(40, 3), 30, request_id=0)]})
    assert got[0] == greedy(model, tokens(40, 3), 30)
    assert engine.graph_count() == graphs and list(engine.pools) == [engine.block_spec]
