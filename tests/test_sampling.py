"""Logits processors against transformers' on random logits, each row of a batch with its own settings;
reproducible per-row sampling; bad options refused with one sentence."""

import pytest
import torch

from staticformers.generation import sampling
from staticformers.generation.sampling import RowSampler, SamplingParams

tp = pytest.importorskip("transformers.generation.logits_process")


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(4, 97) * 3


@pytest.mark.parametrize("k", [1, 5, 50, 200])
def test_top_k(logits, k):
    assert torch.equal(sampling.top_k(logits, k), tp.TopKLogitsWarper(k)(None, logits))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p(logits, p):
    assert torch.equal(sampling.top_p(logits, p), tp.TopPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("p", [0.0, 0.05, 0.5])
def test_min_p(logits, p):
    assert torch.equal(sampling.min_p(logits, p), tp.MinPLogitsWarper(p)(None, logits))


def test_temperature(logits):
    assert torch.equal(sampling.temperature(logits, 0.7), tp.TemperatureLogitsWarper(0.7)(None, logits))


def test_full_chain_matches_transformers_distribution(logits):
    chain = [
        tp.TemperatureLogitsWarper(0.8),
        tp.TopKLogitsWarper(20),
        tp.TopPLogitsWarper(0.9),
        tp.MinPLogitsWarper(0.05),
    ]
    ref = logits
    for proc in chain:
        ref = proc(None, ref)
    out = sampling.min_p(sampling.top_p(sampling.top_k(sampling.temperature(logits, 0.8), 20), 0.9), 0.05)
    assert torch.equal(out, ref)


ROW_SETTINGS = [
    dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    dict(do_sample=True, top_k=5),
    dict(do_sample=False),
    dict(do_sample=True, temperature=1.3, top_p=0.5),
]


def _reference(row_logits, settings):
    """transformers' warpers of one row's settings."""
    out = row_logits
    if settings.get("temperature") not in (None, 1.0):
        out = tp.TemperatureLogitsWarper(settings["temperature"])(None, out)
    if settings.get("top_k"):
        out = tp.TopKLogitsWarper(settings["top_k"])(None, out)
    if settings.get("top_p") not in (None, 1.0):
        out = tp.TopPLogitsWarper(settings["top_p"])(None, out)
    if settings.get("min_p") is not None:
        out = tp.MinPLogitsWarper(settings["min_p"])(None, out)
    return out


def test_each_row_gets_its_own_warpers(logits, monkeypatch):
    """Rows with different settings in one call: each row's filtered distribution is transformers' for
    that row's settings (seen through the probabilities the draw uses)."""
    seen = {}
    real_softmax = torch.softmax

    def spy(x, dim=-1, **kw):
        seen["probs"] = real_softmax(x, dim=dim, **kw)
        return seen["probs"]

    s = RowSampler(4, 97, torch.device("cpu"))
    for slot, settings in enumerate(ROW_SETTINGS):
        s.set_row(slot, SamplingParams(**settings, seed=slot), [1, 2])
    monkeypatch.setattr(torch, "softmax", spy)
    choice = s.choose(logits, logits.argmax(-1), [0, 1, 2, 3], [0, 0, 0, 0])
    monkeypatch.undo()
    for i, settings in enumerate(ROW_SETTINGS):
        if settings["do_sample"]:
            want = real_softmax(_reference(logits[i : i + 1], settings), dim=-1)
            torch.testing.assert_close(seen["probs"][i : i + 1], want, rtol=0, atol=0)
            assert want[0, choice.ids[i]] > 0  # drawn among the tokens the warpers keep
        else:
            assert choice.ids[i] == logits[i].argmax()


def test_repetition_penalty_counts_prompt_and_generated_tokens(logits):
    ids = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(2))
    s = RowSampler(4, 97, torch.device("cpu"))
    for slot in range(4):
        s.set_row(slot, SamplingParams(repetition_penalty=1.3 if slot % 2 else None), ids[slot].tolist())
    first = s.choose(logits, logits.argmax(-1), [0, 1, 2, 3], [0] * 4).ids
    ref = tp.RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    assert torch.equal(first[1::2], ref.argmax(-1)[1::2]) and torch.equal(first[::2], logits.argmax(-1)[::2])
    s.observe([0, 1, 2, 3], first)
    history = torch.cat([ids, first.view(4, 1)], 1)
    second = s.choose(logits, logits.argmax(-1), [0, 1, 2, 3], [1] * 4).ids
    ref2 = tp.RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    assert torch.equal(second[1::2], ref2.argmax(-1)[1::2])


def test_presence_and_frequency_penalties_follow_openai(logits):
    s = RowSampler(1, 97, torch.device("cpu"))
    s.set_row(0, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logprobs=0), [3])
    top = int(logits[0].argmax())
    s.observe([0], torch.tensor([top]))
    s.observe([0], torch.tensor([top]))
    choice = s.choose(logits[:1], logits[:1].argmax(-1), [0], [2])
    # the raw distribution is reported; the choice sees top's logit lowered by 0.5 + 2 * 0.25
    lowered = logits[0].clone()
    lowered[top] -= 1.0
    assert int(choice.ids[0]) == int(lowered.argmax())
    assert abs(float(choice.logprobs[0]) - float(torch.log_softmax(logits[0], -1)[choice.ids[0]])) < 1e-6


def test_min_new_tokens_forbids_each_rows_stop_ids(logits):
    logits[:, 7] = 100.0
    logits[:, 9] = 90.0
    s = RowSampler(2, 97, torch.device("cpu"))
    s.set_row(0, SamplingParams(min_new_tokens=2, eos_token_ids=[7]), [1])
    s.set_row(1, SamplingParams(min_new_tokens=1, eos_token_ids=[7, 9]), [1])
    rows = logits[:2]
    without = rows[1].clone()
    without[[7, 9]] = float("-inf")
    assert s.choose(rows, rows.argmax(-1), [0, 1], [0, 0]).ids.tolist() == [9, int(without.argmax())]
    assert s.choose(rows, rows.argmax(-1), [0, 1], [1, 1]).ids.tolist() == [9, 7]
    assert s.choose(rows, rows.argmax(-1), [0, 1], [2, 2]).ids.tolist() == [7, 7]


def test_plain_greedy_uses_the_graphs_argmax(logits):
    s = RowSampler(4, 97, torch.device("cpu"))
    for slot in range(4):
        s.set_row(slot, SamplingParams(), [1])
    marker = torch.tensor([5, 6, 7, 8])
    assert s.choose(logits, marker, [0, 1, 2, 3], [0] * 4).ids is marker


def test_a_seeded_row_draws_the_same_whatever_its_neighbours(logits):
    def draw(rows_settings, slot_of_seeded):
        s = RowSampler(4, 97, torch.device("cpu"))
        for slot, params in rows_settings.items():
            s.set_row(slot, params, [1])
        rows = sorted(rows_settings)
        out = []
        for step in range(6):
            same = logits[:1].expand(len(rows), -1)  # every row sees the same logits
            ids = s.choose(same, same.argmax(-1), rows, [step] * len(rows)).ids
            out.append(int(ids[rows.index(slot_of_seeded)]))
        return out

    seeded = dict(do_sample=True, temperature=1.5, seed=11)
    alone = draw({0: SamplingParams(**seeded)}, 0)
    crowded = draw(
        {
            0: SamplingParams(do_sample=True, seed=3),
            2: SamplingParams(**seeded),
            3: SamplingParams(do_sample=True, top_k=3),
        },
        2,
    )
    assert alone == crowded
    assert alone != draw({0: SamplingParams(do_sample=True, temperature=1.5, seed=12)}, 0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(do_sample=True, temperature=0.0), "temperature=0.0 must be greater than 0"),
        (dict(do_sample=True, top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(do_sample=True, top_p=0.0), r"top_p=0.0 must be in"),
        (dict(do_sample=True, top_k=-1), "top_k=-1"),
        (dict(top_k=2.5), "top_k=2.5 must be an integer"),
        (dict(temperature="hot"), "temperature='hot' must be a finite number"),
        (dict(temperature=float("nan")), "temperature=nan must be a finite number"),
        (dict(do_sample="yes"), "do_sample='yes' must be True or False"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
        (dict(presence_penalty=3.0), r"presence_penalty=3.0 must be in \[-2, 2\]"),
        (dict(seed=2**70), r"seed=1180591620717411303424 must be an integer from 0 to 2\*\*64 - 1"),
        (dict(logprobs=21), "logprobs=21 must be between 0 and 20"),
        (dict(min_new_tokens=-1), "min_new_tokens=-1"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
