"""The generation loop: every row owns its positions, requests join and leave between decode steps, and
no graph is compiled after the plan's warm-up. Greedy tokens against transformers and against each
request's solo run; seeded sampling reproduces the solo run whatever the neighbours."""

from __future__ import annotations

import threading

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


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def prompts(lengths, seed=0, vocab=128):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A 256-position Qwen3 and its transformers twin."""
    from tiny import build_hf_model

    path = str(tmp_path_factory.mktemp("qwen3_256"))
    hf = build_hf_model("qwen3", max_position_embeddings=256)
    hf.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path), hf


@pytest.mark.slow
def test_every_prompt_length_up_to_the_models_positions_runs(short_model):
    """A 256-position model: prompt n with max_new_tokens = 256 - n runs for lengths across 1..255 (bucket
    edges included), the KV length following prompt + new tokens, and greedy tokens equal transformers'."""
    model, hf = short_model
    lengths = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 197, 200, 240, 254, 255]
    for prompt in prompts(lengths, seed=1):
        n = len(prompt)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=256 - n, eos_token_id=None, compile_config=EAGER)
        assert out[0, n:].tolist() == hf_greedy(hf, prompt, 256 - n), n
    engine = engine_for(model)
    assert {k for k, _, _ in engine.caches} == {1} and {kv for _, kv, _ in engine.caches} <= {256}
    with pytest.raises(PlanError, match=r"197 tokens and max_new_tokens=60: 257 positions exceed max_model_len=256"):
        model.generate(torch.tensor([prompts([197])[0]]), max_new_tokens=60)


def test_the_reported_defect_runs(short_model):
    """197-token prompt, 4 new tokens, 256-position model: 201 positions, refused before (padded bucket)."""
    model, hf = short_model
    prompt = prompts([197], seed=5)[0]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=4, eos_token_id=None, compile_config=EAGER)
    assert out[0, 197:].tolist() == hf_greedy(hf, prompt, 4)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_gives_each_row_its_solo_tokens(tiny_checkpoints, side):
    """Rows of different lengths, padded on either side (the tokenizer's default is right): each row gets
    what it gets alone, and what transformers gives it."""
    from tiny import build_hf_model

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    hf = build_hf_model("llama")
    rows = prompts([3, 11, 7, 1, 9], seed=2)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        if side == "left":
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        else:
            ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, compile_config=EAGER)
    assert torch.equal(out[:, :width], ids)
    for i, p in enumerate(rows):
        solo = model.generate(torch.tensor([p]), max_new_tokens=6, eos_token_id=None, compile_config=EAGER)
        assert out[i, width:].tolist() == solo[0, len(p) :].tolist() == hf_greedy(hf, p, 6), (side, i)


def test_requests_join_and_leave_between_steps_and_nothing_compiles_after_warm_up(tiny_checkpoints, monkeypatch):
    """Four slots, twelve requests of mixed prompt and answer lengths arriving at different steps, greedy and
    seeded sampling mixed: each request gets its solo tokens, and after `precompile` of the plan no graph
    is compiled (Dynamo's counters), whatever joins, moves or leaves."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    plan = ShapePlan(batch_sizes=[1, 2, 4], prompt_lengths=[8, 16, 32], kv_lengths=[32, 64], max_model_len=64)
    engine = engine_for(model, plan)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    engine.precompile(settings)
    lengths = [5, 30, 1, 12, 9, 16, 17, 3, 25, 8, 2, 14]
    answers = [6, 20, 3, 33, 1, 10, 4, 15, 7, 12, 30, 5]
    rows = prompts(lengths, seed=3)

    def params(i):
        return (
            SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=100 + i) if i % 3 == 0 else SamplingParams()
        )

    def request(i):
        return GenerationRequest(rows[i], answers[i], params(i), request_id=i)

    solo = {}
    for i in range(12):
        loop = GenerationLoop(engine, settings)
        solo[i] = run_loop(loop, {0: [request(i)]})[i]
        assert len(solo[i]) == answers[i]
    counters.clear()
    loop = GenerationLoop(engine, settings, max_batch_size=4)
    arrivals = {
        0: [request(0), request(1), request(2)],
        2: [request(3), request(4)],
        3: [request(5)],
        7: [request(6), request(7), request(8)],
        20: [request(9), request(10), request(11)],
    }
    together = run_loop(loop, arrivals)
    assert together == solo
    assert counters["stats"]["unique_graphs"] == 0
    assert loop.moves >= 1  # a longer request joined a batch (KV 32 -> 64 or batch 2 -> 4)
    assert loop.idle and loop.cache is None and not engine.lock._is_owned()


def test_a_cancelled_request_frees_its_slot_for_the_next(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, ShapePlan(batch_sizes=[1], max_model_len=64))
    settings = compile_settings(model, GenerationConfig(), EAGER)
    loop = GenerationLoop(engine, settings)
    a, b = prompts([4, 6], seed=4)
    loop.add(GenerationRequest(a, 30, request_id="a"))
    loop.add(GenerationRequest(b, 3, request_id="b"))
    seen = [e.request_id for e in loop.step()]
    assert seen == ["a"] and loop.num_waiting == 1
    assert loop.cancel("a") and not loop.cancel("nobody")
    got = run_loop(loop, {})
    assert list(got) == ["b"] and len(got["b"]) == 3


def test_bad_requests_are_refused_before_any_work(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, ShapePlan(max_model_len=64))
    loop = GenerationLoop(engine, compile_settings(model, GenerationConfig(), EAGER))
    cases = [
        (GenerationRequest([], 3), "The prompt is empty"),
        (GenerationRequest([1, 500], 3), r"outside the vocabulary \[0, 128\): found 1..500"),
        (GenerationRequest([1, 2.5], 3), "list of integer token ids"),
        (GenerationRequest([1, 2], 0), "max_new_tokens=0 must be a positive integer"),
        (GenerationRequest([1] * 60, 10), "70 positions exceed max_model_len=64"),
    ]
    for request, match in cases:
        with pytest.raises(ValueError, match=match):
            loop.add(request)
    assert loop.idle and not engine.graphs and not engine.caches


def test_an_exception_in_a_step_fails_that_steps_requests_and_the_loop_goes_on(tiny_checkpoints, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, ShapePlan(max_model_len=64))
    settings = compile_settings(
        model,
        GenerationConfig(),
        CompileConfig(),
    )
    settings = compile_settings(model, GenerationConfig(disable_compile=True))
    loop = GenerationLoop(engine, settings)
    real = engine.decode
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "decode", failing)
    loop.add(GenerationRequest(prompts([5])[0], 10, request_id="x"))
    events = []
    while not loop.idle:
        events += loop.step()
    assert events[-1].finish_reason == "error" and "device lost" in str(events[-1].error)
    assert not engine.lock._is_owned()
    monkeypatch.setattr(engine, "decode", real)
    loop.add(GenerationRequest(prompts([5])[0], 4, request_id="y"))
    assert len(run_loop(loop, {})["y"]) == 4


@pytest.mark.slow
def test_calls_from_several_threads_each_get_their_own_answer(tiny_checkpoints):
    """Four threads, ten mixed calls each (batch sizes, lengths, greedy and seeded sampling) on one model:
    every output equals the same call made alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen2"))
    gen = torch.Generator().manual_seed(7)
    calls = []
    for i in range(40):
        b, n = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 20, (1,), generator=gen))
        kw = dict(max_new_tokens=int(torch.randint(1, 9, (1,), generator=gen)), eos_token_id=None, compile_config=EAGER)
        if i % 4 == 0:
            kw.update(do_sample=True, temperature=0.8, seed=i)
        calls.append((torch.randint(3, 128, (b, n), generator=gen), kw))
    alone = [model.generate(ids, **kw) for ids, kw in calls]
    results: dict = {}
    errors = []

    def worker(t):
        try:
            for j in range(t, len(calls), 4):
                ids, kw = calls[j]
                results[j] = model.generate(ids, **kw)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 40
    for j, want in enumerate(alone):
        assert torch.equal(results[j], want), j
