"""The generation loop under random traffic: requests join at random steps, leave (cancelled while waiting
or running), end on their first token (`max_new_tokens=1`, a stop id that is their first greedy token),
end on a stop id later, or run to their length, over thousands of steps. A model of the loop says what
each request must get: its greedy tokens (computed apart, by full forwards without any cache) up to the
first stop id or its length, each event in order, nothing after it ends or is cancelled, and every slot
free at the end. A step that raises (injected) fails exactly the requests of that batch, and the loop
serves the next ones."""

from __future__ import annotations

import random

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.sampling import SamplingParams

LONGEST = 24  # new tokens per request at most


@pytest.fixture(scope="module")
def setup(tiny_checkpoints):
    """The model, an eager loop's engine and settings, and six prompts with their greedy continuations."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    plan = ShapePlan(batch_sizes=[1, 2, 4], prompt_lengths=[8, 16, 32], kv_lengths=[32, 64], max_model_len=64)
    engine = engine_for(model, plan)
    settings = compile_settings(model, GenerationConfig(disable_compile=True))
    gen = torch.Generator().manual_seed(11)
    pool = []
    for n in (1, 3, 7, 9, 17, 30):
        ids = torch.randint(3, 128, (n,), generator=gen).tolist()
        out = list(ids)
        with torch.no_grad():
            for _ in range(LONGEST):
                out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
        pool.append((ids, out[n:]))
    return model, engine, settings, pool


class Expected:
    """What one request must get: its greedy tokens up to the first stop id (included) or its length."""

    def __init__(self, rid, greedy: list[int], max_new: int, stops: list[int]):
        self.rid, self.stops = rid, stops
        self.tokens, self.reason = greedy[:max_new], "length"
        for j, t in enumerate(greedy[:max_new]):
            if t in stops:
                self.tokens, self.reason = greedy[: j + 1], "stop"
                break
        self.got: list[int] = []
        self.done = self.cancelled = self.failed = False


def _request(rng: random.Random, pool, rid) -> tuple[GenerationRequest, Expected]:
    prompt, greedy = pool[rng.randrange(len(pool))]
    kind = rng.random()
    if kind < 0.15:  # ends on its first token by its length
        max_new, stops = 1, []
    elif kind < 0.3:  # ends on its first token by a stop id
        max_new, stops = rng.randint(1, LONGEST), [greedy[0]]
    elif kind < 0.55:  # a stop id somewhere in its answer (or beyond it)
        max_new, stops = rng.randint(1, LONGEST), [greedy[rng.randrange(LONGEST)]]
    else:  # runs to its length
        max_new, stops = rng.randint(1, LONGEST), []
    request = GenerationRequest(prompt, max_new, SamplingParams(eos_token_ids=stops), request_id=rid)
    return request, Expected(rid, greedy, max_new, stops)


def _check_event(e, want: Expected) -> None:
    assert not want.done and not want.cancelled, f"{want.rid} got an event after it ended"
    assert e.error is None, e.error
    assert e.index == len(want.got), (want.rid, e.index, len(want.got))
    want.got.append(e.token)
    assert want.got == want.tokens[: len(want.got)], (want.rid, want.got, want.tokens)
    if len(want.got) == len(want.tokens):
        assert e.finish_reason == want.reason, (want.rid, e.finish_reason, want.reason)
        want.done = True
    else:
        assert e.finish_reason is None, (want.rid, e.finish_reason)


def _check_loop(loop: GenerationLoop, engine) -> None:
    assert loop.running <= loop.max_slots
    if loop.running:
        assert loop.cache is not None and loop.cache.batch >= loop.running
        assert all(0 <= s < loop.cache.batch for s in loop.rows)
    else:
        assert loop.cache is None and loop.sampler is None
    if loop.idle:
        assert not engine.lock._is_owned()


def test_random_joins_leaves_first_token_finishes_stops_and_cancels(setup):
    """Two thousand steps of random traffic (two seeds): every request gets what the model says."""
    _, engine, settings, pool = setup
    for seed in (0, 1):
        rng = random.Random(seed)
        loop = GenerationLoop(engine, settings, max_batch_size=4)
        wants: dict = {}
        steps = cancels = first_token_ends = 0
        while steps < 1000 or not loop.idle:
            if steps < 1000:
                for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3])):  # bursts join within one step
                    rid = len(wants)
                    request, want = _request(rng, pool, rid)
                    wants[rid] = want
                    loop.add(request)
                if wants and rng.random() < 0.08:  # a client goes away: waiting, running or already ended
                    want = wants[rng.randrange(len(wants))]
                    found = loop.cancel(want.rid)
                    assert found == (not want.done and not want.cancelled), want.rid
                    want.cancelled = want.cancelled or found
                    cancels += found
            for e in loop.step():
                _check_event(e, wants[e.request_id])
                first_token_ends += e.index == 0 and e.finish_reason is not None
            _check_loop(loop, engine)
            steps += 1
            assert steps < 20_000
        assert loop.idle and loop.cache is None and not engine.lock._is_owned()
        for want in wants.values():
            assert want.done or want.cancelled, (want.rid, want.got, want.tokens)
        assert first_token_ends > 50 and cancels > 20 and loop.moves > 0, (first_token_ends, cancels, loop.moves)


def test_an_injected_failure_fails_that_batch_and_the_loop_serves_the_next(setup, monkeypatch):
    """Random traffic where one step in twenty raises, anywhere inside it (prefill, decode, emitting the
    events): each request either gets its right tokens or ends once with an error, never hangs, and the
    loop goes on serving; then, failures off, a request is answered right."""
    _, engine, settings, pool = setup
    loop = GenerationLoop(engine, settings, max_batch_size=4)
    rng = random.Random(5)
    real_emit, real_decode, real_prefill = loop._emit, engine.decode, engine.prefill
    boom = {"on": True}

    def maybe(real):
        def call(*args, **kwargs):
            if boom["on"] and rng.random() < 0.05:
                raise RuntimeError("injected")
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(loop, "_emit", maybe(real_emit))
    monkeypatch.setattr(engine, "decode", maybe(real_decode))
    monkeypatch.setattr(engine, "prefill", maybe(real_prefill))
    wants: dict = {}
    failed = 0
    for _ in range(600):
        if rng.random() < 0.5:
            request, want = _request(rng, pool, len(wants))
            wants[want.rid] = want
            loop.add(request)
        for e in loop.step():
            want = wants[e.request_id]
            if e.error is not None:
                assert not want.done and not want.failed and e.finish_reason == "error"
                assert "injected" in str(e.error)
                want.failed, failed = True, failed + 1
            else:
                _check_event(e, want)
        _check_loop(loop, engine)
    boom["on"] = False
    while not loop.idle:
        for e in loop.step():
            _check_event(e, wants[e.request_id])
    assert failed > 10 and all(w.done or w.failed for w in wants.values())
    assert sum(w.done for w in wants.values()) > 50
    request, want = _request(random.Random(2), pool, "after")
    wants["after"] = want
    loop.add(request)
    while not loop.idle:
        for e in loop.step():
            _check_event(e, wants[e.request_id])
    assert want.done and not engine.lock._is_owned()


def test_batched_generate_with_a_row_ending_on_its_first_token(setup):
    """`generate()` on two prompts where the first ends on its first token (its EOS): it used to lose the
    batch and crash the second row's next step. Each row gets its greedy tokens up to its EOS."""
    model, _, _, pool = setup
    (a, ga), (b, gb) = pool[1], pool[2]
    eos = ga[0]
    ids = torch.zeros(2, len(b), dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, : len(a)], mask[0, : len(a)] = torch.tensor(a), 1
    ids[1], mask[1] = torch.tensor(b), 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        eos_token_id=eos,
        pad_token_id=0,
        compile_config=CompileConfig(backend="eager"),
    )
    want_b = Expected("b", gb, 6, [eos]).tokens
    assert out[0, len(b)] == eos and out[1, len(b) : len(b) + len(want_b)].tolist() == want_b
