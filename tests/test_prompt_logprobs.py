"""Prompt log-probabilities from the prefill: each prompt token's log-probability and top tokens, as
transformers' log-softmax over the prompt gives them, from the scoring prefill of the same shape (the
CPU's per-layer regions and the whole-model graph), in a batch beside rows that did not ask, with the
graph count fixed by the plan. And generate's `return_dict_in_generate` / `output_logits` against
transformers' own."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.generation.sampling import SamplingParams

from tolerances import assert_close

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny import build_hf_model

    path = str(tmp_path_factory.mktemp("qwen3_scores"))
    hf = build_hf_model("qwen3", max_position_embeddings=128)
    hf.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path), hf


def hf_scores(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the prompt: row j-1 predicts token j."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("regional", [True, False], ids=["regions", "whole_model"])
def test_prompt_logprobs_equal_transformers_log_softmax(models, regional):
    model, hf = models
    engine = engine_for(model)
    engine.reset()
    settings = compile_settings(model, GenerationConfig(), CompileConfig(backend="eager", regional=regional))
    plan = ShapePlan(batch_sizes=(4,), prompt_lengths=(32,), kv_lengths=(64,))
    engine.precompile(settings, plan, scores=True)
    graphs = engine.graph_count()
    loop = GenerationLoop(engine, settings, plan)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 23, 12)]
    asked = {0: 3, 1: None, 2: 0}  # a row that did not ask shares the scoring prefill
    for i, p in enumerate(prompts):
        loop.add(GenerationRequest(p, 3, SamplingParams(prompt_logprobs=asked[i]), request_id=i))
    first = {}
    while not loop.idle:
        for e in loop.step():
            assert e.error is None, e.error
            first.setdefault(e.request_id, e)
    assert engine.graph_count() == graphs, "scoring compiled a graph outside the precompiled plan"
    assert first[1].prompt_logprobs is None
    for i in (0, 2):
        got, prompt = first[i].prompt_logprobs, prompts[i]
        assert len(got) == len(prompt) and got[0] is None
        ref = hf_scores(hf, prompt)
        want = torch.stack([ref[j - 1, prompt[j]] for j in range(1, len(prompt))])
        assert_close(torch.tensor([g[0] for g in got[1:]]), want)
        for j in range(1, len(prompt)):
            top = got[j][1]
            assert len(top) == asked[i]
            if top:
                values, ids = torch.topk(ref[j - 1], asked[i])
                assert [t for t, _ in top] == ids.tolist()
                assert_close(torch.tensor([v for _, v in top]), values)
                assert top[0][1] >= got[j][0]


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21)


def test_generate_output_logits_equal_transformers(models):
    model, hf = models
    ids = torch.tensor([[5, 9, 17, 33, 2], [7, 7, 40, 41, 99]])
    out = model.generate(
        ids,
        max_new_tokens=4,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
        compile_config=CompileConfig(backend="eager"),
    )
    ref = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(out["sequences"], ref.sequences)
    assert len(out.logits) == len(ref.logits) == 4
    for ours, theirs in zip(out.logits, ref.logits):
        assert_close(ours, theirs.float())
    assert isinstance(
        model.generate(ids, max_new_tokens=2, compile_config=CompileConfig(backend="eager")), torch.Tensor
    )
    with pytest.raises(ValueError, match="output_scores=True .* pass output_logits=True"):
        model.generate(ids, max_new_tokens=2, return_dict_in_generate=True, output_scores=True)
