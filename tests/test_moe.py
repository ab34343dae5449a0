"""Mixtures of experts (Qwen3-MoE with a dense layer among sparse ones, Mixtral) against transformers:
router logits, the load-balancing loss, the loss with it, gradients, checkpoints both ways; and the
static-shape formulations of the experts against a plain loop over the chosen experts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from staticformers import AutoModelForCausalLM
from staticformers.models.moe import BLOCK, expert_mlp, formulation, num_blocks
from tiny import LINEAR_FAMILIES, MOE_FAMILIES
import tolerances as tol

transformers = pytest.importorskip("transformers")


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _batch(seed=1, batch=3, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 8:] = 0  # right padding, as training batches are
    mask[2, 5:] = 0
    return ids, mask


def test_tiny_models_have_the_layers_they_claim(tiny_checkpoints):
    qwen = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3-moe"))
    assert [layer.sparse for layer in qwen.model.layers] == [True, False, True]  # mlp_only_layers=[1]
    mixtral = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("mixtral"))
    assert all(layer.sparse for layer in mixtral.model.layers)
    experts = qwen.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 64, 64) and tuple(experts.down_proj.shape) == (4, 64, 32)
    assert not any(isinstance(m, torch.nn.Linear) for m in experts.modules())  # stacked Parameters, not Linears
    assert qwen.num_parameters() == _hf(tiny_checkpoints("qwen3-moe")).num_parameters() == qwen.config.num_parameters


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_logits_aux_loss_and_loss_match_transformers(family, tiny_checkpoints):
    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        b = ref(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        plain = ours(input_ids=ids, attention_mask=mask, labels=labels)
    assert len(a.router_logits) == len(b.router_logits) == sum(layer.sparse for layer in ours.model.layers)
    # gpt-oss: a padding query whose window holds only padding attends to its sink alone in transformers and
    # to every key here (an unused row either way), so its router logits differ; the tokens' are compared
    rows = mask.reshape(-1).bool() if family == "gpt-oss" else slice(None)
    for x, y in zip(a.router_logits, b.router_logits):
        tol.assert_close(x[rows], y[rows])
    assert float(a.loss) == pytest.approx(float(b.loss), rel=tol.FP32_REORDERED)
    assert plain.aux_loss is None and plain.router_logits is None
    tol.assert_close(a.logits[mask.bool()], b.logits[mask.bool()])
    if b.aux_loss is None:  # DeepSeek-V3 balances by its router's correction bias: no auxiliary loss
        assert a.aux_loss is None and float(a.loss) == pytest.approx(float(plain.loss), rel=tol.FP32_REORDERED)
        return
    assert float(a.aux_loss) == pytest.approx(float(b.aux_loss), rel=tol.FP32_REORDERED)
    # the aux loss is added (times router_aux_loss_coef) only when asked for, as transformers does
    coef = ours.config.router_aux_loss_coef
    assert float(a.loss) == pytest.approx(float(plain.loss) + coef * float(a.aux_loss), rel=tol.FP32_REORDERED)
    assert a.keys() == ["loss", "aux_loss", "logits", "router_logits"]


def test_aux_loss_without_mask_and_from_the_config(tiny_checkpoints):
    path = tiny_checkpoints("mixtral")
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    ours.config.output_router_logits = ref.config.output_router_logits = True
    ids, _ = _batch(seed=4)
    with torch.no_grad():
        a, b = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert float(a.aux_loss) == pytest.approx(float(b.aux_loss), rel=tol.FP32_REORDERED)
    assert float(a.loss) == pytest.approx(float(b.loss), rel=tol.FP32_REORDERED)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_gradients_with_the_aux_loss_match_transformers(family, tiny_checkpoints):
    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    ours.train(), ref.train()
    ids, _ = _batch(seed=2)
    ours(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
    ref(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
    mine = dict(ours.named_parameters())
    theirs = dict(ref.named_parameters())
    if family in ("gpt-oss", *LINEAR_FAMILIES):
        from staticformers.checkpoints.names import CheckpointNames, names_for

        # transformers holds gpt-oss's experts transposed and its router as mlp.router; a Gated DeltaNet's in_proj_qkv
        # and conv1d whole, which we hold in parts (models/linear_attention.py)
        names = names_for(ours.config) if family == "gpt-oss" else CheckpointNames(fused=ours.config.family.fused_names)
        mine = names.to_hub({n: p for n, p in mine.items()})
        grads = names.to_hub({n: p.grad for n, p in ours.named_parameters()})
        mine = {n: torch.nn.Parameter(p.detach()) for n, p in mine.items()}
        for n, p in mine.items():
            p.grad = grads[n]
    assert set(mine) == set(theirs)  # transformers 5 holds the experts stacked under the same names
    for name, p in theirs.items():
        if name.endswith((".A_log", ".dt_bias")):  # sums that cancel in float32: test_qwen3_5.py checks them in float64
            continue
        scale = max(float(p.grad.abs().max()), 1e-6)
        torch.testing.assert_close(mine[name].grad, p.grad, rtol=1e-4, atol=1e-4 * scale, msg=name)
    router = "router" if family == "gpt-oss" else "gate"
    first = next(i for i, layer in enumerate(ours.model.layers) if layer.sparse)  # DeepSeek's first layers are dense
    assert float(mine[f"model.layers.{first}.mlp.{router}.weight"].grad.abs().max()) > 0  # the router learns


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])  # gpt-oss's stacked layout: test_gpt_oss.py
def test_checkpoints_are_hub_layout_and_load_both_ways(family, tiny_checkpoints, tmp_path):
    """transformers' save (what tiny_checkpoints wrote) loads here; ours is the Hub's one-tensor-per-expert
    layout and loads in transformers with the same logits."""
    from safetensors import safe_open

    path = tiny_checkpoints(family)
    ours = AutoModelForCausalLM.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    block, gate, up, down = (
        ("mlp", "gate_proj", "up_proj", "down_proj")
        if family == "qwen3-moe"
        else ("block_sparse_moe", "w1", "w3", "w2")
    )
    for e in range(4):
        for proj in (gate, up, down):
            assert f"model.layers.0.{block}.experts.{e}.{proj}.weight" in names
    assert f"model.layers.0.{block}.gate.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    config = json.load(open(os.path.join(tmp_path, "config.json")))
    assert config["architectures"] == [type(_hf(path)).__name__]
    ref = _hf(str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ids, _ = _batch(seed=3)
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        tol.assert_close(ref(input_ids=ids).logits, want)
        assert torch.equal(again(input_ids=ids).logits, want)


def test_stacked_layout_loads_too(tiny_checkpoints, tmp_path):
    """A file holding the experts under the model's own stacked names (transformers 5's in-memory layout)."""
    from safetensors.torch import save_file

    path = tiny_checkpoints("qwen3-moe")
    ours = AutoModelForCausalLM.from_pretrained(path)
    state = {k: v.contiguous() for k, v in ours.state_dict().items()}
    save_file(state, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    ours.config.save_pretrained(str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    for name, p in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], p), name


def test_a_missing_expert_is_named(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from staticformers.models.pretrained import CheckpointError

    path = tiny_checkpoints("mixtral")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    if "model.layers.1.block_sparse_moe.experts.3.w2.weight" not in tensors:
        pytest.skip("transformers saved another layout")  # pragma: no cover
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(
        CheckpointError, match=r"lacks 1 weight\(s\) .*layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"
    ):
        AutoModelForCausalLM.from_pretrained(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# the formulations
# ---------------------------------------------------------------------------------------------
def _loop(x, weights, idx, gate_up, down):
    """transformers' reference: a loop over the experts that were hit."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        rows, slot = torch.where(idx == e)
        if rows.numel():
            g, u = (x[rows] @ gate_up[e].T).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(g) * u) @ down[e].T
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
    return out


def _routing(tokens, experts, k, how, seed=0):
    g = torch.Generator().manual_seed(seed)
    if how == "one":  # every token to the same k experts
        idx = torch.arange(k).repeat(tokens, 1)
    else:
        idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return weights / weights.sum(-1, keepdim=True), idx


@pytest.mark.parametrize("how", ["selected", "dense", "blocks"])
@pytest.mark.parametrize("routing", ["spread", "one"])
@pytest.mark.parametrize("tokens", [1, 3, 70, 200])
def test_every_formulation_equals_the_loop(how, routing, tokens):
    g = torch.Generator().manual_seed(7)
    experts, k, h, i = 8, 2, 16, 12
    x = torch.randn(tokens, h, generator=g)
    gate_up, down = torch.randn(experts, 2 * i, h, generator=g), torch.randn(experts, h, i, generator=g)
    weights, idx = _routing(tokens, experts, k, routing)
    tol.assert_close(expert_mlp(x, weights, idx, gate_up, down, how=how), _loop(x, weights, idx, gate_up, down))


@pytest.mark.parametrize("how", ["selected", "dense", "blocks"])
def test_a_slice_of_the_experts_computes_its_share(how):
    """What an expert-parallel rank computes: its experts' terms alone; the slices add up to the whole."""
    g = torch.Generator().manual_seed(8)
    experts, k, h, i, tokens = 8, 2, 16, 12, 90
    x = torch.randn(tokens, h, generator=g)
    gate_up, down = torch.randn(experts, 2 * i, h, generator=g), torch.randn(experts, h, i, generator=g)
    weights, idx = _routing(tokens, experts, k, "spread")
    parts = [
        expert_mlp(x, weights, idx, gate_up[s : s + 2], down[s : s + 2], first=s, total=experts, how=how)
        for s in range(0, experts, 2)
    ]
    tol.assert_close(sum(parts), _loop(x, weights, idx, gate_up, down))


def test_gradients_flow_through_the_blocks():
    g = torch.Generator().manual_seed(9)
    experts, k, h, i, tokens = 4, 2, 8, 6, 100
    x = torch.randn(tokens, h, generator=g, requires_grad=True)
    gate_up = torch.randn(experts, 2 * i, h, generator=g, requires_grad=True)
    down = torch.randn(experts, h, i, generator=g, requires_grad=True)
    w, idx = _routing(tokens, experts, k, "spread")
    w.requires_grad_(True)
    grads = []
    for fn in (lambda: expert_mlp(x, w, idx, gate_up, down, how="blocks"), lambda: _loop(x, w, idx, gate_up, down)):
        fn().square().sum().backward()
        grads.append([t.grad.clone() for t in (x, w, gate_up, down)])
        for t in (x, w, gate_up, down):
            t.grad = None
    for a, b in zip(*grads):
        tol.assert_close(a, b)


def test_the_policy_follows_the_work():
    """Few tokens: the chosen experts' weights alone; a few more: every expert densely; many: blocks."""
    assert formulation(1, 2, 8) == "selected" and formulation(3, 2, 8) == "selected"
    assert formulation(4, 2, 8) == "dense" and formulation(128, 2, 8) == "dense"
    assert formulation(256, 2, 8) == "blocks" and formulation(4096, 2, 8) == "blocks"
    assert num_blocks(4096, 2, 8) == 4096 * 2 // BLOCK + 7


def test_the_worst_routing_fits_the_blocks():
    """Seven experts with one pair each (seven nearly empty blocks) and the rest on the eighth: exactly
    ceil(T*k/B) + E - 1 blocks, all used, and the result still equals the loop."""
    g = torch.Generator().manual_seed(10)
    tokens, experts = 400, 8
    idx = torch.full((tokens, 1), experts - 1)
    idx[: experts - 1, 0] = torch.arange(experts - 1)
    counts = torch.bincount(idx.reshape(-1), minlength=experts)
    assert int(((counts + BLOCK - 1) // BLOCK).sum()) == num_blocks(tokens, 1, experts)
    x = torch.randn(tokens, 16, generator=g)
    gate_up, down = torch.randn(experts, 24, 16, generator=g), torch.randn(experts, 16, 12, generator=g)
    weights = torch.ones(tokens, 1)
    tol.assert_close(expert_mlp(x, weights, idx, gate_up, down, how="blocks"), _loop(x, weights, idx, gate_up, down))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_distributed_reader_plans_experts_as_chunks_of_the_stacked_tensor(family, tiny_checkpoints):
    """What every rank of a partitioned load does (here in one process, DCP planning over plain tensors):
    the per-expert files' tensors are chunks of each stacked parameter."""
    import torch.distributed.checkpoint as dcp

    from staticformers.distributed.reader import SlicedSafetensorsReader
    from staticformers.models.pretrained import checkpoint_layout, weight_files

    path = tiny_checkpoints(family)
    want = AutoModelForCausalLM.from_pretrained(path)
    files = weight_files(path)
    layout, _ = checkpoint_layout(want, files)
    state = {k: torch.zeros_like(v) for k, v in want.state_dict().items()}
    dcp.load(state, storage_reader=SlicedSafetensorsReader(path, files, layout), no_dist=True)
    for name, value in want.state_dict().items():
        assert torch.equal(state[name], value), name
