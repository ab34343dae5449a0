"""A hybrid model's linear-attention state through the steps that do not advance every row by every token: chunked
prefill (the state carried from chunk to chunk, the rows that do not chunk and a last chunk's padding not counted),
speculative verification (each row's state rolled back to its last accepted token) and both together.

Oracles: transformers' greedy tokens for a prompt longer than the largest prompt bucket; elsewhere the loop without
chunks or speculation (itself equal to transformers, test_qwen3_5.py). The rollback is exercised by a proposer that
proposes the true continuation with one token wrong at a varying place, so rows accept every count from 0 to k."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.sampling import SamplingParams
from staticformers.generation.speculative.draft import DraftModel
from staticformers.generation.speculative.prompt_lookup import PromptLookup
from staticformers.generation.speculative.step import Speculator

from loop_driver import run_loop
from tiny import LINEAR_FAMILIES

transformers = pytest.importorskip("transformers")

CHUNK, K = 16, 3


def _plan():
    """Few buckets: each shape is a graph that Dynamo traces, most of these tests' time."""
    return ShapePlan(
        batch_sizes=[4],
        prompt_lengths=[16, 32, 96],
        kv_lengths=[160],
        max_model_len=160,
        extend_widths=((CHUNK, 1),),
    )


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(autouse=True)
def strict_shapes(monkeypatch):
    """A graph beyond the plan's count raises: every step of these tests stays inside the declared shapes."""
    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")


# Qwen3.5, and Qwen3-Next (its fused projections and its MoE); Qwen3.5-MoE's layers are both of theirs
@pytest.fixture(scope="module", params=[f for f in LINEAR_FAMILIES if f != "qwen3_5-moe"])
def hybrid(request, tiny_checkpoints):
    path = tiny_checkpoints(request.param)
    model = AutoModelForCausalLM.from_pretrained(path)
    engine = engine_for(model, _plan())
    return path, model, engine, compile_settings(model, GenerationConfig(), CompileConfig(backend="eager"))


def _arrivals(rows, answers, sampled=()):
    """Requests joining at different steps, so chunks run beside decoding rows and decode steps beside chunking
    ones; the rows in `sampled` draw with their own seed."""

    def request(i):
        sampling = (
            SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=11 + i) if i in sampled else SamplingParams()
        )
        return GenerationRequest(rows[i], answers[i], sampling, request_id=i)

    return {0: [request(0)], 2: [request(1), request(2)], 5: [request(3)], 9: [request(4)]}


def test_a_long_prompt_in_chunks_gives_transformers_tokens(hybrid):
    """100 tokens (past the largest prompt bucket, 96): a first chunk prefilled, then 6 extend steps of 16, the
    last one padded, each starting from the state the one before left."""
    path, model, engine, settings = hybrid
    prompt = _prompts([100], seed=4)[0]
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK)
    got = run_loop(loop, {0: [GenerationRequest(prompt, 24, request_id="long")]})["long"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([prompt])
    want = ref.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 100:].tolist()
    assert got == want
    assert loop.chunks == 6


def test_chunked_tokens_equal_unchunked_with_rows_joining_and_leaving(hybrid):
    """Prompts of 5 to 90 tokens joining while others decode, greedy and seeded sampling mixed: every request gets
    the tokens of the loop without chunks (a decode step leaves the chunking rows' states, a chunk the decoding
    rows')."""
    _, model, engine, settings = hybrid
    rows, answers = _prompts([40, 5, 90, 17, 33], seed=2), [20, 14, 8, 12, 6]
    plain = run_loop(GenerationLoop(engine, settings), _arrivals(rows, answers, sampled=(1, 3)))
    loop = GenerationLoop(engine, settings, chunked_prefill=CHUNK)
    assert run_loop(loop, _arrivals(rows, answers, sampled=(1, 3))) == plain
    assert loop.chunks >= 6


class OneWrong:
    """Proposes each row's true continuation (`truth`: request id -> the plain loop's tokens) with the token at a
    place that cycles over 0..k wrong (k: all right), so a verify step accepts every count from 0 to k."""

    deterministic = True

    def __init__(self, k: int, truth: dict):
        self.k, self.truth, self.turn = k, truth, 0
        self.accepted_counts: list = []

    def propose(self, histories, limits, loop, slots, **_):
        out = []
        for slot, m in zip(slots, limits):
            row = loop.rows[slot]
            ahead = self.truth[row.request.request_id][row.generated : row.generated + min(self.k, m)]
            wrong = self.turn % (self.k + 1)
            self.turn += 1
            out.append([(t + 1) % 128 if j == wrong else t for j, t in enumerate(ahead)])
        return out, None

    def accepted(self, rows, accepted):
        self.accepted_counts += list(accepted)

    def warm(self, batch, kv):
        return True


def test_verification_rolls_each_row_back_to_its_last_accepted_token(hybrid):
    """Rows joining and leaving, each verify step accepting 0..k proposals per row: every request's tokens equal
    the plain loop's, which they would not if a row kept the states of its rejected proposals."""
    _, model, engine, settings = hybrid
    rows, answers = _prompts([12, 30, 7, 25, 9], seed=3), [20, 16, 24, 10, 18]
    plain = run_loop(GenerationLoop(engine, settings), _arrivals(rows, answers))
    proposer = OneWrong(K, plain)
    spec = Speculator(proposer)
    assert run_loop(GenerationLoop(engine, settings, speculator=spec), _arrivals(rows, answers)) == plain
    assert set(proposer.accepted_counts) == set(range(K + 1))
    assert engine.rollback == K + 1
    cache = next(iter(engine.caches.values()))
    layer = next(iter(cache.linear))
    assert cache.rollback.recurrent[layer].shape[1] == K + 1  # a state per verified position


def test_prompt_lookup_and_chunks_together_give_the_plain_loops_tokens(hybrid):
    """Speculation by prompt lookup (repeated spans, so proposals are accepted) while long prompts run in chunks.
    (A sampling row keeps the target's distribution under speculation, not the plain loop's draws:
    test_speculative.py.)"""
    _, model, engine, settings = hybrid
    gen = torch.Generator().manual_seed(9)
    span = torch.randint(3, 128, (7,), generator=gen).tolist()
    rows = [span * 4, _prompts([50], seed=5)[0], span * 2 + [5, 6], span * 9, span[:3] * 3]
    answers = [18, 10, 14, 12, 16]
    plain = run_loop(GenerationLoop(engine, settings), _arrivals(rows, answers))
    spec = Speculator(PromptLookup(K))
    loop = GenerationLoop(engine, settings, speculator=spec, chunked_prefill=CHUNK)
    assert run_loop(loop, _arrivals(rows, answers)) == plain
    assert spec.num_steps > 0 and spec.num_accepted_tokens > 0 and loop.chunks > 0


def test_generate_speculates_on_a_hybrid_as_transformers_generates(hybrid):
    """`generate(prompt_lookup_num_tokens=k)` on a hybrid: transformers' greedy tokens."""
    path, model, engine, _ = hybrid
    gen = torch.Generator().manual_seed(6)
    span = torch.randint(3, 128, (6,), generator=gen).tolist()
    ids = torch.tensor([span * 4])
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=K, disable_compile=True, **kw), want)


def test_prefix_caching_and_a_hybrid_draft_are_refused_in_one_sentence(hybrid):
    path, model, engine, settings = hybrid
    arch = model.config.architecture
    with pytest.raises(
        ValueError,
        match=rf"^prefix caching is not supported for {arch}: its linear-attention layers "
        r"keep one recurrent state per request, not per position, .* turn prefix "
        r"caching off\.$",
    ):
        GenerationLoop(engine, settings, prefix_caching=True)
    draft = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(
        ValueError,
        match=rf"^The draft model \({arch}\) has linear-attention layers, .* use a draft "
        r"model without them, or prompt lookup \(prompt_lookup_num_tokens\)\.$",
    ):
        DraftModel(engine_for(draft), settings, K).check(model)


def test_served_with_chunks_and_speculation_the_completion_is_the_models_greedy_text(tmp_path):
    """The server with chunked prefill (chunks of 8 tokens) and prompt-lookup speculation on Qwen3.5, through the
    `openai` client."""
    pytest.importorskip("openai")
    from served_greedy import assert_served_completion_is_greedy
    from staticformers import AutoTokenizer
    from tiny import save_served

    folder = save_served("qwen3_5", tmp_path, positions=128)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert_served_completion_is_greedy(
        model,
        tok,
        folder,
        "Hello there, hello there, this is a longer prompt",
        12,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )


def test_the_plans_linear_chunk_sets_the_chunked_form_and_changes_no_token(hybrid):
    """`ShapePlan(linear_chunk=16)`: every Gated DeltaNet layer runs its chunked form 16 tokens at a time (a 70-token
    prompt: 5 chunks, the last padded), transformers' greedy tokens all the same; back to 64 drops the steps built
    for 16. A chunk that is not a positive number of tokens is refused in one sentence."""
    from staticformers.generation.plan import PlanError
    from staticformers.models.linear_attention import GatedDeltaNet

    path, model, engine, _ = hybrid
    prompt = _prompts([70], seed=8)[0]
    ids = torch.tensor([prompt])
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    try:
        small = ShapePlan(batch_sizes=[1], prompt_lengths=[80], kv_lengths=[96], max_model_len=96, linear_chunk=16)
        assert torch.equal(model.generate(ids, shape_plan=small, disable_compile=True, **kw), want)
        assert layers and all(m.chunk_size == 16 for m in layers)
        assert engine.caches
    finally:
        engine_for(model, _plan())
    assert all(m.chunk_size == 64 for m in layers) and not engine.caches
    for bad in (0, 2.5, True):
        with pytest.raises(PlanError, match=rf"^linear_chunk={bad!r} must be a positive number of tokens"):
            ShapePlan(linear_chunk=bad)
