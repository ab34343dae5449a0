"""Logits processors against transformers' on random logits; reproducible sampling; bad options."""

import pytest
import torch

from staticformers.generation import sampling
from staticformers.generation.sampling import Sampler

tp = pytest.importorskip("transformers.generation.logits_process")


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(4, 97) * 3


@pytest.mark.parametrize("k", [1, 5, 50, 200])
def test_top_k(logits, k):
    assert torch.equal(sampling.top_k(logits, k), tp.TopKLogitsWarper(k)(None, logits))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1.0])
def test_top_p(logits, p):
    assert torch.equal(sampling.top_p(logits, p), tp.TopPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 1.0])
def test_min_p(logits, p):
    assert torch.equal(sampling.min_p(logits, p), tp.MinPLogitsWarper(p)(None, logits))


def test_temperature(logits):
    assert torch.equal(sampling.temperature(logits, 0.7), tp.TemperatureLogitsWarper(0.7)(None, logits))


def test_repetition_penalty_with_left_padding(logits):
    ids = torch.randint(0, 97, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[3, :9] = 0
    ref = tp.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=(mask != 0).int().argmax(1))(ids, logits.clone())
    s = Sampler(repetition_penalty=1.3)
    s.start(ids, mask, 97, torch.device("cpu"))
    assert torch.equal(s(logits, 0), ref.argmax(-1))
    assert torch.equal(sampling.repetition_penalty(logits, s.seen, 1.3), ref)


def test_min_new_tokens_forbids_eos(logits):
    logits[:, 7] = 100.0
    s = Sampler(min_new_tokens=2, eos_token_ids=[7])
    assert (s(logits, 0) != 7).all() and (s(logits, 1) != 7).all() and (s(logits, 2) == 7).all()


def test_full_chain_matches_transformers_distribution(logits):
    chain = [tp.TemperatureLogitsWarper(0.8), tp.TopKLogitsWarper(20), tp.TopPLogitsWarper(0.9), tp.MinPLogitsWarper(0.05)]
    ref = logits
    for proc in chain:
        ref = proc(None, ref)
    out = logits
    out = sampling.min_p(sampling.top_p(sampling.top_k(sampling.temperature(out, 0.8), 20), 0.9), 0.05)
    assert torch.equal(out, ref)


def test_same_seed_same_tokens(logits):
    def draw(seed):
        s = Sampler(do_sample=True, temperature=0.9, top_k=30, top_p=0.95,
                    generator=torch.Generator().manual_seed(seed))
        return torch.stack([s(logits, i) for i in range(5)])

    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))


@pytest.mark.parametrize("kwargs,match", [
    (dict(do_sample=True, temperature=0.0), "temperature=0.0 must be greater than 0"),
    (dict(do_sample=True, top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(do_sample=True, top_p=0.0), r"top_p=0.0 must be in"),
    (dict(do_sample=True, top_k=-1), "top_k=-1"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampler(**kwargs)
