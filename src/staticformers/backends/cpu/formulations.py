"""The CPU's formulations of the decoder's projections and attention, and which shape gets which.

Why this exists: on a CPU, under inductor, the same math runs much faster in some formulations than
through `F.linear` and SDPA (every figure is in BENCHMARKS.md):

- `project(..., "reduce")`: a linear as a float32 multiply-and-sum over the weight rows. With the
  weight's rows outermost, inductor generates one loop that reads each weight row once for all the
  tokens of a small decode batch: a batch-1 decode step streams its weights at close to the memory
  bandwidth, where a GEMV call per projection is overhead-bound.
- `project(..., "onednn")`: float32 GEMMs through oneDNN's kernel (`onednn.py`) instead of MKL's.
- `project(..., "packed")`: bfloat16 GEMMs through oneDNN over weights it packed once (`packed_linear.py`).
- `project(..., "widen")`: bfloat16 GEMMs as float32 products, both operands widened first and the result rounded
  once, on a CPU that has no bfloat16 products of its own (no AVX512_BF16, no AMX: `widens_bf16`), where a bf16
  GEMM is emulated and ran 4-7x slower than the widened one (BENCHMARKS.md, "bf16 GEMMs on a CPU without bf16").
- `project(..., "stream")`: the bfloat16 projections of a decode step's few rows through the streaming kernel of
  `gemv.py`, which reads each weight row once for all the rows (q, k and v, or gate and up, in one call); a
  projection it cannot take (float32, int8 or hooked layers, a gradient wanted) reduces as `"reduce"` does, and
  more rows than it takes (a prompt's scored head) run the GEMM (`gemm_kernel`).
- `mlp_block`: with `"stream"` linears, a decoder layer's MLP half (the attention's residual, the norm, gate and up,
  SiLU, down, the residual) as one call of `gemv.py`'s `bf16_mlp_block`, where the graph made five calls.
- `int8_linear`: a weight-only int8 projection (`models.quantization.QuantLinear`) of one row (batch-1
  decode) through the streaming kernel of `gemv.py`, of a few rows through ATen's int8 kernel (in
  bf16 for float32 activations); a prompt's through the widened weight's GEMM.
- `attend_decode`: one query per row as fused reductions over the cache (no matmul calls, no KV copy);
  `attend_grouped`: matmul + float32 softmax + matmul with the query heads grouped per KV head;
  `attend_blocks`: causal self-attention in query blocks of 128, skipping most of the masked triangle
  (bf16 training and long bf16 prompts).

`CPUOps` carries one choice of each (`ops.Ops` is the seam the model exposes); `decode_formulation`
and `prefill_formulation` say which shape gets which, as measured.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...adapters.lora import LoraLinear
from ...models.kept_positions import causal_rows
from ...models.hooks import hooked
from ...models.attention_sinks import softmax_with_sinks
from ...models.norm_variants import RMSNorm, softcap as cap_scores
from ...models.ops import Ops, capped_attention, expert_product, sdpa
from ...models.quantization import QuantLinear, widen
from .decode_attention import decode_attention, runs as runs_decode_attention
from .gemv import bf16_gemv, bf16_mlp_block, bf16_supports, int8_gemv, supports as int8_gemv_supports
from .int8_kernel import int8_linear_bf16
from .onednn import onednn_available, onednn_linear
from .packed_linear import packed_available, packed_linear
from .thresholds import threshold


def project(layer: nn.Linear, x: torch.Tensor, how: Optional[str] = None) -> torch.Tensor:
    """`layer(x)` (`how=None`), the same product through oneDNN's GEMM (`"onednn"`, inference only), through
    oneDNN over the weight it packed once (`"packed"`, bf16 inference), or as a float32 multiply-and-sum
    over the weight rows (`"reduce"`).

    An int8 layer (`QuantLinear`) at inference runs an int8 kernel (`int8_linear`: the streaming kernel for
    one row, ATen's up to `INT8_KERNEL_MAX_ROWS` rows) whatever `how` says; past them (a prompt), or with a
    gradient wanted, it reduces over its int8 values (`"reduce"`) or runs its generic form (the weight widened, then the GEMM:
    oneDNN's for `"onednn"`).

    The reduction puts the weight's rows outermost (`[out, tokens]`, then transposed back), so the
    loop inductor generates reads each weight row once for all the tokens of a small decode batch.
    A LoRA layer computes its base projection this way and adds its adapters itself."""
    quantized = isinstance(layer, QuantLinear)
    if quantized and int8_kernel(layer, x):
        return int8_linear(layer, x)
    if how == "stream" and not isinstance(layer, LoraLinear):  # a LoRA layer's base streams, below
        if bf16_streams((layer,), x):
            return bf16_linears((layer,), x)[0]
        # a decode row the kernel cannot take reduces; many rows (a prompt's scored head) take the GEMM
        how = "reduce" if x.numel() <= BF16_GEMV_MAX_ROWS * x.shape[-1] else gemm_kernel(x.dtype)
    if how is None:
        return widened_linear(layer, x) if quantized and not hooked(layer) else layer(x)
    if isinstance(layer, LoraLinear):
        return layer(x, base=lambda base, h: project(base, h, how))
    if how == "onednn":
        return widened_linear(layer, x) if quantized else onednn_linear(layer, x)
    if how == "packed":
        return widened_linear(layer, x) if quantized else packed_linear(layer, x)
    if how == "widen":
        return widened_linear(layer, x, torch.float32) if quantized else float32_products(layer, x)
    lead, k = x.shape[:-1], x.shape[-1]
    y = (widen(layer.weight, torch.float32).unsqueeze(1) * x.reshape(1, -1, k).float()).sum(-1)
    if quantized:  # the int8 rows streamed as they are, each row's sum times its scale
        y = y * layer.weight_scale.float()
    y = y.t()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.reshape(*lead, -1).to(x.dtype)


INT8_KERNEL_MAX_ROWS = threshold("int8_kernel_max_rows")  # thresholds.py
INT8_GEMV_MAX_ROWS = threshold("int8_gemv_max_rows")


def int8_kernel(layer: QuantLinear, x: torch.Tensor) -> bool:
    """Whether `int8_linear` computes `layer(x)`: int8 values, an activation dtype a kernel takes, at most
    `INT8_KERNEL_MAX_ROWS` rows (past them the widened weight's GEMM is faster), no gradient wanted (the
    kernels have no backward), and no forward hook on the layer (tensor parallel's hooks lay out its input
    and output around `layer(x)`, which a kernel would skip). ATen's kernel wants the scales in the
    activations' dtype; the streaming kernel (`int8_gemv`) takes bf16 or float32 scales with either."""
    if not kernel_may_run(layer, x):
        return False
    return streams(layer, x) or (
        x.dtype in (torch.bfloat16, torch.float32, torch.float16) and layer.weight_scale.dtype == x.dtype
    )


def kernel_may_run(layer: nn.Module, x: torch.Tensor) -> bool:
    """What every int8 kernel needs of the layer and the call (see `int8_kernel`), dtypes aside."""
    return (
        isinstance(layer, QuantLinear)
        and layer.kind == "int8"
        and not hooked(layer)
        and x.numel() <= INT8_KERNEL_MAX_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def streams(layer: QuantLinear, x: torch.Tensor) -> bool:
    """Whether `int8_linear` runs the streaming kernel (`gemv.py`): at most `INT8_GEMV_MAX_ROWS` rows
    (past them it widens the weight again for each row, and ATen's kernel is faster), on a CPU it is built
    for."""
    return x.numel() <= INT8_GEMV_MAX_ROWS * x.shape[-1] and int8_gemv_supports(x, layer.weight_scale)


def streamed_together(layers: tuple, x: torch.Tensor) -> bool:
    """Whether `int8_linears` computes these projections of `x` in one call of the streaming kernel: each
    one an int8 layer it would stream alone, their scales of one dtype."""
    return (
        x.numel() <= INT8_GEMV_MAX_ROWS * x.shape[-1]
        and all(kernel_may_run(layer, x) for layer in layers)
        and int8_gemv_supports(x, *(layer.weight_scale for layer in layers))
    )


def int8_linears(layers: tuple, x: torch.Tensor) -> tuple:
    """`tuple(int8_linear(layer, x) for layer in layers)` in one call of the streaming kernel (check
    `streamed_together` first): a decode step's q, k and v, or its gate and up, cost one call, not three."""
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
    # the scales as stored (`[out, 1]`): the kernel reads `out` values, and a view would cost a call per scale
    ys = int8_gemv(rows, [layer.weight for layer in layers], [layer.weight_scale for layer in layers])
    out = []
    for layer, y in zip(layers, ys):
        if layer.bias is not None:
            y = y + layer.bias.to(y.dtype)
        out.append(y.reshape(*lead, -1))
    return tuple(out)


BF16_GEMV_MAX_ROWS = threshold("bf16_gemv_max_rows")


def bf16_streams(layers: tuple, x: torch.Tensor) -> bool:
    """Whether `bf16_linears` computes these projections of `x` in one call of the streaming bf16 kernel: plain
    linears (a LoRA layer's base is one) with bfloat16 weights, no forward hook (tensor parallel's lay out the
    input and output around `layer(x)`), at most `BF16_GEMV_MAX_ROWS` rows, no gradient wanted, on a CPU the
    kernel is built for."""
    return (
        x.numel() <= BF16_GEMV_MAX_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and x.requires_grad)
        and all(
            type(layer) is nn.Linear and layer.weight.dtype == torch.bfloat16 and not hooked(layer) for layer in layers
        )
        and bf16_supports(x)
    )


def bf16_linears(layers: tuple, x: torch.Tensor) -> tuple:
    """`tuple(layer(x) for layer in layers)` in one call of the streaming bf16 kernel (check `bf16_streams`
    first), each bias added after."""
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
    ys = bf16_gemv(rows, [layer.weight for layer in layers])
    return tuple(
        (y if layer.bias is None else y + layer.bias.to(y.dtype)).reshape(*lead, -1) for layer, y in zip(layers, ys)
    )


def mlp_block_runs(norm: nn.Module, mlp: nn.Module, x: torch.Tensor, attn: torch.Tensor) -> bool:
    """Whether `bf16_mlp_block` computes this MLP half: `norm` a plain RMSNorm with a bfloat16 weight, `mlp` a
    gated SiLU (`models.decoder.MLP`) whose three projections `bf16_linears` streams, without biases, no hook on
    the norm or the MLP, `x` rows it streams, and no gradient wanted of anything it reads (the operator has no
    backward)."""
    linears = tuple(getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    if torch.is_grad_enabled() and (
        x.requires_grad or attn.requires_grad or any(p.requires_grad for p in (*norm.parameters(), *mlp.parameters()))
    ):
        return False
    return (
        plain_mlp_half(norm, mlp)
        and all(isinstance(layer, nn.Linear) and layer.bias is None for layer in linears)
        and bf16_streams(linears, x)
    )


def plain_mlp_half(norm: nn.Module, mlp: nn.Module) -> bool:
    """The MLP half the CPU's MLP blocks compute, their projections aside: `norm` a plain RMSNorm with a bfloat16
    weight, `mlp` a gated SiLU, no hook on either."""
    return (
        type(norm) is RMSNorm
        and norm.weight.dtype == torch.bfloat16
        and getattr(mlp, "tanh_gelu", True) is False
        and not hooked(norm)
        and not hooked(mlp)
    )


def int8_linear(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """An int8 projection of a few rows (`int8_kernel` says which) through one of two kernels:

    - one row (a batch-1 decode step): `int8_gemv`, which streams the int8 weight once at close to the
      memory's rate, in float32 for float32 activations and bf16 ones alike;
    - a few rows: ATen's `_weight_int8pack_mm` (int8 rows times the activations, each output column times
      its scale), which widens each weight value once for all the rows. Inductor's own reduction over int8
      loads half-width vectors and ran 3-4x slower than the bf16 reduction.

      float32 activations go through ATen's kernel in bfloat16 (cast in, the result cast back): this
      PyTorch's kernel has no fast float32 path, and ran 8-60x slower in float32 than in bfloat16 on the
      reference's projections (`bench/int8_kernels.py`; BENCHMARKS.md, weight-only int8). The cost is
      bf16's rounding of the activations, the scales and the result: each output within about 3 * 2**-9 of
      the sum of its terms' magnitudes, the size of the int8 rounding of the weights themselves."""
    if streams(layer, x):
        return int8_linears((layer,), x)[0]
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
    if x.dtype == torch.float32:  # one opaque operator: the casts and the kernel (`int8_kernel.py`)
        y = int8_linear_bf16(rows, layer.weight, layer.weight_scale.view(-1))
    else:
        y = torch._weight_int8pack_mm(rows, layer.weight, layer.weight_scale.view(-1))
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.reshape(*lead, -1)


WIDEN_ENV = "STATICFORMERS_WIDEN_BF16"  # "1": widen bf16 GEMMs on any CPU, "0": never; unset: where it has no bf16


def widens_bf16() -> bool:
    """Whether bf16 GEMMs run as float32 products here (`float32_products`): on a CPU without bfloat16 products of
    its own (AVX512_BF16 or AMX), unless `STATICFORMERS_WIDEN_BF16` says otherwise."""
    forced = os.environ.get(WIDEN_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def attends_widened(linears: Optional[str], q: torch.Tensor) -> bool:
    """Whether a formulation with these linears runs this attention on float32 operands: with `"widen"` linears
    (a CPU without bf16 products), over bf16 queries, several a row, and no gradient wanted. The CPU's bf16 batched
    matmuls there are emulated, and a 128-token prompt's took as long as all its layers' widened GEMMs together
    (BENCHMARKS.md, "bf16 GEMMs on a CPU without bf16 products"). One query a row (decode) keeps its own
    reductions, which widen as they read, or its kernel: widening a whole cache each step would triple its bytes."""
    return (
        linears == "widen"
        and q.dtype == torch.bfloat16
        and q.shape[2] > 1
        and not (torch.is_grad_enabled() and q.requires_grad)
    )


def float32_products(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` of a bf16 layer as a float32 GEMM: the input and weight widened (exactly), the products summed in
    float32 and rounded to the input's dtype once, as a native bf16 GEMM rounds its float32 sums. With a gradient
    wanted, the layer's own call."""
    if torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad):
        return layer(x)
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.weight.float(), bias).to(x.dtype)


def widened_linear(layer: QuantLinear, x: torch.Tensor, products: Optional[torch.dtype] = None) -> torch.Tensor:
    """An int8 layer's generic form for a prompt's rows: the int8 weight widened to the activations' dtype
    (or to `products`, float32 for `"widen"` on a CPU without bf16 products, the rows widened with it) in the
    graph, the GEMM (oneDNN's in float32), then the scale per output column, applied in float32.

    The float32 scales are what keeps this a GEMM: inductor rewrites a bf16 `F.linear(x, w.to(bf16)) *
    scales` with bf16 scales back into ATen's int8 kernel whatever the rows, and that kernel is 2.2x slower
    than the GEMM on a 128-row prompt (BENCHMARKS.md, weight-only int8). With a gradient wanted, the
    layer's own forward."""
    if torch.is_grad_enabled() and x.requires_grad:
        return layer(x)
    dtype = products or x.dtype
    w, h = widen(layer.weight, dtype), x.to(dtype)
    if dtype == torch.float32 and onednn_available():
        y = torch.ops.staticformers.onednn_linear(h, w, None)
    else:
        y = F.linear(h, w)
    y = (y.float() * layer.weight_scale.view(-1).float()).to(x.dtype)
    return y if layer.bias is None else y + layer.bias.to(y.dtype)


def attend_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One query per row: attention as multiply-and-sum reductions (float32) with the query heads
    grouped per KV head, which inductor fuses into loops reading each cached key and value once
    (no matmul calls, no KV copy). q `[b, h, 1, d]`, k/v `[b, kvh, L, d]`, mask `[b, 1, 1, L]`;
    `softcap`: `tanh(s / c) * c` on the scores (Gemma 2); `sinks` `[h]`: gpt-oss's sink logits
    (`models/attention_sinks.py`)."""
    b, h, s, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, 1, d).float()
    scores = cap_scores((qg * k.unsqueeze(2).float()).sum(-1) * scale, softcap)  # [b, kvh, g, L]
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, -1), float("-inf"))
    if sinks is not None:
        probs = softmax_with_sinks(scores, sinks.view(1, kvh, h // kvh, 1))
    else:
        probs = torch.softmax(scores, dim=-1)
    out = (probs.unsqueeze(-1) * v.unsqueeze(2).float()).sum(-2)  # [b, kvh, g, d]
    return out.reshape(b, h, s, v.shape[-1]).to(v.dtype)


def attend_grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention as matmul + softmax (float32) + matmul with the query heads grouped per KV head;
    `softcap`: `tanh(s / c) * c` on the scores (Gemma 2); `sinks` `[h]`: each head's sink logit joins its
    softmax (`models/attention_sinks.py`)."""
    b, h, s, d = q.shape
    kvh, kv_len = k.shape[1], k.shape[2]
    g = h // kvh
    qg = q.reshape(b, kvh, g * s, d)
    scores = cap_scores(torch.matmul(qg, k.transpose(-1, -2)).float() * scale, softcap)
    if mask is None:
        mask = causal_rows(s, kv_len, q.device)
    mask = mask.unsqueeze(2).expand(mask.shape[0], 1, g, s, kv_len).reshape(mask.shape[0], 1, g * s, kv_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # row (group r, query i) of KV head j is query head j * g + r
        probs = softmax_with_sinks(
            scores, sinks.view(1, kvh, g, 1, 1).expand(1, kvh, g, s, 1).reshape(1, kvh, g * s, 1)
        )
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v).reshape(b, h, s, v.shape[-1])


CPU_BLOCK = threshold("attention_query_block")  # query block of `attend_blocks`


def attend_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    block: int = CPU_BLOCK,
) -> torch.Tensor:
    """Causal self-attention (queries = keys) in query blocks: block i attends to the keys up to its
    end only, each as matmul + float32 softmax + matmul (KV heads repeated per query head). It skips
    most of the masked upper triangle, which the CPU SDPA kernel computes (BENCHMARKS.md). `mask` (packed documents, padding, windows)
    already contains causality; without one it is built from positions."""
    b, h, s, d = q.shape
    g = h // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    outs = []
    for start in range(0, s, block):
        end = min(start + block, s)
        scores = torch.matmul(q[:, :, start:end], k[:, :, :end].transpose(-1, -2)).float() * scale
        if mask is None:
            rows = torch.arange(start, end, device=q.device)[:, None]
            hidden = torch.arange(end, device=q.device)[None, :] > rows
        else:
            hidden = ~mask[:, :, start:end, :end]
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v[:, :, :end]))
    return torch.cat(outs, 2)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float, blocks: bool = True
) -> torch.Tensor:
    """SDPA, except causal self-attention of bf16/fp16 over at least two query blocks (`attend_blocks`)."""
    s = q.shape[2]
    if blocks and q.dtype in (torch.bfloat16, torch.float16) and s == k.shape[2] and s >= 2 * CPU_BLOCK:
        return attend_blocks(q, k, v, mask, scale)
    return sdpa(q, k, v, mask, scale)


class CPUOps(Ops):
    """One formulation: `attention` ("reduce": fused reductions for one query per row, grouped matmuls
    otherwise; "kernel": as "reduce", but one query per row over a static cache runs `decode_attention.py`'s
    kernel where it can; "matmul": grouped matmuls; None: SDPA or query blocks), `linears` and `head_linear`
    ("reduce", "onednn", "packed", "widen" or None: the module itself, so hooks and wrappers run)."""

    name = "cpu"

    def __init__(
        self,
        attention: Optional[str] = None,
        linears: Optional[str] = None,
        head_linear: Optional[str] = None,
        blocks: bool = True,
    ):
        self.attention_kind, self.linears, self.head_linear, self.blocks = attention, linears, head_linear, blocks

    @property
    def key(self) -> tuple:
        return ("CPUOps", self.attention_kind, self.linears, self.head_linear, self.blocks)

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return project(layer, x, self.linears)

    def head(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return project(layer, x, self.head_linear)

    def linear_group(self, layers: tuple, x: torch.Tensor) -> tuple:
        """Projections of one input: int8 ones that stream (one decode row), or bf16 ones with `"stream"`
        linears, in one kernel call."""
        if streamed_together(layers, x):
            return int8_linears(layers, x)
        if self.linears == "stream" and bf16_streams(layers, x):
            return bf16_linears(layers, x)
        return super().linear_group(layers, x)

    def mlp_block(self, norm, mlp, x, attn):
        """With `"stream"` linears, the MLP half of a layer whose norm is a plain RMSNorm and whose MLP is a gated
        SiLU of plain bias-free bfloat16 linears, over rows the streaming kernel takes: one `bf16_mlp_block` call
        (see `Ops.mlp_block`); None otherwise."""
        if not (self.linears == "stream" and attn.dtype == x.dtype and mlp_block_runs(norm, mlp, x, attn)):
            return None
        rows = x.reshape(-1, x.shape[-1])
        out = bf16_mlp_block(
            rows,
            attn.reshape(rows.shape),
            norm.weight,
            norm.eps,
            mlp.gate_proj.weight,
            mlp.up_proj.weight,
            mlp.down_proj.weight,
        )
        return out.view(x.shape)

    def expert_matmul(self, x, weight, scale=None, index=None):
        """Stacked experts' products (`ops.Ops.expert_matmul`); with reductions for the linears (batch-1
        decode), a float32 multiply-and-sum that reads each (gathered) weight row in place, as `project` does
        (a quantized stack's rows as stored, each sum times its row's scale)."""
        if self.linears not in ("reduce", "stream"):
            return expert_product(x, weight, scale, index)
        w = weight if index is None else weight[index]
        y = (x.unsqueeze(-2).float() * widen(w, torch.float32).unsqueeze(-3)).sum(-1)
        if scale is not None:
            s = scale if index is None else scale[index]
            y = y * s.transpose(-1, -2).float()
        return y.to(x.dtype)

    def attention(self, q, k, v, mask, scale, softcap=None, sinks=None):
        """The formulation's attention. With `softcap` (Gemma 2), the formulations that compute their scores
        themselves: fused reductions for one query per row, grouped matmuls, or (None) the plain path's
        `capped_attention`; with `sinks` (gpt-oss) SDPA and the query blocks give way to grouped matmuls,
        which take the sink column. With `"widen"` linears, attention over several queries a row (a prompt, a chunk,
        a verification) runs on widened float32 operands (`attends_widened`), as the GEMMs do."""
        if attends_widened(self.linears, q):
            out = self.attention(q.float(), k.float(), v.float(), mask, scale, softcap, sinks)
            return out.to(q.dtype)
        if (
            self.attention_kind == "kernel"
            and softcap is None
            and sinks is None
            and runs_decode_attention(q, k, v, mask)
        ):
            return decode_attention(q, k, v, mask, scale)
        if self.attention_kind in ("reduce", "kernel") and q.shape[2] == 1:
            return attend_decode(q, k, v, mask, scale, softcap, sinks)
        if self.attention_kind is not None or sinks is not None:
            return attend_grouped(q, k, v, mask, scale, softcap, sinks)
        if softcap is not None:
            return capped_attention(q, k, v, mask, scale, softcap)
        return attend(q, k, v, mask, scale, self.blocks)


PLAIN_CPU = CPUOps()
FAST_DECODE_MAX_BATCH = threshold("fast_decode_max_batch")  # thresholds.py
BF16_HEAD_REDUCTION_MAX_BATCH = threshold("bf16_head_reduction_max_batch")


def gemm_kernel(dtype: torch.dtype) -> Optional[str]:
    """The GEMM behind a formulation's linears that are not reductions: oneDNN's for float32 (this
    PyTorch's MKL sgemm measured slower for prompts, BENCHMARKS.md; a decode step of 2-8 rows keeps
    MKL's, `decode_formulation`); oneDNN's over weights
    it packed once for bfloat16 (`packed_linear.py`), where the module's own call would repack the weight
    each time, or float32 products on a CPU without bf16 ones (`"widen"`); the module's own otherwise."""
    if dtype == torch.float32 and onednn_available() and torch.backends.mkldnn.enabled:
        return "onednn"
    if dtype == torch.bfloat16 and widens_bf16():  # no bf16 products of the CPU's own: float32 ones
        return "widen"
    if packed_available(dtype):
        return "packed"
    return None


def decode_formulation(batch: int, dtype: torch.dtype, gemm: Optional[str] = None, blocks: bool = False) -> CPUOps:
    """The formulation of an inductor decode step at this batch (`gemm` is `gemm_kernel(...)`).

    As measured on the 41.6M reference model (BENCHMARKS.md): at batch 1 every linear is a weight-
    streaming reduction and attention fused reductions. At batch 2-8 the linears stay GEMMs: inductor
    fuses the producing norm or activation into a reduction and recomputes it for each weight row, and
    the BLAS's GEMMs beat our reductions: in float32 MKL's sgemm (the module's own call), which read
    2-8 rows 7-21% faster than oneDNN's on both the reference and a real model (BENCHMARKS.md, "float32
    GEMMs at 2-8 rows"); in bf16 `gemm` (oneDNN over packed weights). Attention there is fused reductions in bf16 (the CPU's
    SDPA kernel is slow at small batches in bf16); float32 keeps SDPA. The `lm_head` is a reduction in
    float32 at every batch up to 8 and in bf16 up to batch 2, where this PyTorch's GEMM reads that
    weight slowly; the regional head stores the normalised input once (`compilation.regions.head_region`), so
    nothing is recomputed per weight row. In bf16, up to `BF16_GEMV_MAX_ROWS` rows, every projection and the head
    run the streaming kernel instead (`gemv.py`: each weight row read once for all the rows, BENCHMARKS.md, "A
    streaming bf16 kernel"). Past batch 8 everything is a GEMM, and attention is SDPA over a static cache; over a
    block cache (`blocks`) it stays fused reductions, which read each row's blocks through the table in place,
    where SDPA would take a gathered copy of every row's context (BENCHMARKS.md, "Prefix caching by shared
    blocks"). At float32 2-8 rows the two measured alike on block caches, and SDPA stays."""
    if batch > FAST_DECODE_MAX_BATCH:
        return CPUOps("reduce" if blocks else None, gemm, gemm)
    fused = "reduce" if blocks else "kernel"
    if dtype == torch.bfloat16 and batch <= BF16_GEMV_MAX_ROWS:  # the streaming kernel, head included
        return CPUOps(fused, "stream", "stream")
    head = "reduce" if dtype == torch.float32 or batch <= BF16_HEAD_REDUCTION_MAX_BATCH else gemm
    if batch == 1:
        return CPUOps(fused, "reduce", head)
    if dtype == torch.float32:  # MKL's sgemm (the module's own call) beat oneDNN's at 2-8 rows
        return CPUOps(None, None, head)
    return CPUOps(fused, gemm, head)


def prefill_formulation(batch: int, dtype: torch.dtype, gemm: Optional[str] = None) -> CPUOps:
    """The formulation of an inductor prefill step: GEMMs through `gemm`; grouped matmuls for one bf16
    prompt's attention (the CPU SDPA kernel with a mask is slower there), SDPA (or query blocks)
    otherwise; the head (one position per row) as decode's at this batch, since the two share it."""
    attention = "matmul" if batch == 1 and dtype != torch.float32 else None
    return CPUOps(attention, gemm, decode_formulation(batch, dtype, gemm).head_linear)
