"""A warm bf16 decode step's decoder layers as one operator call, where every layer is the plain pre-norm kind.

Why this exists: a compiled decode step runs each layer as a region whose graph makes six calls (two of inductor's
small kernels, the q/k/v projections, the attention, o_proj and the MLP block), each behind Python and a dispatch,
and on a deep, narrow model (SmolLM2-135M: 30 layers of width 576) those calls and the gaps between them, in which
the OpenMP worker waits, are a measurable share of a batch-1 step. `decode_layers.cpp` calls the same operators
(`gemv.py`'s `bf16_gemv` and `bf16_mlp_block`, `decode_attention.py`'s kernel) from C++ for every layer in turn,
with the RMSNorm, RoPE and cache write that inductor's kernels did, so a warm step is `prepare`, one call, the head.

`layers_stack(model, cache, ops, x)` says whether a step may take it, and builds the call: the model's layers are
all the plain kind (a pre-norm attention layer with full RoPE, q/k/v biases or none (Qwen2) and q/k RMSNorms per
head or none (Qwen3), alike in every layer, no sinks, soft cap or output gate, a gated SiLU MLP, its projections
bfloat16 `nn.Linear`s, or weight-only int8 ones (`QuantLinear`) in every layer for one row, which the streaming
int8 kernel takes: an int8 model's batch-1 step had the same six calls a layer around half the bytes, so the calls
were a larger share of it; no hooks, no LoRA, no gradient), the formulation streams
its linears (`"stream"`) and runs the decode attention kernel (`"kernel"`), and the cache is a static bfloat16
one whose layers' keys and values are contiguous, or a block cache's bfloat16 pool (`models/block_kv_cache.py`; its
regions attend by fused reductions, `"reduce"`), which the operator writes and reads through the step's block table
in place, where the regions gather every row's blocks. Such a step (`regions.py`) runs it in every call, the
first (guarded) one and a prefill's last row (the last layer alone, `start`) too, so its layer regions are never
compiled; where it declines, the regions run, compiled on first use.

How it is built: `staticformers::bf16_decode_layers` (its schema, which names the caches it writes, and its shape
function) is defined here at import; its CPU kernel is `decode_layers.cpp`, part of the backend's one library
(`kernel_library.py`) with the kernels it calls, loaded the first time a step asks whether it can run (`loaded`).
Where any of them cannot be built, the step runs the regions. `STATICFORMERS_DECODE_LAYERS=0` turns it off.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch import nn

from ...models.hooks import global_hooks, hooked
from ...models.block_kv_cache import BlockKVCache
from ...models.kv_cache import KVCache
from ...models.norm_variants import RMSNorm
from . import decode_attention, gemv
from ...models.quantization import QuantLinear
from .formulations import bf16_streams, mlp_block_runs, plain_mlp_half, streamed_together
from .kernel_library import DECODE_LAYERS, LIBRARY
from .operators import NativeKernels, define


_KERNELS = NativeKernels(
    DECODE_LAYERS,
    LIBRARY,
    ready=lambda: gemv.loaded() and decode_attention.loaded(),
    works=lambda: True,
    fallback="a bf16 decode step runs its layers' compiled regions instead.",
)


def loaded() -> bool:
    """Whether the operator runs in this process: built (once per machine and torch, then from inductor's disk
    cache) and loaded, after the kernels it calls."""
    return _KERNELS.loaded()


def _first_call(*args):
    return _KERNELS.first_call("bf16_decode_layers", "decode steps", *args)


define(
    "bf16_decode_layers",
    "(Tensor x, Tensor cos, Tensor sin, Tensor positions, Tensor[] masks, Tensor[] input_norms, Tensor[] q, "
    "Tensor[] k, Tensor[] v, Tensor[] o, Tensor[] post_norms, Tensor[] gate, Tensor[] up, Tensor[] down, "
    "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor[] q_norms, Tensor[] k_norms, Tensor[] q_biases, "
    "Tensor[] k_biases, Tensor[] v_biases, Tensor[] scales, Tensor? table, float eps, float scale) -> Tensor",
    _first_call,
    "CompositeExplicitAutograd",
    lambda x, *args: x.new_empty(x.shape),
)


def _plain_linear(layer: nn.Module, bias: bool = False) -> bool:
    """A bfloat16 `nn.Linear` with a bias (`bias`) or without."""
    return (
        type(layer) is nn.Linear
        and layer.weight.dtype == torch.bfloat16
        and (layer.bias is not None and layer.bias.dtype == torch.bfloat16 if bias else layer.bias is None)
    )


def _head_norm(norm: Optional[nn.Module]) -> bool:
    """A q or k norm the operator computes: none, or a plain RMSNorm over each head, bfloat16, without hooks."""
    return norm is None or (type(norm) is RMSNorm and norm.weight.dtype == torch.bfloat16 and not hooked(norm))


def _int8_linear(layer: nn.Module, bias: bool = False) -> bool:
    """A weight-only int8 `QuantLinear` with a bfloat16 bias (`bias`) or without."""
    return (
        type(layer) is QuantLinear
        and layer.kind == "int8"
        and (layer.bias is not None and layer.bias.dtype == torch.bfloat16 if bias else layer.bias is None)
    )


def _int8_mlp_runs(norm: nn.Module, mlp: nn.Module, x: torch.Tensor) -> bool:
    """`formulations.mlp_block_runs` for int8 gate, up and down projections, which the streaming int8 kernel takes
    for rows `x` (the operator's int8 MLP half; the regions have none)."""
    linears = tuple(getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    return (
        plain_mlp_half(norm, mlp)
        and all(_int8_linear(layer) for layer in linears)
        and streamed_together(linears[:2], x)
        and streamed_together(linears[2:], x.new_empty(x.shape[0], linears[2].in_features))
    )


def _linears(layer: nn.Module) -> tuple:
    """A layer's seven projections in the operator's order: q, k, v, o, gate, up, down (its scales' order)."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _linears_run(layer: nn.Module, x: torch.Tensor, biased: bool) -> bool:
    """Whether the operator computes the layer's projections and its MLP half for rows `x`: bfloat16 linears the
    streaming bf16 kernel takes with `bf16_mlp_block`'s MLP, or weight-only int8 ones the streaming int8 kernel
    takes (one row), their scales of one dtype."""
    attn, linears = layer.self_attn, _linears(layer)
    projections = linears[:4]
    if isinstance(attn.q_proj, QuantLinear):
        return (
            all(_int8_linear(p, biased) for p in projections[:3])
            and _int8_linear(attn.o_proj)
            and streamed_together(projections[:3], x)
            and streamed_together(projections[3:], x.new_empty(x.shape[0], attn.o_proj.in_features))
            and _int8_mlp_runs(layer.post_attention_layernorm, layer.mlp, x)
            and len({p.weight_scale.dtype for p in linears}) == 1  # every one int8 (a QuantLinear) by now
        )
    return (
        all(_plain_linear(p, biased) for p in projections[:3])
        and _plain_linear(attn.o_proj)
        and bf16_streams(projections, x)
        and mlp_block_runs(layer.post_attention_layernorm, layer.mlp, x, x)
    )


def layer_runs(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether one decoder layer is the kind the operator computes (see the module docstring), for rows `x`."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or type(attn).__name__ != "Attention" or getattr(layer, "linear", True) or layer.sparse:
        return False
    norm = layer.input_layernorm
    biased = attn.q_proj.bias is not None
    return (
        layer.plain_mlp_half
        and layer.rope is None
        and attn.rope
        and not attn.interleaved
        and _head_norm(attn.q_norm)
        and _head_norm(attn.k_norm)
        and (attn.q_norm is None or not attn.qk_norm_whole)
        and attn.sinks is None
        and not attn.gated
        and attn.softcap is None
        and type(norm) is RMSNorm
        and norm.weight.dtype == torch.bfloat16
        and not hooked(layer)
        and not hooked(attn)
        and not hooked(norm)
        and _linears_run(layer, x, biased)
    )


def allowed() -> bool:
    """What may change between two calls of one step: the switch (`STATICFORMERS_DECODE_LAYERS`), global module
    hooks, a gradient wanted. `layers_stack` asks it; a caller that keeps a stack asks it before each use."""
    return os.environ.get("STATICFORMERS_DECODE_LAYERS") != "0" and not global_hooks() and not torch.is_grad_enabled()


def layers_stack(model: nn.Module, cache, ops, x: torch.Tensor, start: int = 0) -> Optional[Callable]:
    """The step's layers from `start` on as one `bf16_decode_layers` call, `stack(x, cos, sin, masks,
    position_ids) -> x`, for a decode step's rows `x` (`[B, 1, hidden]`, the input of layer `start`) over `cache`;
    None where the step must run its regions."""
    if not allowed():
        return None
    blocks = type(cache) is BlockKVCache  # the operator reads and writes its pool through the table
    # the formulation the regions would run: on a block cache they attend by fused reductions, which read the pool in
    # place (the operator's attention reads it through the table too)
    if getattr(ops, "linears", None) != "stream" or getattr(ops, "attention_kind", None) != (
        "reduce" if blocks else "kernel"
    ):
        return None
    if not blocks and (type(cache) is not KVCache or cache.linear):
        return None
    if blocks and cache.window_table is not None:  # window layers through a table of their own: the regions
        return None
    held = cache.pool if blocks else cache  # the layers' keys and values
    if cache.latent or held.keys[0].dtype != torch.bfloat16:
        return None
    if getattr(model.config, "partial_rotary_factor", 1.0) != 1.0:  # a part of each head rotates
        return None
    layers = list(model.model.layers)[start:]
    rows = x.reshape(-1, x.shape[-1])
    if not layers or not all(layer_runs(layer, rows) for layer in layers):
        return None
    keys, values = list(held.keys)[start:], list(held.values)[start:]
    table = cache.table if blocks else None
    if not all(k.is_contiguous() and v.is_contiguous() for k, v in zip(keys, values)):
        return None
    if not loaded():
        return None
    attns = [layer.self_attn for layer in layers]
    scales = {a.scale for a in attns}
    norms = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    normed = attns[0].q_norm is not None
    if normed:
        norms += [m for a in attns for m in (a.q_norm, a.k_norm)]
    eps = {m.eps for m in norms}
    biased = attns[0].q_proj.bias is not None
    quantized = isinstance(attns[0].q_proj, QuantLinear)
    if any(
        (a.q_norm is not None) != normed
        or (a.q_proj.bias is not None) != biased
        or isinstance(a.q_proj, QuantLinear) != quantized
        for a in attns
    ):
        return None  # one operator call takes norms, biases and int8 weights in every layer or in none
    if len(scales) != 1 or len(eps) != 1 or keys[0].shape[-1] != attns[0].head_dim:
        return None
    weights = (
        [layer.input_layernorm.weight for layer in layers],
        [a.q_proj.weight for a in attns],
        [a.k_proj.weight for a in attns],
        [a.v_proj.weight for a in attns],
        [a.o_proj.weight for a in attns],
        [layer.post_attention_layernorm.weight for layer in layers],
        [layer.mlp.gate_proj.weight for layer in layers],
        [layer.mlp.up_proj.weight for layer in layers],
        [layer.mlp.down_proj.weight for layer in layers],
    )
    extra = (
        [a.q_norm.weight for a in attns] if normed else [],
        [a.k_norm.weight for a in attns] if normed else [],
        [a.q_proj.bias for a in attns] if biased else [],
        [a.k_proj.bias for a in attns] if biased else [],
        [a.v_proj.bias for a in attns] if biased else [],
        [linear.weight_scale for layer in layers for linear in _linears(layer)] if quantized else [],
    )
    windows = [a.window for a in attns]
    distinct = set(windows)
    scale, epsilon = float(scales.pop()), float(eps.pop())
    op = torch.ops.staticformers.bf16_decode_layers.default

    def stack(x: torch.Tensor, cos, sin, masks: dict, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """The layers' output, or None where this step's tables or masks are not the operator's (the caller runs
        the regions)."""
        if x.dtype != torch.bfloat16 or x.shape[-1] != weights[1][0].shape[-1]:
            return None
        if not isinstance(cos, torch.Tensor) or cos.shape[-1] != keys[0].shape[-1] or cos.dtype != torch.bfloat16:
            return None
        if any(not isinstance(masks.get(w), torch.Tensor) or masks[w].dtype != torch.bool for w in distinct):
            return None
        b = x.shape[0]
        if table is not None and table.shape[0] != b:  # a block table of other rows than the step's
            return None
        out = op(
            x.reshape(b, -1),
            cos.reshape(b, -1),
            sin.reshape(b, -1),
            position_ids.reshape(-1),
            [masks[w] for w in windows],
            *weights,
            keys,
            values,
            *extra,
            table,
            epsilon,
            scale,
        )
        return out.view(x.shape)

    return stack


__all__ = ["allowed", "layer_runs", "layers_stack", "loaded"]
