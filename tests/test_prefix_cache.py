"""Prefix caching: prompt prefixes' keys and values kept in a bounded pool of blocks and copied into a joining
row's slot, the rest of the prompt prefilled as a chunk. Every request's tokens equal the loop's without
caching (greedy and seeded), for every family kind (MoE, sliding window); hits, misses, partial hits and
eviction counted as vLLM counts them (prompt tokens); an adapter's prefix serves no one else."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.prefix_cache import PrefixCache
from staticformers.generation.sampling import SamplingParams

from loop_driver import run_loop

EAGER = CompileConfig(backend="eager")
BLOCK = 8


def plan():
    return ShapePlan(
        batch_sizes=[1, 2, 4],
        prompt_lengths=[16, 32, 64],
        kv_lengths=[128],
        max_model_len=128,
        extend_widths=((16, 1),),
    )


def tokens(n, seed, vocab=128):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def setup(path, **kw):
    model = AutoModelForCausalLM.from_pretrained(path)
    return model, engine_for(model, plan()), compile_settings(model, GenerationConfig(), EAGER)


def one_by_one(loop, requests) -> dict:
    """Each request alone, in order, on the same loop (its pool filled by the ones before)."""
    out = {}
    for r in requests:
        out.update(run_loop(loop, {0: [r]}))
    return out


def sampling(i):
    return SamplingParams(do_sample=True, temperature=0.8, top_k=30, seed=11 + i) if i % 2 else SamplingParams()


def traffic(system):
    """(prompt, what the pool holds when it arrives) for each request, in order."""
    return [
        system + tokens(5, 1),  # miss: 45 tokens queried, 5 blocks stored
        system + tokens(10, 2),  # hit: 5 blocks (40 tokens), its last 10 tokens as a chunk
        system[:20] + tokens(10, 3),  # partial: 2 blocks (16 tokens)
        tokens(20, 4),  # miss
        system + tokens(5, 1),  # hit: 5 blocks (a 45-token prompt keeps its last 5 to compute)
        system,
    ]  # hit: 4 blocks (40 tokens: the last block holds its last token)


def test_hits_misses_and_partial_hits_give_the_tokens_of_no_caching(tiny_checkpoints):
    model, engine, settings = setup(tiny_checkpoints("qwen3"))
    system = tokens(40, 0)
    requests = lambda: [GenerationRequest(p, 6, sampling(i), request_id=i) for i, p in enumerate(traffic(system))]  # noqa: E731
    plain = one_by_one(GenerationLoop(engine, settings), requests())
    loop = GenerationLoop(engine, settings, prefix_caching=True, prefix_block_size=BLOCK)
    cached = one_by_one(loop, requests())
    assert cached == plain
    assert loop.prefix.queries == 45 + 50 + 30 + 20 + 45 + 40
    assert loop.prefix.hits == 0 + 40 + 16 + 0 + 40 + 32
    assert loop.prefix.evictions == 0
    # arriving together, nothing is stored yet for the second: both prefill in full, same tokens
    both = GenerationLoop(engine, settings, prefix_caching=True, prefix_block_size=BLOCK)
    assert run_loop(both, {0: requests()[:2]}) == {0: plain[0], 1: plain[1]} and both.prefix.hits == 0


def test_a_small_pool_evicts_the_least_recently_used_blocks_and_stays_correct(tiny_checkpoints):
    """A pool of 6 blocks under two 5-block prefixes taking turns: each store evicts the other's least recently
    used blocks (a chain's deepest first), so each prefix keeps only its first block; every token equals no
    caching (the slot holds the other prefix's keys when a hit is copied in)."""
    model, engine, settings = setup(tiny_checkpoints("qwen3"))
    a, b = tokens(40, 10), tokens(40, 11)
    prompts = [a + [5], b + [7], a + [6], b + [8]]
    requests = lambda: [GenerationRequest(p, 4, sampling(i), request_id=i) for i, p in enumerate(prompts)]  # noqa: E731
    plain = one_by_one(GenerationLoop(engine, settings), requests())
    loop = GenerationLoop(engine, settings, prefix_caching=True, prefix_cache_blocks=6, prefix_block_size=BLOCK)
    hits = []
    for r in requests():
        before = loop.prefix.hits
        assert one_by_one(loop, [r]) == {r.request_id: plain[r.request_id]}
        hits.append(loop.prefix.hits - before)
    assert hits == [0, 0, BLOCK, BLOCK]
    assert loop.prefix.evictions == 3 * 4 and loop.prefix.used == 6


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral-window", "qwen3-moe", "gemma2"])
def test_window_and_moe_families_give_the_tokens_of_no_caching(tiny_checkpoints, family):
    """Sliding-window (window 5: every block here is older than the window, still usable: the
    cache keeps every position) and mixture-of-experts families, greedy and seeded."""
    model, engine, settings = setup(tiny_checkpoints(family))
    system = tokens(40, 20)
    # a prompt of other tokens between them rewrites the slot: a hit's keys come from the pool, not the slot
    prompts = [system + tokens(6, 21), tokens(50, 24), system + tokens(3, 22), system[:24] + tokens(9, 23)]
    requests = lambda: [GenerationRequest(p, 5, sampling(i), request_id=i) for i, p in enumerate(prompts)]  # noqa: E731
    plain = one_by_one(GenerationLoop(engine, settings), requests())
    loop = GenerationLoop(engine, settings, prefix_caching=True, prefix_block_size=BLOCK)
    assert one_by_one(loop, requests()) == plain
    assert loop.prefix.hits == 40 + 24


def test_an_adapters_prefix_serves_neither_the_base_nor_another_adapter(tiny_checkpoints, tmp_path):
    from staticformers import LoraConfig

    path = tiny_checkpoints("qwen3")
    folder = tmp_path / "a"
    donor = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    donor.add_adapter(
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        for n, p in donor.named_parameters():
            if "lora_B" in n:
                p.mul_(4.0)
    donor.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.load_adapter(str(folder), adapter_name="a")
    model.load_adapter(str(folder), adapter_name="b")  # the same weights under another name: still no sharing
    model.enable_adapter_batching(max_adapters=2)
    engine = engine_for(model, plan())
    settings = compile_settings(model, GenerationConfig(), EAGER)
    system = tokens(40, 30)
    order = [("a", 1), ("__base__", 2), ("b", 3), ("a", 4), ("__base__", 5)]

    def requests():
        return [
            GenerationRequest(system + tokens(4, s), 5, request_id=i, adapter=name) for i, (name, s) in enumerate(order)
        ]

    plain = one_by_one(GenerationLoop(engine, settings), requests())
    assert plain[0] != plain[1]  # the adapter changes the tokens
    loop = GenerationLoop(engine, settings, prefix_caching=True, prefix_block_size=BLOCK)
    hits = []
    for r in requests():
        before = loop.prefix.hits
        assert one_by_one(loop, [r]) == {r.request_id: plain[r.request_id]}
        hits.append(loop.prefix.hits - before)
    assert hits == [0, 0, 0, 40, 40]  # a, base and b each computed their own; a and base then hit their own


def test_new_weights_empty_the_pool_and_bad_sizes_are_refused(tiny_checkpoints):
    model, engine, settings = setup(tiny_checkpoints("qwen3"))
    system = tokens(40, 40)
    loop = GenerationLoop(engine, settings, prefix_caching=True, prefix_block_size=BLOCK)
    one_by_one(loop, [GenerationRequest(system + [3], 2)])
    assert loop.prefix.used == 5
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # in place: the version counter moves
    changed = one_by_one(loop, [GenerationRequest(system + [4], 3, request_id="x")])
    assert loop.prefix.hits == 0
    assert changed == one_by_one(GenerationLoop(engine, settings), [GenerationRequest(system + [4], 3, request_id="x")])
    with pytest.raises(ValueError, match="blocks=0 must be at least 1"):
        PrefixCache(model, 0)
    with pytest.raises(ValueError, match="block_size=0 must be a positive number of tokens"):
        PrefixCache(model, 4, 0)
