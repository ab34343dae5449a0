"""The mixture-of-experts block: exact top-k routing, stacked experts, shapes that never depend on the routing.

A sparse layer's MLP (`SparseMoeBlock`) scores each token against every expert with its router (`gate`,
a bias-free linear), keeps the `top_k` experts of the softmax, optionally renormalises their weights,
and sums the chosen experts' SwiGLU outputs scaled by those weights. The routing is computed exactly
as transformers 5 computes it (softmax in float32, `torch.topk`, the renormalisation, then the weights
in the logits' dtype for Qwen3-MoE or kept in float32 for Mixtral), and no token is ever dropped.

**Static shapes.** A compile-per-shape device cannot afford a shape that depends on which expert a
token chose (torchtitan's and transformers' loops over the experts that were hit, or their variable
all-to-all splits). Every formulation here has shapes fixed by the token count `T` alone:

- `"selected"`: each (token, expert) pair multiplies its token by its expert's weights, gathered
  (`T * top_k` rows of one token). It reads only the chosen experts' weights, which is what a decode
  step of a few tokens is bound by; `T * top_k` gathered matrices cost more than all `E` once
  `T * top_k >= E`.
- `"dense"`: every expert on every token (`E * T` rows, one batched matmul per projection), the
  unchosen experts weighted by zero (their zeros are added exactly, so the sum is the chosen terms,
  in expert order as transformers adds them). No gathers and no sort: for a handful of tokens the
  weights are read once and the wasted rows are free.
- `"blocks"`: the pairs are sorted by expert into `ceil(T * top_k / B) + E - 1` blocks of `B` rows
  (NxD Inference's bound: each expert wastes at most one partly filled block), each block belonging to
  one expert, padding rows pointing at a zero token with weight zero; one batched matmul over the
  blocks, then the outputs are added back to their tokens. It computes `T * top_k` useful rows plus at
  most `(E - 1) * B` padding, against `E * T` for dense.

`formulation(T, top_k, E)` picks by the work each does: "selected" while `T * top_k < E`, "dense"
while `E * T` rows are no more than the blocks' rows, "blocks" past that. So a decode step (batch 1-8)
runs "selected" or "dense" and a prefill or a training batch runs "blocks", each one graph per
shape whatever the router decides. The products go through `ops.expert_matmul` (the seam of `ops.py`),
so a backend may compute them its own way (the CPU's batch-1 decode: a weight-streaming reduction that
reads each gathered row in place).

Expert parallelism splits the experts from outside (`distributed/expert_parallel.py` sets
`Experts.exchange`); `expert_mlp` then runs this rank's slice of the experts (`first`, of `total`),
routes to other ranks' experts counting for nothing.

**DeepSeek-V3** routes by sigmoid scores with a learned correction bias, limited to the best groups of
experts (`route_grouped`, the router `GroupedRouter`), and adds its shared experts (one dense MLP given
to `SparseMoeBlock`) to every token's output; Qwen3.5-MoE adds one shared expert times a per-token sigmoid
gate (`shared_expert`, `shared_expert_gate`). The shapes stay those of the token count.

**The load-balancing loss** (`load_balancing_loss`) is transformers' `load_balancing_loss_func`
(Switch Transformer's: the experts' share of routed tokens times their mean router probability,
summed, times E, over every sparse layer at once), computed from per-layer sums so that a
data-parallel run can add the ranks' sums (`data_parallel`) and train exactly as one process would.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from .expert_activations import activation_for, swiglu
from .ops import PLAIN, Ops
from .quantized_values import FP8, quantize_rows

# rows per block of the "blocks" formulation: padding at most (E - 1) * BLOCK rows per layer, and one
# gathered copy of an expert's weights per block (a block of B rows does B/2 FLOPs per byte copied)
BLOCK = 128
FORMULATIONS = ("selected", "dense", "blocks")


def num_blocks(tokens: int, top_k: int, experts: int, block: int = BLOCK) -> int:
    """Blocks the sorted pairs of `tokens` tokens need, whatever the routing: ceil(T*k/B) + E - 1."""
    return math.ceil(tokens * top_k / block) + experts - 1


def formulation(tokens: int, top_k: int, experts: int, block: int = BLOCK) -> str:
    """The formulation of `tokens` tokens over `experts` experts (see the module docstring)."""
    if tokens * top_k < experts:
        return "selected"
    if experts * tokens <= num_blocks(tokens, top_k, experts, block) * block:
        return "dense"
    return "blocks"


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------
def route(
    logits: torch.Tensor, top_k: int, normalize: bool, weights_fp32: bool, topk_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) `[T, top_k]` from router logits `[T, E]`, as transformers computes them: softmax
    in float32, top-k, renormalised if asked, the weights cast back to the logits' dtype unless `weights_fp32`;
    `topk_first` (gpt-oss): top-k over the logits, then the softmax of the chosen k in the logits' dtype."""
    if topk_first:
        top, experts = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_fp32 else weights.to(logits.dtype)), experts


def route_grouped(
    logits: torch.Tensor,
    correction: torch.Tensor,
    top_k: int,
    groups: int,
    top_groups: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's choice, as transformers computes it, from float32 router logits `[T, E]`: sigmoid scores;
    the experts are chosen by the scores plus the `correction` bias `[E]`, among the `top_groups` of `groups`
    groups whose best two corrected scores sum highest; their weights are the uncorrected scores,
    renormalised if asked, times `scaling` (float32). Shapes depend on `T` alone."""
    scores = logits.sigmoid()
    choice = scores + correction.float()
    t, e = choice.shape
    group_scores = choice.view(t, groups, e // groups).topk(2, dim=-1).values.sum(-1)  # [T, groups]
    best_groups = group_scores.topk(top_groups, dim=-1, sorted=False).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best_groups, True)
    allowed = allowed.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)
    experts = choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


class GroupedRouter(nn.Module):
    """DeepSeek-V3's router (`mlp.gate`): `weight` `[E, H]` scored in float32, and `e_score_correction_bias`
    `[E]`, a buffer that stays float32 whatever the model's dtype (transformers keeps it so); `forward`
    returns the float32 logits."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        b = self.e_score_correction_bias
        if b.is_floating_point() and b.dtype != torch.float32:
            self.e_score_correction_bias = b.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight.float())


# ---------------------------------------------------------------------------------------------
# the experts' MLP in three formulations
# ---------------------------------------------------------------------------------------------
def expert_mlp(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ops: Ops = PLAIN,
    first: int = 0,
    total: Optional[int] = None,
    how: Optional[str] = None,
    scales: Optional[tuple] = None,
    biases: Optional[tuple] = None,
    act: Callable = swiglu,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * down(act(gate_up(x))) (`act`: `expert_activations.py`,
    default silu(gate) * up).

    x `[T, H]`; weights, experts `[T, k]` (global expert ids); gate_up `[E_l, 2I, H]`, down `[E_l, H, I]`:
    experts `first .. first + E_l - 1` of `total` (a rank's slice under expert parallelism; routes to
    the others count for nothing). `how`: a formulation (default: `formulation(T, k, E_l)`). `scales`:
    quantized stacks' `(gate_up_scale [E_l, 2I, 1], down_scale [E_l, H, 1])`, None for full-precision ones.
    `biases`: `(gate_up_bias [E_l, 2I], down_bias [E_l, H])` added to each product (gpt-oss), or None."""
    local = gate_up.shape[0]
    total = local if total is None else total
    idx = experts if first == 0 else experts - first
    if local < total:  # routes to other ranks' experts: weight zero, index kept in range
        valid = (idx >= 0) & (idx < local)
        weights = weights.masked_fill(~valid, 0.0)
        idx = idx.clamp(0, local - 1)
    else:
        valid = None
    how = how or formulation(x.shape[0], experts.shape[-1], local)
    gate_up, down = (gate_up, None), (down, None)
    if scales is not None:
        gate_up, down = (gate_up[0], scales[0]), (down[0], scales[1])
    biases = biases or (None, None)
    if how == "selected":
        return _selected(x, weights, idx, gate_up, down, ops, biases, act)
    if how == "dense":
        return _dense(x, weights, idx, gate_up, down, ops, biases, act)
    if how == "blocks":
        return _blocks(x, weights, idx, valid, gate_up, down, ops, biases, act)
    raise ValueError(f"Unknown expert formulation {how!r}: use one of {', '.join(FORMULATIONS)}.")


def _weighted(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An expert's output scaled by its routing weight, in the weight's dtype, then in the tokens' (as
    transformers does: Mixtral's float32 weights scale in float32)."""
    return (y * w.unsqueeze(-1)).to(dtype)


def _biased(y: torch.Tensor, bias: Optional[torch.Tensor], index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`y` `[G, R, out]` plus each group's expert bias (`bias[index]`, or all experts in order), if any."""
    if bias is None:
        return y
    b = bias if index is None else bias.index_select(0, index)
    return y + b.unsqueeze(1).to(y.dtype)


def _selected(x, weights, idx, gate_up, down, ops: Ops, biases, act) -> torch.Tensor:
    t, k = idx.shape
    pairs = idx.reshape(-1)
    rows = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, H]
    h = _biased(ops.expert_matmul(rows, *gate_up, index=pairs), biases[0], pairs)  # [T*k, 1, 2I]
    y = _biased(ops.expert_matmul(act(h), *down, index=pairs), biases[1], pairs).squeeze(1)  # [T*k, H]
    return _weighted(y, weights.reshape(-1), x.dtype).view(t, k, -1).sum(dim=1)


def _dense(x, weights, idx, gate_up, down, ops: Ops, biases, act) -> torch.Tensor:
    t = x.shape[0]
    local = gate_up[0].shape[0]
    h = _biased(ops.expert_matmul(x.unsqueeze(0), *gate_up), biases[0])  # [E, T, 2I]
    y = _biased(ops.expert_matmul(act(h), *down), biases[1])  # [E, T, H]
    # each token's weight per expert, zero where not chosen (scatter_add: masked routes may share an index)
    per_expert = torch.zeros(t, local, dtype=weights.dtype, device=x.device).scatter_add(1, idx, weights)
    return _weighted(y, per_expert.t(), x.dtype).sum(dim=0)


def _blocks(x, weights, idx, valid, gate_up, down, ops: Ops, biases, act, block: int = BLOCK) -> torch.Tensor:
    t, k = idx.shape
    local = gate_up[0].shape[0]
    n = num_blocks(t, k, local, block)
    slots = n * block
    device = x.device
    pair_expert = idx.reshape(-1)
    pair_token = torch.arange(t, device=device).repeat_interleave(k)
    pair_weight = weights.reshape(-1)
    live = torch.ones_like(pair_expert, dtype=torch.bool) if valid is None else valid.reshape(-1)
    # per expert: its pairs, the blocks they fill, where its blocks start
    counts = torch.zeros(local, dtype=torch.long, device=device).scatter_add(0, pair_expert, live.long())
    blocks = (counts + block - 1) // block
    first_block = torch.cumsum(blocks, 0) - blocks
    first_pair = torch.cumsum(counts, 0) - counts
    # pairs sorted by expert (routes to other ranks' experts last), each given its slot in its expert's blocks
    key = torch.where(live, pair_expert, local)
    order = torch.sort(key, stable=True).indices
    sorted_expert = pair_expert[order]
    rank = torch.arange(order.shape[0], device=device) - first_pair[sorted_expert]
    slot = torch.where(live[order], first_block[sorted_expert] * block + rank, slots)  # dead routes: a trash slot
    slot_token = torch.full((slots + 1,), t, dtype=torch.long, device=device).scatter(0, slot, pair_token[order])[
        :slots
    ]
    slot_weight = torch.zeros(slots + 1, dtype=weights.dtype, device=device).scatter(0, slot, pair_weight[order])[
        :slots
    ]
    # block b belongs to the expert whose block range holds b (unused blocks at the end: the last expert, no tokens)
    ends = torch.cumsum(blocks, 0)
    block_expert = (torch.arange(n, device=device).unsqueeze(1) >= ends.unsqueeze(0)).sum(1).clamp(max=local - 1)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row t: the zero token of padding slots
    rows = padded.index_select(0, slot_token).view(n, block, -1)
    h = _biased(ops.expert_matmul(rows, *gate_up, index=block_expert), biases[0], block_expert)  # [n, B, 2I]
    y = _biased(ops.expert_matmul(act(h), *down, index=block_expert), biases[1], block_expert).reshape(slots, -1)
    out = padded.new_zeros(t + 1, x.shape[1]).index_add(0, slot_token, _weighted(y, slot_weight, x.dtype))
    return out[:t]


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------
class Experts(nn.Module):
    """Every expert's SwiGLU MLP, stacked: `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`
    (transformers 5's names and layout; the Hub's one-tensor-per-expert names are `checkpoints/names.py`'s).

    `exchange` (None in one process) is set by expert parallelism: it brings this rank's experts the
    tokens routed to them from the other ranks and returns the results (`distributed/expert_parallel.py`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool = False, act: Callable = swiglu):
        super().__init__()
        self.num_experts = num_experts  # the model's experts (a rank may hold a slice of them)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        if bias:  # gpt-oss: one bias per expert and output row, never quantized
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.act = act
        self.exchange: Optional[Callable] = None

    quantized: Optional[str] = None  # "int8" / "fp8" once `quantize` ran: the weights' kind, with `*_scale` beside them

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)
        if self.gate_up_proj_bias is not None:
            nn.init.zeros_(self.gate_up_proj_bias)
            nn.init.zeros_(self.down_proj_bias)

    def quantize(self, kind: str, empty: bool = False) -> None:
        """Store both stacks quantized per output row (`models/quantization.py`): `gate_up_proj` and
        `down_proj` in `kind`'s dtype, `gate_up_proj_scale` `[E, 2I, 1]` and `down_proj_scale` `[E, H, 1]` in
        the model's; `empty`: only the shapes and dtypes (a meta-built model about to load a quantized file)."""
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name)
            if empty:
                q = torch.empty(w.shape, dtype=torch.int8 if kind == "int8" else FP8, device=w.device)
                scale = torch.empty(*w.shape[:-1], 1, dtype=w.dtype, device=w.device)
            else:
                q, scale = quantize_rows(w, kind, w.dtype)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(scale, requires_grad=False))
        self.quantized = kind

    def scales(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return (self.gate_up_proj_scale, self.down_proj_scale) if self.quantized else None

    def biases(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return None if self.gate_up_proj_bias is None else (self.gate_up_proj_bias, self.down_proj_bias)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ops: Ops = PLAIN) -> torch.Tensor:
        if self.exchange is not None:
            if self.quantized:
                raise ValueError(
                    "Expert parallelism over quantized experts is not supported: load the model "
                    "unquantized for expert parallelism."
                )
            return self.exchange(self, x, weights, experts, ops)
        return expert_mlp(
            x,
            weights,
            experts,
            self.gate_up_proj,
            self.down_proj,
            ops,
            scales=self.scales(),
            biases=self.biases(),
            act=self.act,
        )


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: the router (`gate`) and the `experts`; returns the output and the router logits."""

    def __init__(self, config, shared_experts: Optional[nn.Module] = None, shared_expert: Optional[nn.Module] = None):
        super().__init__()
        h = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.weights_fp32 = config.family.routing_weights_fp32
        self.jitter_noise = config.router_jitter_noise
        self.topk_first = config.family.topk_before_softmax
        self.grouped = config.family.router == "grouped_sigmoid"
        if self.grouped:  # DeepSeek-V3
            self.gate = GroupedRouter(h, config.num_experts)
            self.groups, self.top_groups = config.n_group, config.topk_group
            self.scaling = config.routed_scaling_factor
        else:
            self.gate = nn.Linear(h, config.num_experts, bias=config.family.router_bias)
        self.experts = Experts(
            config.num_experts,
            h,
            config.moe_intermediate_size,
            bias=config.family.expert_bias,
            act=activation_for(config),
        )
        self.shared_experts = shared_experts  # DeepSeek's MLP on every token, beside the routed experts
        self.shared_expert = shared_expert  # Qwen3.5-MoE's, scaled per token by sigmoid(shared_expert_gate(x))
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if shared_expert is not None else None

    def forward(self, x: torch.Tensor, ops: Ops = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[b, s, H]` -> (`[b, s, H]`, router logits `[b * s, E]`)."""
        b, s, h = x.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's training-time multiplicative noise
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = x.reshape(-1, h)
        logits = self.gate(flat)
        if self.grouped:
            weights, experts = route_grouped(
                logits,
                self.gate.e_score_correction_bias,
                self.top_k,
                self.groups,
                self.top_groups,
                self.normalize,
                self.scaling,
            )
        else:
            weights, experts = route(logits, self.top_k, self.normalize, self.weights_fp32, self.topk_first)
        out = self.experts(flat, weights, experts, ops).view(b, s, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ops)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(ops.linear(self.shared_expert_gate, x)) * self.shared_expert(x, ops)
        return out, logits


# ---------------------------------------------------------------------------------------------
# the load-balancing loss
# ---------------------------------------------------------------------------------------------
def routing_sums(logits: torch.Tensor, top_k: int, mask: Optional[torch.Tensor] = None) -> tuple:
    """One layer's (routed-token counts `[E]`, summed router probabilities `[E]`, rows) for the loss:
    transformers' per-layer terms, `mask` (`[T]`, 1 = a real token) leaving padding out."""
    probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers does
    chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
    experts = logits.shape[-1]
    if mask is None:
        ones = torch.ones_like(chosen, dtype=torch.float32)
        counts = torch.zeros(experts, dtype=torch.float32, device=logits.device).scatter_add(0, chosen, ones)
        return counts, probs.float().sum(dim=0), float(logits.shape[0])
    m = mask.reshape(-1).to(device=logits.device, dtype=torch.float32)
    counts = torch.zeros(experts, dtype=torch.float32, device=logits.device).scatter_add(
        0, chosen, m.repeat_interleave(top_k)
    )
    return counts, (probs.float() * m.unsqueeze(-1)).sum(dim=0), m.sum()


def load_balancing_loss(
    router_logits,
    num_experts: int,
    top_k: int,
    attention_mask: Optional[torch.Tensor] = None,
    data_parallel=None,
    share: bool = False,
) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` over every sparse layer's logits (`[T, E]` each).

    `data_parallel` (None in one process; see `CausalLM.data_parallel`) has `size` and `sum(t)` (the
    sum over the data-parallel ranks, no gradient): the counts and probabilities are then the whole
    data-parallel batch's, as one process on all of it would see them. What each rank returns depends on
    how its loss is combined: averaged over the ranks (`share=False`, a mean loss) it is the whole
    batch's loss; summed (`share=True`, a loss divided by the global token count) it is 1/size of it.
    Either way the gradients add up to the whole batch's."""
    counts = probs = rows = 0.0
    for layer in router_logits:
        c, p, r = routing_sums(layer, top_k, attention_mask)
        counts, probs, rows = counts + c, probs + p, rows + r
    if data_parallel is not None and data_parallel.size > 1:
        n = data_parallel.size
        rows_t = torch.as_tensor(rows, dtype=torch.float32, device=counts.device)
        counts, rows = data_parallel.sum(counts.detach()), data_parallel.sum(rows_t)
        whole = data_parallel.sum(probs.detach())
        probs = (whole / n + (probs - probs.detach())) if share else (whole + n * (probs - probs.detach()))
    return (counts / rows * (probs / rows)).sum() * num_experts


__all__ = [
    "BLOCK",
    "FORMULATIONS",
    "num_blocks",
    "formulation",
    "route",
    "route_grouped",
    "GroupedRouter",
    "expert_mlp",
    "Experts",
    "SparseMoeBlock",
    "routing_sums",
    "load_balancing_loss",
]
