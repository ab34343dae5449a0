"""Blocks behind a sliding window go back to the pool (`generation/kv_blocks.py`, the scheduler's `slide`).

On a model whose every layer attends a window (the tiny Mistral's window of 5), a row gives back the blocks that no
query of its next step reads, so it holds at most `window_blocks` of them however long it runs. Checked: the held
count after every step, tokens equal to full forwards (greedy, with preemption, with speculation, with prefix
caching by shared blocks), a request longer than the pool admitted and finished, the same request refused on a
model with full attention, and the helpers' bound against every position and width. The pool's account is
checked after every step by `test_kv_blocks.run` (no leak, nothing held twice)."""

from __future__ import annotations

import pytest

from staticformers import AutoModelForCausalLM
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.kv_blocks import NULL_BLOCK, blocks_behind, blocks_for, sliding_window, window_blocks
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.speculative.prompt_lookup import PromptLookup
from staticformers.generation.speculative.step import Speculator
from test_kv_blocks import BLOCK, CHUNK, EAGER, greedy, plan, prompts, run, tokens

WINDOW = 5  # the tiny mistral-window checkpoint's


@pytest.fixture(scope="module")
def mistral(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("mistral-window"))
    assert sliding_window(model.config) == WINDOW
    return model, engine_for(model, plan()), compile_settings(model, GenerationConfig(), EAGER)


def held(row) -> int:
    return sum(b != NULL_BLOCK for b in row.blocks)


def run_counting(loop, arrivals: dict) -> tuple[dict, int]:
    """`run`, recording the most blocks one row held after any step."""
    most = 0
    step = loop.step

    def counted():
        nonlocal most
        events = step()
        most = max([most] + [held(r) for r in loop.rows.values()])
        return events

    loop.step = counted
    return run(loop, arrivals), most


def test_only_models_whose_every_layer_slides_give_back_their_blocks_whole(tiny_checkpoints):
    """Mistral's window on every layer: 5. Gemma 2 alternates sliding and full layers, and Qwen3 attends fully:
    their full layers read every block, so none goes back whole (Gemma 2's window layers give back theirs as a group
    of their own: test_kv_blocks_window_group.py)."""
    for family, window in (("mistral-window", WINDOW), ("gemma2", None), ("qwen3", None)):
        config = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family)).config
        assert sliding_window(config) == window, family


def test_the_blocks_a_row_holds_never_exceed_its_windows_bound():
    """For every first position p and step width (block sizes 1, 4 and 16, windows 1 to 40): the blocks from the
    first one a query at p reads to the last one the step writes are at most `window_blocks`, and none that a
    query at p reads is behind."""
    for block in (1, 4, 16):
        for window in (1, 5, 16, 17, 40):
            for width in (1, 2, 5, 16):
                bound = window_blocks(window, width, block)
                for p in range(0, 200):
                    behind = blocks_behind(p, window, block)
                    assert behind * block <= max(p - window + 1, 0)  # the first position read is not behind
                    assert blocks_for(p + width, block) - behind <= bound, (block, window, width, p)


def test_rows_give_back_the_blocks_behind_the_window_and_finish_as_full_forwards(mistral):
    """Three requests of 7-45 prompt tokens and 60 new each (up to 105 positions, 7 blocks of 16) on a pool of 9:
    without giving blocks back they could not run together. Each holds at most 3 blocks after any step, none is
    preempted, and every request's tokens are its full forward's."""
    model, engine, settings = mistral
    rows = prompts([20, 45, 7], seed=8)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=9, kv_block_size=BLOCK)
    got, most = run_counting(loop, {i: [GenerationRequest(p, 60, request_id=i)] for i, p in enumerate(rows)})
    assert most <= window_blocks(WINDOW, CHUNK, BLOCK) == 3 and loop.preemptions == 0
    for i, p in enumerate(rows):
        assert got[i] == greedy(model, p, 60), i


def test_a_request_longer_than_the_pool_runs_when_its_window_fits(mistral, tiny_checkpoints):
    """A 40-token prompt and 70 new tokens need 109 positions (the last token is never written), 7 blocks of 16, on a pool of 3: the windowed model
    admits it (it never holds more than 3) and finishes it as its full forward; a full-attention model refuses it in
    one sentence."""
    model, engine, settings = mistral
    prompt = tokens(40, 5)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=3, kv_block_size=BLOCK)
    got, most = run_counting(loop, {0: [GenerationRequest(prompt, 70, request_id=0)]})
    assert most <= 3 and got[0] == greedy(model, prompt, 70)
    full = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    full_loop = GenerationLoop(
        engine_for(full, plan()),
        compile_settings(full, GenerationConfig(), EAGER),
        chunked_prefill=CHUNK,
        kv_blocks=3,
        kv_block_size=BLOCK,
    )
    with pytest.raises(ValueError, match="needs 109 cache positions, 7 blocks of 16 at once, and the KV pool has 3"):
        full_loop.add(GenerationRequest(prompt, 70))
    assert full_loop.idle


def test_a_pool_that_preempts_windowed_rows_resumes_them_identically(mistral):
    """Five requests on a pool of 7 blocks (each row needs up to 3): the newest rows are preempted, give their blocks
    back, resume by prefilling their prompt and what they generated (chunked, so behind the window again), and every
    request's tokens are its full forward's."""
    model, engine, settings = mistral
    rows = prompts([30, 12, 50, 25, 9], seed=9)
    news = [40, 55, 30, 45, 50]
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, kv_blocks=7, kv_block_size=BLOCK)
    got, most = run_counting(
        loop, {0: [GenerationRequest(p, n, request_id=i) for i, (p, n) in enumerate(zip(rows, news))]}
    )
    assert loop.preemptions > 0 and most <= 3
    for i, (p, n) in enumerate(zip(rows, news)):
        assert got[i] == greedy(model, p, n), i


def test_speculation_reserves_its_verify_tokens_inside_the_window(mistral):
    """Prompt-lookup speculation (k=3) on a pool of 4: a verify step's 4 tokens are reserved before it runs and
    the blocks behind its first query go back; tokens equal full forwards."""
    model, engine, settings = mistral
    rows = [(list(range(5, 25)) * 3)[:50], prompts([30], seed=4)[0]]
    speculator = Speculator(PromptLookup(3))
    loop = GenerationLoop(
        engine, settings, speculator=speculator, chunked_prefill=CHUNK, kv_blocks=6, kv_block_size=BLOCK
    )
    got, most = run_counting(loop, {0: [GenerationRequest(p, 40, request_id=i) for i, p in enumerate(rows)]})
    assert speculator.num_accepted_tokens > 0 and most <= window_blocks(WINDOW, CHUNK, BLOCK)
    for i, p in enumerate(rows):
        assert got[i] == greedy(model, p, 40), i


def test_a_prompts_blocks_are_cached_before_they_go_back_and_hits_give_the_same_tokens(mistral):
    """Prefix caching by shared blocks (blocks of 8): a 60-token prompt's full blocks are registered before they go
    back behind the window, so the same prompt again hits all but its last (56 of 60 tokens found), the hit's
    blocks behind the window go back at once, and both runs give the full forward's tokens."""
    model, engine, settings = mistral
    prompt = tokens(60, 6)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, prefix_caching=True, kv_blocks=12, kv_block_size=8)
    first, _ = run_counting(loop, {0: [GenerationRequest(prompt, 20, request_id=0)]})
    second, most = run_counting(loop, {0: [GenerationRequest(prompt, 20, request_id=1)]})
    assert first[0] == second[1] == greedy(model, prompt, 20)
    assert loop.prefix_counts() == (120, 56)
    assert most <= window_blocks(WINDOW, CHUNK, 8) and loop.blocks.used == 0
