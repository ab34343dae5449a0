"""Chunked prefill: a prompt runs as chunks of the plan's extend width at its row's own positions, between
the decode steps of the running rows. Tokens against transformers (a prompt longer than the largest prompt
bucket) and against the loop without chunking; the running rows' inter-token latency under a long prefill,
counted in steps and prompt tokens; no graph outside the plan."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.plan import PlanError
from staticformers.generation.sampling import SamplingParams

from loop_driver import run_loop

transformers = pytest.importorskip("transformers")

EAGER = CompileConfig(backend="eager")
CHUNK = 16


def plan(**kw):
    return ShapePlan(
        batch_sizes=[1, 2, 4],
        prompt_lengths=[16, 32],
        kv_lengths=[64, 256],
        max_model_len=256,
        extend_widths=((CHUNK, 1),),
        **kw,
    )


def prompts(lengths, seed=0, vocab=128):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, plan())
    return model, engine, compile_settings(model, GenerationConfig(), EAGER)


def hf_greedy(path, prompt, n):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def test_a_prompt_longer_than_the_largest_bucket_runs_in_chunks_and_matches_transformers(qwen3, tiny_checkpoints):
    """150 tokens against a largest prompt bucket of 32: the first 16 prefilled, the rest in 9 chunks of the
    extend step; greedy tokens equal transformers' on the whole prompt. Without chunking it is refused."""
    model, engine, settings = qwen3
    prompt = prompts([150], seed=1)[0]
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK)
    out = run_loop(loop, {0: [GenerationRequest(prompt, 8, request_id="long")]})
    assert out["long"] == hf_greedy(tiny_checkpoints("qwen3"), prompt, 8)
    assert loop.chunks == 9  # ceil((150 - 16) / 16)
    with pytest.raises(PlanError, match="more than the largest prompt bucket"):
        GenerationLoop(engine, settings).add(GenerationRequest(prompt, 8))


def test_chunked_tokens_equal_unchunked_under_mixed_traffic(qwen3):
    """Prompts of 1..32 tokens arriving at different steps, greedy and seeded sampling mixed: with chunks of
    16 every request gets the tokens the loop gives it without chunking."""
    model, engine, settings = qwen3
    lengths, answers = [30, 5, 17, 32, 16, 9, 25], [6, 12, 4, 9, 7, 10, 5]
    rows = prompts(lengths, seed=2)

    def arrivals():
        def request(i):
            sampling = (
                SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=7 + i) if i % 2 else SamplingParams()
            )
            return GenerationRequest(rows[i], answers[i], sampling, request_id=i)

        return {0: [request(0), request(1)], 2: [request(2)], 3: [request(3), request(4)], 9: [request(5), request(6)]}

    plain = run_loop(GenerationLoop(engine, settings), arrivals())
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK)
    chunked = run_loop(loop, arrivals())
    assert chunked == plain
    assert loop.chunks > 0


def test_a_long_prefill_delays_running_rows_by_at_most_one_chunk_per_token(qwen3, monkeypatch):
    """A request decoding when a 200-token prompt arrives: between two of its tokens the loop runs at most two
    device calls (its decode and one chunk), holding at most 16 prompt tokens of work; without chunking one
    call holds the whole 30-token prompt it would prefill."""
    model, engine, settings = qwen3
    running, long = prompts([8, 200], seed=3)
    work = []  # prompt tokens each device call carried
    prefill, extend = engine.prefill, engine.extend

    def counting_prefill(settings, prompts, *a, **k):
        work.append(sum(len(p) for p in prompts))
        return prefill(settings, prompts, *a, **k)

    def counting_extend(settings, cache, tokens, positions, keep, *a, **k):
        work.append(int(keep.max()) + 1)  # the chunk's tokens (one row chunks here)
        return extend(settings, cache, tokens, positions, keep, *a, **k)

    monkeypatch.setattr(engine, "prefill", counting_prefill)
    monkeypatch.setattr(engine, "extend", counting_extend)

    def worst_gap(loop, long_prompt):
        loop.add(GenerationRequest(running, 40, request_id="r"))
        loop.step()  # its prefill
        work.clear()
        gaps, since, first_long = [], [], None
        step = 0
        while not loop.idle:
            if step == 2:
                loop.add(GenerationRequest(long_prompt, 2, request_id="long"))
            before = len(work)
            events = loop.step()
            since.append(sum(work[before:]))
            step += 1
            if any(e.request_id == "long" and e.index == 0 for e in events):
                first_long = step
            if any(e.request_id == "r" for e in events):
                gaps.append((len(since), sum(since)))
                since = []
        return max(g[0] for g in gaps), max(g[1] for g in gaps), first_long

    steps, tokens, first = worst_gap(GenerationLoop(engine, settings, chunked_prefill=CHUNK), long)
    assert steps == 2 and tokens == CHUNK
    assert first is not None  # the long prompt finished while "r" decoded
    steps, tokens, _ = worst_gap(GenerationLoop(engine, settings), long[:30])
    assert steps == 2 and tokens == 30


def test_running_rows_take_a_token_from_every_chunk_step(qwen3, monkeypatch):
    """While a long prompt runs as chunks, the rows already decoding take their next token in each chunk step (no
    decode step between chunks): the steps to finish both are the long prompt's chunks plus what is left of the
    running row's answer, and its tokens are the ones it gets alone."""
    model, engine, settings = qwen3
    running, long = prompts([8, 150], seed=7)
    alone = run_loop(GenerationLoop(engine, settings), {0: [GenerationRequest(running, 30, request_id="r")]})
    extend = engine.extend
    chunk_steps = []

    def counting_extend(*a, **k):
        chunk_steps.append(1)
        return extend(*a, **k)

    monkeypatch.setattr(engine, "extend", counting_extend)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK)
    loop.add(GenerationRequest(running, 30, request_id="r"))
    loop.step()  # its prefill and first token
    loop.add(GenerationRequest(long, 2, request_id="long"))
    tokens, in_chunks, steps = alone["r"][:1], 0, 0
    while not loop.idle:
        before = len(chunk_steps)
        events = loop.step()
        steps += 1
        mine = [e.token for e in events if e.request_id == "r"]
        tokens += mine
        in_chunks += bool(mine) and len(chunk_steps) > before
    chunks = -(-(150 - CHUNK) // CHUNK)  # after the admission's first chunk
    assert loop.chunks == chunks == len(chunk_steps) and in_chunks == chunks  # every chunk step gave "r" a token
    assert tokens == alone["r"]
    # the admission, then "r"'s decode, the chunks (each also a token of "r"), then "long"'s second token with the rest
    assert steps == 2 + chunks + max(30 - 1 - 1 - chunks, 1)


def test_a_row_at_the_last_kv_position_decodes_in_a_chunk_step_unharmed(qwen3):
    """A decoding row feeds its last token at position K-1 in a chunk step of another row's prompt: the step's other
    positions of its row repeat that token there instead of padding clamped onto it, so its logits are a full
    forward's (padding used to overwrite its keys and values at K-1: the logits moved by about 1e-2)."""
    model, engine, settings = qwen3
    first, long = prompts([10, 40], seed=9)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK)  # block caches chunk apart from decoding rows
    at_edge, run = [], loop.runner.run

    def watching(step, cache, *rest):
        if step.kind == "chunk":
            at_edge.extend(s for s in step.choosing if loop.rows[s].length == cache.max_length - 1)
        return run(step, cache, *rest)

    loop.runner.run = watching
    loop.add(GenerationRequest(first, 55, request_id="a", output_logits=True))  # needs 64 positions: K = 64
    step, tokens, last = 0, [], None
    while not loop.idle:
        if step == 52:  # its prompt's chunks run while "a" feeds position 63
            loop.add(GenerationRequest(long, 4, request_id="b"))
        for event in loop.step():
            if event.request_id == "a":
                tokens.append(event.token)
                last = event.logits
        step += 1
    assert at_edge, "no chunk step ran with a row at position K-1"
    with torch.no_grad():
        full = model(input_ids=torch.tensor([first + tokens[:-1]])).logits[0, -1]
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-4)


def test_a_scored_prompt_is_not_chunked(qwen3):
    """A 30-token prompt asking for its log-probabilities runs in one prefill even with chunks of 16: the same
    scores and tokens as without chunking."""
    model, engine, settings = qwen3
    prompt = prompts([30], seed=6)[0]

    def run(loop):
        loop.add(GenerationRequest(prompt, 3, SamplingParams(prompt_logprobs=2), request_id=0))
        events = []
        while not loop.idle:
            events += loop.step()
        return [e.token for e in events], events[0].prompt_logprobs

    plain_tokens, plain_scores = run(GenerationLoop(engine, settings))
    tokens, scores = run(GenerationLoop(engine, settings, chunked_prefill=CHUNK))
    assert tokens == plain_tokens and len(scores) == 30
    assert [s and s[0] for s in scores] == pytest.approx([s and s[0] for s in plain_scores], abs=1e-5)


def test_chunking_is_refused_without_a_declared_width(qwen3):
    model, engine, settings = qwen3
    with pytest.raises(PlanError, match=r"declares no extend width \(8, 1\)"):
        GenerationLoop(engine, settings, chunked_prefill=8)
    bare = ShapePlan(batch_sizes=[1], prompt_lengths=[16], kv_lengths=[64], max_model_len=64)
    with pytest.raises(PlanError, match="declares no extend width with one kept position"):
        GenerationLoop(engine, settings, plan=bare, prefix_caching=True)
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK)
    with pytest.raises(PlanError, match="more than the largest prompt bucket"):  # scored prompts are not chunked
        loop.add(GenerationRequest(prompts([40])[0], 2, SamplingParams(prompt_logprobs=1)))


@pytest.mark.slow
def test_mixed_traffic_compiles_nothing_outside_the_plan(tiny_checkpoints, monkeypatch):
    """After `precompile` of a plan with a chunk width, traffic mixing short prompts, prompts longer than the
    largest bucket, prefix hits and partial hits, greedy and seeded, compiles no graph (Dynamo's counters,
    strict shapes): chunks and block copies stay inside the declared shapes."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    small = ShapePlan(
        batch_sizes=[2], prompt_lengths=[16, 32], kv_lengths=[128], max_model_len=128, extend_widths=((CHUNK, 1),)
    )
    engine = engine_for(model, small)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    engine.precompile(settings)
    system = prompts([40], seed=8)[0]
    rows = [
        system + [5],
        prompts([7], seed=9)[0],
        system + [6, 7, 8],
        prompts([90], seed=10)[0],
        system[:20] + [9],
        system + [4],
    ]
    counters.clear()
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK, prefix_caching=True, prefix_block_size=8)
    arrivals = {
        0: [GenerationRequest(rows[0], 5, request_id=0), GenerationRequest(rows[1], 30, request_id=1)],
        8: [
            GenerationRequest(rows[2], 4, SamplingParams(do_sample=True, seed=3), request_id=2),
            GenerationRequest(rows[3], 6, request_id=3),
        ],
        20: [GenerationRequest(rows[4], 3, request_id=4)],
        30: [GenerationRequest(rows[5], 3, request_id=5)],
    }
    out = run_loop(loop, arrivals)
    assert sorted(out) == list(range(6)) and loop.prefix.hits > 0 and loop.chunks > 0
    assert counters["stats"]["unique_graphs"] == 0


def test_chunks_prefix_hits_and_speculation_together_give_the_plain_loops_tokens(qwen3):
    """One loop with chunked prefill, prefix caching and prompt-lookup speculation: rows that speculate while
    another still prefills its chunks, and prompts that share a prefix, get the plain loop's tokens when greedy
    (speculation keeps greedy exact); with a seeded sampling row among them, the run is reproducible and the
    greedy rows still get the plain loop's tokens."""
    from staticformers.generation.speculative.prompt_lookup import PromptLookup
    from staticformers.generation.speculative.step import Speculator

    model, engine, settings = qwen3
    shared = [5, 6, 7, 8] * 6  # repeated: prompt lookup hits
    long, short, other = shared + prompts([6], seed=4)[0], shared + [9, 10], prompts([12], seed=5)[0]

    def arrivals(seeded: bool):
        sampling = SamplingParams(do_sample=True, temperature=0.8, seed=11) if seeded else SamplingParams()
        return {
            0: [GenerationRequest(short, 12, request_id="short")],
            1: [GenerationRequest(long, 10, sampling, request_id="long")],
            3: [GenerationRequest(short + [11], 12, request_id="again"), GenerationRequest(other, 8, request_id="o")],
        }

    plain = run_loop(GenerationLoop(engine, settings), arrivals(False))
    spec = Speculator(PromptLookup(3))
    together = GenerationLoop(
        engine,
        settings,
        chunked_prefill=CHUNK,
        prefix_caching=True,
        prefix_block_size=8,
        prefix_cache_blocks=32,
        speculator=spec,
    )
    assert run_loop(together, arrivals(False)) == plain
    assert together.chunks > 0 and spec.num_steps > 0 and together.prefix.hits > 0
    # A seeded row's tokens follow its own generator, but a verify step draws acceptance uniforms that a decode step
    # does not, and in a chunk step the decoding rows decode: which steps verify depends on the schedule. So the
    # seeded run is compared with itself (the same arrivals give the same tokens), and its greedy rows with plain.

    def seeded():
        return run_loop(
            GenerationLoop(
                engine,
                settings,
                chunked_prefill=CHUNK,
                prefix_caching=True,
                prefix_block_size=8,
                prefix_cache_blocks=32,
                speculator=Speculator(PromptLookup(3)),
            ),
            arrivals(True),
        )

    first = seeded()
    assert seeded() == first
    assert {k: v for k, v in first.items() if k != "long"} == {k: v for k, v in plain.items() if k != "long"}
