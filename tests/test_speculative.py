"""Speculative decoding (prompt lookup and a draft model) in the generation loop: greedy output equals the
output without speculation for every family, in mixed batches that join and leave, with penalties, stop
ids, min/max new tokens and logprobs; sampled tokens keep the target's distribution (a chi-square test
against the exact marginals, which fails when the rejection rule is swapped for plain acceptance); and
no graph outside the declared plan. The non-speculative loop is the oracle here (it is itself tested
against transformers in test_loop.py and test_generation.py)."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.sampling import RowSampler, SamplingParams
from staticformers.generation.speculative import acceptance
from staticformers.generation.speculative.draft import DraftModel
from staticformers.generation.speculative.prompt_lookup import PromptLookup, lookup
from staticformers.generation.speculative.step import Speculator

from loop_driver import run_loop, run_loop_events
from tiny import FAMILIES, LINEAR_FAMILIES

EAGER = CompileConfig(backend="eager")
EAGER_RUN = GenerationConfig(disable_compile=True)  # no tracing: the family sweep checks tokens only


def perturbed(path: str, scale: float = 0.2, seed: int = 1):
    """The checkpoint at `path` with its weights nudged (by `scale` of each tensor's mean magnitude): a draft
    that agrees with the target often, not always."""
    draft = AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.abs().mean())
    return draft


def prompts(vocab: int = 128, seed: int = 0) -> list[list[int]]:
    """Prompts built to hit (repeated spans) and to miss (random tokens)."""
    gen = torch.Generator().manual_seed(seed)
    span = torch.randint(3, vocab, (9,), generator=gen).tolist()
    return [
        span * 3 + span[:4],
        torch.randint(3, vocab, (23,), generator=gen).tolist(),
        torch.randint(3, vocab, (6,), generator=gen).tolist() + span * 2,
    ]


def run(model, settings, requests: dict, speculator=None, plan=None) -> dict:
    loop = GenerationLoop(engine_for(model), settings, plan, speculator=speculator)
    return run_loop(loop, requests)


def test_lookup_proposes_what_followed_the_latest_longest_ngram():
    history = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    assert lookup(history, 2, max_ngram=3) == [7, 5]  # "2 3" last followed by 7 5 (the 3-gram "5 2 3" never occurred)
    assert lookup(history, 9, max_ngram=3) == [9, 1, 2, 3, 7, 5, 2, 3]  # none followed by 9: the first, to the end
    assert lookup([6, 6, 6, 6, 6], 2) == [6, 6]  # in a run: the latest occurrence that two tokens follow
    assert lookup([4, 5, 6], 3) == []
    assert lookup([4, 5, 4], 3, max_ngram=1) == [5, 4]
    assert lookup(history, 2, max_ngram=3, min_ngram=3) == []


# Gemma 2 stands for the Gemma 3 / OLMo 2 flags here (soft-capped attention through the extend step); the tiny
# OLMo 2's nudged draft never agrees with its target (its logits are flat), so the acceptance check cannot hold
# the hybrids (their states rolled back to the last accepted token; a hybrid draft refused): tests/test_hybrid_steps.py
SPECULATIVE_FAMILIES = [f for f in FAMILIES if f not in ("gemma3", "olmo2") and f not in LINEAR_FAMILIES]


@pytest.mark.parametrize("family", SPECULATIVE_FAMILIES)
def test_greedy_with_speculation_is_greedy_without_for_every_family(tiny_checkpoints, family):
    """Prompt lookup and a draft model (the target nudged), a batch whose rows join at different steps:
    each request's tokens equal the loop's without speculation; proposals were made, and the draft's accepted."""
    path = tiny_checkpoints(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    # GLM-4's tiny model has nearly flat logits (post-sublayer norms): nudged by 0.2 its draft kept 0 of 31 argmaxes
    draft = perturbed(path, scale=0.05 if family == "glm4" else 0.2)
    settings = compile_settings(model, EAGER_RUN)

    def requests():
        return {
            0: [GenerationRequest(p, 12, request_id=i) for i, p in enumerate(prompts()[:2])],
            2: [GenerationRequest(prompts()[2], 8, request_id=2)],
        }

    expected = run(model, settings, requests())
    lookup_spec = Speculator(PromptLookup(3))
    assert run(model, settings, requests(), lookup_spec) == expected
    draft_spec = Speculator(DraftModel(engine_for(draft), compile_settings(draft, EAGER_RUN), 3))
    assert run(model, settings, requests(), draft_spec) == expected
    for spec in (lookup_spec, draft_spec):
        assert spec.num_steps > 0 and spec.num_draft_tokens > 0
    assert draft_spec.num_accepted_tokens > 0


def _workload(eos: int) -> dict:
    """Requests joining at three steps: greedy with penalties, a stop id under min_new_tokens, logprobs,
    raw logits, one that ends after two tokens, and a seeded sampling row."""
    p = prompts()
    return {
        0: [
            GenerationRequest(p[0], 24, request_id="plain"),
            GenerationRequest(
                p[1],
                18,
                request_id="penalised",
                sampling=SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
            ),
        ],
        2: [
            GenerationRequest(
                p[2], 16, request_id="stop", sampling=SamplingParams(eos_token_ids=[eos], min_new_tokens=3)
            ),
            GenerationRequest(p[0][:20], 2, request_id="short"),
            GenerationRequest(p[1][:12] * 2, 14, request_id="logprobs", sampling=SamplingParams(logprobs=2)),
        ],
        5: [
            GenerationRequest(
                p[2][:10] * 2,
                12,
                request_id="sampled",
                sampling=SamplingParams(do_sample=True, seed=7, temperature=0.8),
            ),
            GenerationRequest(p[0], 10, request_id="logits", output_logits=True),
        ],
    }


def test_a_mixed_workload_keeps_every_row_exact_and_compiles_nothing_outside_the_plan(tiny_checkpoints):
    """Greedy rows (penalties, a stop id cutting an accepted run, logprobs, logits, a 2-token request)
    equal the loop without speculation; every graph built is a shape the plan declares, and the same
    workload run again compiles nothing."""
    path = tiny_checkpoints("llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    draft = perturbed(path)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    plan = ShapePlan(batch_sizes=[2, 4, 8], prompt_lengths=[32, 64], kv_lengths=[64, 128], max_model_len=128)
    base = run_loop_events(GenerationLoop(engine_for(model), settings, plan), _workload(eos=-1))
    eos = base["stop"][5].token  # a stop id the row meets after its min_new_tokens
    base = run_loop_events(GenerationLoop(engine_for(model), settings, plan), _workload(eos))
    assert base["stop"][-1].finish_reason == "stop"

    for proposer in (
        PromptLookup(3),
        DraftModel(engine_for(draft), compile_settings(draft, GenerationConfig(), EAGER), 3),
    ):
        spec = Speculator(proposer)
        loop = GenerationLoop(engine_for(model), settings, plan, speculator=spec)
        got = run_loop_events(loop, _workload(eos))
        for rid in ("plain", "penalised", "stop", "short", "logprobs", "logits"):
            assert [e.token for e in got[rid]] == [e.token for e in base[rid]], (type(proposer).__name__, rid)
            assert [e.finish_reason for e in got[rid]] == [e.finish_reason for e in base[rid]]
        for a, b in zip(got["logprobs"], base["logprobs"]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        for a, b in zip(got["logits"], base["logits"]):
            torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
        assert len(got["sampled"]) == 12 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens

        engines = [engine_for(model)] + ([proposer.engine] if isinstance(proposer, DraftModel) else [])
        shapes = {
            "decode": {(b, 1, k) for b, k in loop.plan.decode_shapes()},
            "prefill": {(b, n) for b, n in loop.plan.prefill_shapes()},
            "extend": {(b, t, k, n) for b, k, t, n in loop.plan.extend_shapes()},
        }
        for engine in engines:
            for g in engine.graphs.values():
                assert tuple(g.shape) in shapes[g.kind], (g.kind, g.shape)
        assert any(g.kind == "extend" and g.calls for g in engine_for(model).graphs.values())
        before = [e.graph_count() for e in engines]
        again = run_loop_events(
            GenerationLoop(engine_for(model), settings, plan, speculator=Speculator(proposer)), _workload(eos)
        )
        assert [e.graph_count() for e in engines] == before
        assert [e.token for e in again["sampled"]] == [e.token for e in got["sampled"]]  # seeded: reproducible


# ---- sampling: the target's distribution, by the rejection rule ------------------------------------------
VOCAB = 8
DRAWS = 1200


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of `counts` against `probs` (bins with an expectation
    under 1 merged into one)."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 1
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A llama over 8 tokens with a sharpened head (a distribution far from uniform), and a draft whose
    distribution is far from the target's."""
    from tiny import save_tiny

    path = save_tiny("llama", str(tmp_path_factory.mktemp("vocab8")), vocab_size=VOCAB)
    model = AutoModelForCausalLM.from_pretrained(path)
    draft = perturbed(path, scale=0.3, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
        draft.lm_head.weight.mul_(25.0)
    return model, draft


def _exact_marginals(model, prompt: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's exact distributions of the 2nd and 3rd new tokens, summed over every earlier token."""
    with torch.no_grad():

        def dist(prefixes):
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            return torch.softmax(model(input_ids=ids).logits[:, -1].double() / temperature, -1)

        p0 = dist([()])[0]
        firsts = [(a,) for a in range(VOCAB)]
        p1 = dist(firsts)  # [a, b]
        seconds = [(a, b) for a in range(VOCAB) for b in range(VOCAB)]
        p2 = dist(seconds).view(VOCAB, VOCAB, VOCAB)
    m1 = (p0[:, None] * p1).sum(0)
    m2 = (p0[:, None, None] * p1[:, :, None] * p2).sum((0, 1))
    return m1, m2


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
def test_sampled_tokens_keep_the_targets_distribution_and_plain_acceptance_does_not(small_vocab, proposer, monkeypatch):
    """1200 seeded requests: the 2nd and 3rd tokens (both verified) match the target's exact marginals
    by a chi-square test (p > 0.001), as sampling without speculation does; the same draws with every
    proposal accepted do not (p < 1e-6)."""
    model, draft = small_vocab
    temperature, draws = 0.9, DRAWS
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 1, 3, 5, 7, 0, 2, 4, 6]  # every token occurs: lookup always proposes
    m1, m2 = _exact_marginals(model, prompt, temperature)
    plan = ShapePlan(batch_sizes=[32], prompt_lengths=[16], kv_lengths=[32], max_model_len=32)
    settings = compile_settings(model, EAGER_RUN)

    def sample(speculate: bool = True):
        prop = (
            PromptLookup(2)
            if proposer == "lookup"
            else DraftModel(engine_for(draft), compile_settings(draft, EAGER_RUN), 2)
        )
        spec = Speculator(prop) if speculate else None
        requests = {
            0: [
                GenerationRequest(
                    prompt, 4, request_id=i, sampling=SamplingParams(do_sample=True, temperature=temperature, seed=i)
                )
                for i in range(draws)
            ]
        }
        out = run(model, settings, requests, spec, plan)
        assert spec is None or spec.num_draft_tokens >= draws
        tokens = torch.tensor([out[i] for i in range(draws)])
        return [torch.bincount(tokens[:, j], minlength=VOCAB) for j in (1, 2)]

    if proposer == "lookup":  # the oracle itself: sampling without speculation matches it
        c1, c2 = sample(speculate=False)
        assert _chi_square_p(c1, m1) > 1e-3 and _chi_square_p(c2, m2) > 1e-3
    c1, c2 = sample()
    assert _chi_square_p(c1, m1) > 1e-3 and _chi_square_p(c2, m2) > 1e-3
    monkeypatch.setattr(acceptance, "accept_rule", lambda p_d, q_d, u: torch.ones_like(u, dtype=torch.bool))
    c1, c2 = sample()
    assert min(_chi_square_p(c1, m1), _chi_square_p(c2, m2)) < 1e-6


# ---- where users reach it ----------------------------------------------------------------------------
def test_generate_takes_transformers_names(tiny_checkpoints):
    path = tiny_checkpoints("llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    draft = perturbed(path)
    p = prompts()
    ids = torch.tensor([p[0][:27], p[1][:23] + p[1][:4]])
    kw = dict(max_new_tokens=16, eos_token_id=None, disable_compile=True)
    expected = model.generate(ids, **kw)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, **kw), expected)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=2, max_matching_ngram_size=3, **kw), expected)
    assert torch.equal(model.generate(ids, assistant_model=draft, num_assistant_tokens=2, **kw), expected)
    assert torch.equal(model.generate(ids, assistant_model=draft, **kw), expected)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_lookup_num_tokens=0), r"prompt_lookup_num_tokens=0 must be a positive integer"),
        (
            dict(prompt_lookup_num_tokens=2, max_matching_ngram_size="3"),
            r"max_matching_ngram_size='3' must be a positive integer",
        ),
        (dict(num_assistant_tokens=3), r"num_assistant_tokens needs an assistant_model"),
        (dict(max_matching_ngram_size=3), r"max_matching_ngram_size needs prompt_lookup_num_tokens"),
        (dict(assistant_model="a path"), r"assistant_model must be a staticformers model"),
    ],
)
def test_generate_refuses_bad_speculative_arguments(tiny_checkpoints, kwargs, message):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    with pytest.raises((ValueError, TypeError), match=message):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kwargs)


def test_a_draft_with_a_larger_vocabulary_or_the_model_itself_is_refused(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    big = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama", vocab_size=256))
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(256 ids\) is larger than the target's \(128\)"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=big)
    with pytest.raises(ValueError, match="assistant_model is the model itself"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=model)
    with pytest.raises(ValueError, match="Pass prompt_lookup_num_tokens or assistant_model, not both"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=big, prompt_lookup_num_tokens=2)


def test_lora_rows_of_one_batch_speculate_with_their_own_adapters(tiny_checkpoints):
    """Rows of two adapters and of none, batched over the adapter bank: with prompt lookup, each row's
    tokens equal its tokens without (the verify step routes every row through its own adapter)."""
    from staticformers import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        model.add_adapter(
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
            adapter_name=name,
        )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(4.0)  # large enough that the adapters change the tokens
    model.enable_adapter_batching(max_adapters=3)
    settings = compile_settings(model, EAGER_RUN)
    p = prompts()

    def requests(names):
        return {
            0: [
                GenerationRequest(p[0][:23], 12, request_id=0, adapter=names[0]),
                GenerationRequest(p[1], 12, request_id=1, adapter=names[1]),
            ],
            1: [GenerationRequest(p[2][:23], 12, request_id=2, adapter=names[2])],
        }

    expected = run(model, settings, requests(["a", "__base__", "b"]))
    assert expected[0] != run(model, settings, requests(["b", "__base__", "a"]))[0]
    spec = Speculator(PromptLookup(3))
    assert run(model, settings, requests(["a", "__base__", "b"]), spec) == expected
    assert spec.num_steps > 0 and spec.num_accepted_tokens > 0


def test_a_failing_draft_ends_its_rows_with_an_error_and_the_loop_goes_on(tiny_checkpoints):
    """A draft step that raises fails the requests of that step (error events), as a failing decode step
    does; the next request is served."""
    path = tiny_checkpoints("llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    settings = compile_settings(model, EAGER_RUN)
    proposer = DraftModel(engine_for(perturbed(path)), settings, 2)
    loop = GenerationLoop(engine_for(model), settings, speculator=Speculator(proposer))
    real = proposer.propose

    def broken(**kwargs):
        raise RuntimeError("draft broke")

    proposer.propose = broken
    loop.add(GenerationRequest(prompts()[0], 6, request_id="x"))
    events = []
    while not loop.idle:
        events += loop.step()
    assert events[-1].finish_reason == "error" and "draft broke" in str(events[-1].error)
    proposer.propose = real
    expected = run(model, settings, {0: [GenerationRequest(prompts()[1], 6, request_id="y")]})
    assert run_loop(loop, {0: [GenerationRequest(prompts()[1], 6, request_id="y")]}) == expected


def test_rows_near_the_end_of_the_cache_decode_plainly_and_the_draft_catches_up(tiny_checkpoints):
    """A row that fills its 64-position cache: the steps where it has fewer than k positions left are plain
    decode steps for the batch. A draft that meets rows after plain steps prefills their prompts and
    feeds what they generated since. Every token equals the loop's without speculation."""
    path = tiny_checkpoints("llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    settings = compile_settings(model, EAGER_RUN)
    plan = ShapePlan(batch_sizes=[2], prompt_lengths=[32, 64], kv_lengths=[64], max_model_len=64)
    p = prompts()

    def requests():
        return {
            0: [GenerationRequest(p[1][:9] * 3 + p[1][:3], 34, request_id="full")],
            2: [GenerationRequest(p[0][:20], 40, request_id="later")],
        }

    expected = run(model, settings, requests(), plan=plan)
    for proposer in (PromptLookup(3), DraftModel(engine_for(perturbed(path)), settings, 3)):
        spec = Speculator(proposer)
        loop = GenerationLoop(engine_for(model), settings, plan, speculator=spec)
        assert loop.validate(GenerationRequest(p[1][:9] * 3 + p[1][:3], 34)) == 64  # 63 positions, + k capped
        assert run_loop(loop, requests()) == expected
        assert spec.num_steps > 0

    # the draft meets rows that already generated 5 tokens without it: their prompts, then what they missed
    proposer = DraftModel(engine_for(perturbed(path)), settings, 3)
    spec = Speculator(proposer)
    speculative, plain = spec.plan_verify, {"left": 4}

    def plan_verify(loop):
        if plain["left"]:  # no verify plan: the loop runs a plain decode step
            plain["left"] -= 1
            return None
        return speculative(loop)

    spec.plan_verify = plan_verify
    assert run(model, settings, requests(), spec, plan) == expected
    assert spec.num_accepted_tokens > 0


def test_a_sampling_row_draws_one_race_per_verify_where_it_stops():
    """Per verify, a sampling row draws its k acceptance uniforms, then one `[vocab]` exponential race at the
    position where it stops (not one per verified position); a row with no proposal draws exactly what a
    decode step draws. Checked on the rows' generators, and on the token: the race at the stop, from the
    residual after a rejection."""
    vocab, k = 16, 3
    sampler = RowSampler(2, vocab, torch.device("cpu"))
    for row in (0, 1):
        sampler.set_row(row, SamplingParams(do_sample=True, seed=row), [1, 2])
    logits = torch.randn(2, k + 1, vocab, generator=torch.Generator().manual_seed(3))
    proposals = [[5, 6, 7], []]
    logits[0, 0, 5] = logits[0, 1, 6] = 6.0  # the first two proposals all but certain: row 0 stops later
    verdict = acceptance.verify(sampler, logits, logits.argmax(-1), [0, 1], [0, 0], proposals)

    p = torch.softmax(logits.float(), -1)
    g0, g1 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    u = torch.empty(k).uniform_(generator=g0)
    a = 0
    while a < k and u[a] < p[0, a, proposals[0][a]]:
        a += 1
    dist = p[0, a] if a == k else p[0, a].scatter(0, torch.tensor([proposals[0][a]]), 0.0)
    want0 = int(acceptance.race(dist, torch.empty(vocab).exponential_(generator=g0)))
    want1 = int(acceptance.race(p[1, 0], torch.empty(vocab).exponential_(generator=g1)))
    assert verdict.accepted == [a, 0] and 0 < a < k
    assert verdict.tokens == [proposals[0][:a] + [want0], [want1]]
    for row, g in ((0, g0), (1, g1)):  # nothing else was drawn from either row's stream
        assert torch.equal(sampler.generators[row].get_state(), g.get_state())
