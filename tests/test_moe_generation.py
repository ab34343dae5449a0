"""Mixtures of experts through the one engine and plan: greedy tokens of a left-padded batch equal
transformers', compiled (Dynamo's graphs, counted, strict shapes) and eager; and routing never adds a
graph: all tokens forced to the same experts, or spread over them, run the same graphs with outputs
exactly transformers'."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import engine_for
from staticformers.models.moe import formulation
from tiny import MOE_FAMILIES

transformers = pytest.importorskip("transformers")

PLAN = ShapePlan(batch_sizes=[1, 4], prompt_lengths=[16, 64], kv_lengths=[96], max_model_len=96)


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")


def _left_padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 128, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def _pair(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(path)
    engine_for(ours, PLAN)
    return hf, ours


def _reference(hf, ids, mask, new=10):
    return hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None
    )


@pytest.mark.parametrize("regional", [True, False])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_left_padded_batch_equals_transformers(tiny_checkpoints, strict, family, regional):
    hf, ours = _pair(tiny_checkpoints(family))
    ids, mask = _left_padded([13, 4, 9])
    ref = _reference(hf, ids, mask)
    config = CompileConfig(backend="eager", regional=regional)
    out = ours.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        compile_config=config,
    )
    assert torch.equal(out, ref)
    eager = ours.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        disable_compile=True,
    )
    assert torch.equal(eager, ref)
    stats = ours.compile_stats()
    assert all(s["graphs"] == s["functions"] for s in stats)
    if regional and family == "qwen3-moe":  # a decode step: prepare, one sparse and one dense layer region
        decode = [s for s in stats if s["kind"] == "decode" and s["backend"] == "eager"]
        assert decode and all(s["functions"] == 3 for s in decode)


def _force_routing(model, to_one: bool, seed: int = 5):
    """Every sparse layer's router: zero (all logits tie: every token takes the same top-k experts) or
    random (tokens spread over the experts). In place, so compiled graphs that take weights as inputs stay."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # ours, transformers' gpt-oss
                p.copy_(torch.zeros_like(p) if to_one else torch.randn(p.shape, generator=g))


def _expert_counts(model, ids, mask):
    """How many tokens of the first sparse layer chose each expert (DeepSeek's choice adds its correction bias)."""
    c = model.config
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits[0]
    logits = logits[mask.reshape(-1).bool()]
    if c.family.router == "grouped_sigmoid":
        from staticformers.models.moe import route_grouped

        first = next(layer for layer in model.model.layers if layer.sparse)
        chosen = route_grouped(
            logits,
            first.mlp.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )[1]
    else:
        chosen = torch.topk(logits, c.num_experts_per_tok, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=c.num_experts)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_all_tokens_to_one_expert_or_spread_same_graphs_exact_tokens(tiny_checkpoints, strict, family):
    from torch._dynamo.utils import counters

    path = tiny_checkpoints(family)
    hf, ours = _pair(path)
    ids, mask = _left_padded([60, 7, 39, 22], seed=3)
    # prefill [4, 64]: 512 pairs in blocks; decode [4, 1]: every expert densely (both in every routing)
    c = ours.config
    assert formulation(4 * 64, c.num_experts_per_tok, c.num_experts) == "blocks"
    assert formulation(4, c.num_experts_per_tok, c.num_experts) == "dense"
    config = CompileConfig(backend="eager")
    outs, graphs = {}, []
    for to_one in (False, True, False):
        _force_routing(ours, to_one)
        _force_routing(hf, to_one)
        counts = _expert_counts(ours, ids, mask)
        used = int((counts > 0).sum())
        if to_one:
            assert used == c.num_experts_per_tok
        else:  # spread: every expert, or (DeepSeek, limited to its best groups) more than one token's choice
            assert used == c.num_experts if c.n_group == 1 else used > c.num_experts_per_tok
        counters.clear()
        out = ours.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            compile_config=config,
        )
        graphs.append(counters["stats"]["unique_graphs"])
        assert torch.equal(out, _reference(hf, ids, mask, new=8)), f"to_one={to_one}"
        outs[to_one] = out
    assert graphs[0] > 0 and graphs[1:] == [0, 0]  # the second and third routing compiled nothing
    assert not torch.equal(outs[True], outs[False])  # the routing mattered
