"""Expert parallelism: a mixture's experts split over the EP group, tokens exchanged in fixed-size buffers.

`apply_ep` (after tensor parallel, before FSDP2: `parallelize.py`) makes every sparse layer's stacked
experts (and their biases, gpt-oss) a DTensor sharded over the expert dimension on the `ep` mesh (`Shard(0)`: rank j of the group
holds experts `j * E/ep .. (j+1) * E/ep - 1`) and sets `Experts.exchange`, which the model calls instead
of its own experts. FSDP2 then shards each rank's experts over the `efsdp` ranks that hold the same
ones (`parallelize.apply_fsdp`). The router and everything else follow the dense layout.

**The exchange never depends on the routing.** Variable all-to-all splits (torchtitan, transformers'
`all_to_all`) read each expert's token count back to the host every layer and give every step a new
shape. Here (`ep_implementation="auto"`) every rank of an EP group holds the same number of tokens
(the batch shapes are static), so:

1. (tp > 1) each rank of a TP group keeps its `1/tp` slice of the batch the group shares (padded to a
   multiple of tp), so that no token is computed twice;
2. all-gather, over the EP group, of every rank's tokens `[T, H]`, routing weights and expert ids `[T, k]`;
3. every rank runs its own experts on all gathered tokens (`moe.expert_mlp` with `first`/`total`:
   routes to other ranks' experts count for nothing; its formulation is chosen by the gathered count);
4. reduce-scatter (sum) of the partial outputs `[ep * T, H]` back to the ranks that own the tokens
   (on gloo: an all-to-all of the same chunks, then the sum on each rank; the same bytes:
   `sum_scatter_rows`);
5. (tp > 1) all-gather of the TP slices (DTensor `Shard(0) -> Replicate`).

Each collective is waited for before the next one is issued. On gloo, functional collectives left in
flight together on one group corrupt the heap (three all-gathers issued back to back, then waited:
segfaults and `malloc(): unaligned tcache chunk` in about a third of 4-rank runs of a 3000-step stress
script with this PyTorch, none in as many runs with a wait after each); the exchange's collectives
depend on each other anyway, so nothing is lost on other backends. The backward's collectives (the
autograd functions below) are waited for in the same way.

Bytes moved per sparse layer and rank, forward, with `T` the rank's tokens (`ceil(B*S/tp)`), H the
hidden size, n = ep, b the activation width: the all-gather receives `(n-1) * T * (H*b + k*(b+8))`,
the reduce-scatter sends and receives `(n-1) * T * H * b` each (a ring); the TP all-gather `(tp-1) * T
* H * b`. The backward moves the same again (the all-gather's backward is a reduce-scatter, and the
reverse). An ideal variable all-to-all would move `k * T * H * b * (n-1)/n` each way: the same for
n = 2 and k = 2, about `n/k` times less for larger groups; the price of shapes that never change.

`ep_implementation="all_reduce"` (ep == tp: the EP group is the TP group, which shares one batch):
each rank runs its experts on the whole batch and the partial outputs are all-reduced, `2 (n-1)/n *
T * H * b` per layer; the inputs' gradients (partial: each rank back-propagates through its experts
only) are all-reduced in the backward.

The load-balancing loss sums its router statistics over the data-parallel ranks (`DataParallelSum`,
set as `model.data_parallel`), so a partitioned model trains as one process on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..models.moe import expert_mlp
from .grad_scale import ScaleGrad
from .mesh import ParallelDims


def expert_gradient_factor(dims: ParallelDims) -> float:
    """What an expert's gradient is multiplied by so that FSDP2's average over the `efsdp` ranks holding
    it (and `dp_replicate`) becomes the average over all `dp` data-parallel ranks, as every other
    parameter's: efsdp * dp_replicate / dp = tp / ep."""
    return dims.tp / dims.ep


def _local(t: torch.Tensor, factor: float) -> torch.Tensor:
    t = t.to_local() if isinstance(t, DTensor) else t
    return ScaleGrad.apply(t, factor) if factor != 1.0 else t


def local_experts(experts: nn.Module, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's stacked expert weights (the DTensors' local shards), their gradients scaled by `factor`."""
    return _local(experts.gate_up_proj, factor), _local(experts.down_proj, factor)


def local_biases(experts: nn.Module, factor: float):
    """This rank's experts' biases `(gate_up [E_l, 2I], down [E_l, H])` (gpt-oss), as `local_experts`; None without."""
    biases = experts.biases()
    return None if biases is None else tuple(_local(b, factor) for b in biases)


def _all_reduced(t: torch.Tensor, group) -> torch.Tensor:
    out = t.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) of partial outputs; the gradient of a replicated output goes to each part as it is."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumBackward(torch.autograd.Function):
    """Identity; the gradient (partial on each rank) is all-reduced (summed)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.group), None


def all_gather_rows(t: torch.Tensor, mesh) -> torch.Tensor:
    """Every rank's `t` of the group `mesh`, stacked along dim 0; waited for (the module docstring says why)."""
    return funcol.wait_tensor(funcol.all_gather_single(t.contiguous(), 0, mesh))


def sum_scatter_rows(t: torch.Tensor, mesh, by_all_to_all: bool) -> torch.Tensor:
    """The sum over the group `mesh` of every rank's `t` `[n * T, ...]`, this rank's `T` rows of it; waited
    for. `by_all_to_all` (gloo): an all-to-all of the same chunks, then the sum here (one run of ours
    segfaulted inside gloo's reduce-scatter, whose halving-doubling algorithm is reported to send from a
    buffer the other ranks write into: jax-ml/jax#40830)."""
    t = t.contiguous()
    if not by_all_to_all:
        return funcol.wait_tensor(funcol.reduce_scatter_single(t, "sum", 0, mesh))
    n = mesh.size()
    chunks = funcol.wait_tensor(funcol.all_to_all_single(t, None, None, mesh))  # chunk j: rank j's part of ours
    return chunks.view(n, t.shape[0] // n, *t.shape[1:]).sum(0)


class _GatherRows(torch.autograd.Function):
    """`all_gather_rows`; the gradient is `sum_scatter_rows` of the gathered gradient."""

    @staticmethod
    def forward(ctx, t, mesh, by_all_to_all: bool):
        ctx.mesh, ctx.by_all_to_all = mesh, by_all_to_all
        return all_gather_rows(t, mesh)

    @staticmethod
    def backward(ctx, grad):
        return sum_scatter_rows(grad, ctx.mesh, ctx.by_all_to_all), None, None


class _SumScatterRows(torch.autograd.Function):
    """`sum_scatter_rows`; the gradient is `all_gather_rows` of the rows' gradients."""

    @staticmethod
    def forward(ctx, t, mesh, by_all_to_all: bool):
        ctx.mesh = mesh
        return sum_scatter_rows(t, mesh, by_all_to_all)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_rows(grad, ctx.mesh), None, None


class GatherExchange:
    """`ep_implementation="auto"`: all-gather, local experts, reduce-scatter (see the module docstring)."""

    def __init__(self, dims: ParallelDims, num_experts: int):
        self.ep_mesh = dims.ep_mesh
        self.tp_mesh = dims.tp_mesh if dims.tp > 1 else None
        self.ep_rank = self.ep_mesh.get_local_rank()
        self.num_experts = num_experts
        self.grad_factor = expert_gradient_factor(dims)
        self.by_all_to_all = dist.get_backend(self.ep_mesh.get_group()) == "gloo"

    def _tp_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a batch its TP group shares (the backward all-gathers the rows' gradients)."""
        return (
            DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
            .redistribute(self.tp_mesh, [Shard(0)])
            .to_local()
        )

    def __call__(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, ops):
        gate_up, down = local_experts(experts, self.grad_factor)
        tokens = x.shape[0]
        tp = self.tp_mesh.size() if self.tp_mesh is not None else 1
        if tp > 1:
            pad = -tokens % tp
            if pad:
                x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
                weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
                idx = torch.cat([idx, idx.new_zeros(pad, idx.shape[1])])
            x, weights = self._tp_slice(x), self._tp_slice(weights)
            rows = x.shape[0]
            idx = idx[self.tp_mesh.get_local_rank() * rows : (self.tp_mesh.get_local_rank() + 1) * rows]
        xg, wg = (_GatherRows.apply(t, self.ep_mesh, self.by_all_to_all) for t in (x, weights))
        ig = all_gather_rows(idx, self.ep_mesh)
        local = gate_up.shape[0]
        partial = expert_mlp(
            xg,
            wg,
            ig,
            gate_up,
            down,
            ops,
            first=self.ep_rank * local,
            total=self.num_experts,
            biases=local_biases(experts, self.grad_factor),
            act=experts.act,
        )
        out = _SumScatterRows.apply(partial, self.ep_mesh, self.by_all_to_all)
        if tp > 1:
            hidden = out.shape[1]
            out = DTensor.from_local(
                out.contiguous(),
                self.tp_mesh,
                [Shard(0)],
                run_check=False,
                shape=(out.shape[0] * tp, hidden),
                stride=(hidden, 1),
            ).full_tensor()[:tokens]
        return out


class AllReduceExchange:
    """`ep_implementation="all_reduce"` (ep == tp): local experts on the shared batch, outputs summed
    (eager collectives: a TP group's blocks are never compiled for training, `training/partitioned.py`)."""

    def __init__(self, dims: ParallelDims, num_experts: int):
        self.group = dims.ep_mesh.get_group()
        self.ep_rank = dims.ep_mesh.get_local_rank()
        self.num_experts = num_experts
        self.grad_factor = expert_gradient_factor(dims)  # 1: ep == tp

    def __call__(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, ops):
        gate_up, down = local_experts(experts, self.grad_factor)
        x, weights = _SumBackward.apply(x, self.group), _SumBackward.apply(weights, self.group)
        partial = expert_mlp(
            x,
            weights,
            idx,
            gate_up,
            down,
            ops,
            first=self.ep_rank * gate_up.shape[0],
            total=self.num_experts,
            biases=local_biases(experts, self.grad_factor),
            act=experts.act,
        )
        return _SumForward.apply(partial, self.group)


EXCHANGES = {"auto": GatherExchange, "all_reduce": AllReduceExchange}


def sparse_layers(model: nn.Module) -> list:
    return [layer for layer in model.model.layers if getattr(layer, "sparse", False)]


def apply_ep(model: nn.Module, dims: ParallelDims) -> None:
    """Shard every sparse layer's experts over the EP mesh (`Shard(0)`) and install the token exchange."""
    exchange = EXCHANGES[dims.config.ep_implementation]
    for layer in sparse_layers(model):
        experts = layer.mlp.experts
        names = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if experts.biases() else ())
        for name in names:
            p = experts._parameters[name]
            experts._parameters[name] = nn.Parameter(
                distribute_tensor(p, dims.ep_mesh, [Shard(0)], src_data_rank=None), requires_grad=p.requires_grad
            )
        experts.exchange = exchange(dims, experts.num_experts)


def shard_experts(model: nn.Module, dims: ParallelDims, kwargs: dict, backend: str) -> None:
    """FSDP2 over the ranks that hold the same experts (`efsdp`, with `edp_replicate` under HSDP), each
    sparse layer's experts one unit. FSDP2 averages their gradients over those ranks; the exchange
    scales them first (`expert_gradient_factor`) so that the result is the average over every
    data-parallel rank, as for the other parameters. (Not `set_gradient_divide_factor`: with one rank
    holding each expert, this PyTorch divides by it twice.)"""
    from torch.distributed.fsdp import fully_shard

    for layer in sparse_layers(model):
        experts = layer.mlp.experts
        fully_shard(experts, **{**kwargs, "mesh": dims.expert_fsdp_mesh})
        if backend == "gloo":
            experts.set_force_sum_reduction_for_comms(True)


class DataParallelSum:
    """`CausalLM.data_parallel`: sums a tensor (router statistics, no gradient) over the data-parallel ranks."""

    def __init__(self, dims: ParallelDims):
        self.size = dims.dp
        self._group = dims.dp_group()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self._group)
        return out


__all__ = [
    "apply_ep",
    "shard_experts",
    "all_gather_rows",
    "sum_scatter_rows",
    "GatherExchange",
    "AllReduceExchange",
    "DataParallelSum",
    "sparse_layers",
    "expert_gradient_factor",
    "local_experts",
    "local_biases",
]
