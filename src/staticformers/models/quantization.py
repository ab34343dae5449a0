"""Weight-only int8 (and fp8 e4m3): the config users pass, the quantized linear, quantising a built model.

Why this exists: a decode step is bound by the bytes of the weights it reads, and int8 weights are half of
bf16's. Each projection's weight is stored as int8 (or float8_e4m3fn) with one scale per output channel,
symmetric (`w ~ q * scale`, `scale = max|row| / 127`, or `/ 448` for e4m3), the scale in the model's
dtype. What stays exact: the embedding, the norms, the router of a mixture, and the `lm_head` unless the
config asks for it (`modules_to_not_convert` default; BENCHMARKS.md measures what the head costs and saves).

How one computes: `QuantLinear.forward` is the generic form (the int8 weight widened in the graph, the
product, then the scale per output column), what `Ops.linear` runs; a backend may compute it its own way
through the ops seam (the CPU: ATen's weight-only int8 kernel at inference, `backends/cpu/formulations.py`). A mixture's stacked experts hold `gate_up_proj` / `down_proj` quantized
with `*_scale` `[E, out, 1]` beside them (`moe.Experts`). Shapes do not change, so no new graph is compiled.

Names users know: transformers' `TorchAoConfig("int8_weight_only")` (its 4.x spelling; a torchao
`Int8WeightOnlyConfig` object, or a transformers `TorchAoConfig` holding one, is read the same way) and our
`QuantizationConfig` with the same fields. Parameter names are compressed-tensors' (`weight`,
`weight_scale`), so a saved model is an `int-quantized` compressed-tensors checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .moe import Experts
from .quantized_values import FP8, dequantize, quantize_rows, widen

KINDS = {"int8_weight_only": "int8", "float8_weight_only": "fp8"}
# torchao's config classes that mean the same thing as a quant_type string (per-channel: group_size None)
_TORCHAO_CLASSES = {"Int8WeightOnlyConfig": "int8_weight_only", "Float8WeightOnlyConfig": "float8_weight_only"}


@dataclass
class QuantizationConfig:
    """Weight-only quantization: `quant_type` "int8_weight_only" or "float8_weight_only" (e4m3; only where
    the device has fp8 arithmetic), `modules_to_not_convert`: module names (or suffixes such as "lm_head")
    kept in full precision (default `["lm_head"]`), `include_input_output_embeddings`: quantize the head too
    (transformers' TorchAoConfig field; the embedding itself always stays exact)."""

    quant_type: str = "int8_weight_only"
    modules_to_not_convert: Optional[list] = None
    include_input_output_embeddings: bool = False

    def __post_init__(self):
        if self.quant_type not in KINDS:
            raise ValueError(
                f"quant_type={self.quant_type!r} is not a weight-only type staticformers runs: use "
                f"{' or '.join(map(repr, KINDS))}."
            )
        if self.modules_to_not_convert is not None and (
            isinstance(self.modules_to_not_convert, str)
            or not all(isinstance(m, str) for m in self.modules_to_not_convert)
        ):
            raise ValueError('modules_to_not_convert must be a list of module names, e.g. ["lm_head"].')

    @property
    def kind(self) -> str:
        return KINDS[self.quant_type]

    def skipped(self) -> list[str]:
        """The module names (or suffixes) left in full precision."""
        if self.modules_to_not_convert is not None:
            return list(self.modules_to_not_convert)
        return [] if self.include_input_output_embeddings else ["lm_head"]

    def skips(self, name: str) -> bool:
        return any(name == s or name.endswith("." + s) for s in self.skipped())


class TorchAoConfig(QuantizationConfig):
    """transformers' name: `TorchAoConfig("int8_weight_only")`, `TorchAoConfig(Int8WeightOnlyConfig())`."""

    def __init__(
        self,
        quant_type="int8_weight_only",
        modules_to_not_convert=None,
        include_input_output_embeddings: bool = False,
        **kwargs,
    ):
        super().__init__(_quant_type_name(quant_type), modules_to_not_convert, include_input_output_embeddings)


def _quant_type_name(quant_type) -> str:
    """A quant_type string, or a torchao config object read by its class name (per channel only)."""
    if isinstance(quant_type, str):
        return quant_type
    name = type(quant_type).__name__
    if name in _TORCHAO_CLASSES:
        if getattr(quant_type, "group_size", None) not in (None, 0):
            raise ValueError(
                f"{name}(group_size={quant_type.group_size}) asks for group scales; staticformers "
                f"quantizes per output channel: leave group_size unset."
            )
        return _TORCHAO_CLASSES[name]
    raise ValueError(
        f'quant_type {name} is not a weight-only type staticformers runs: use "int8_weight_only" '
        f"(or torchao's Int8WeightOnlyConfig())."
    )


def as_quantization_config(value) -> QuantizationConfig:
    """Ours as it is; a transformers `TorchAoConfig` (or anything with `quant_type`), or a dict of the same
    fields, read into ours; anything else refused in one sentence."""
    if isinstance(value, QuantizationConfig):
        return value
    if isinstance(value, dict):
        fields = {
            k: value[k]
            for k in ("quant_type", "modules_to_not_convert", "include_input_output_embeddings")
            if k in value
        }
        if "quant_type" not in fields:
            raise ValueError('A quantization_config dict needs "quant_type" ("int8_weight_only").')
        return TorchAoConfig(**fields)
    if hasattr(value, "quant_type"):
        return TorchAoConfig(
            value.quant_type,
            getattr(value, "modules_to_not_convert", None),
            bool(getattr(value, "include_input_output_embeddings", False)),
        )
    raise ValueError(
        f"quantization_config={value!r} is not a quantization config: pass "
        f'QuantizationConfig("int8_weight_only") or TorchAoConfig("int8_weight_only").'
    )


class QuantLinear(nn.Linear):
    """A linear with quantized weights: `weight` int8 (or float8_e4m3fn) `[out, in]`, `weight_scale` `[out,
    1]` in the model's dtype, `bias` as it was. Neither trains (a LoRA over it does). It is an `nn.Linear`
    so that LoRA and tensor-parallel plans take it; its forward is the generic dequantised product."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kind: str, dtype: torch.dtype, device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        qdtype = torch.int8 if kind == "int8" else FP8
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=qdtype, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> "QuantLinear":
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, kind, w.dtype, w.device)
        q, scale = quantize_rows(w, kind, w.dtype)
        out.weight.data, out.weight_scale.data = q, scale
        if linear.bias is not None:
            out.bias.data = linear.bias.detach().clone()
        return out

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.weight_scale.dtype

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, widen(self.weight, x.dtype)) * self.weight_scale.view(-1).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, bias={self.bias is not None}"


def compute_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear computes in: its weight's, or its scale's when the weight is quantized."""
    return layer.compute_dtype if isinstance(layer, QuantLinear) else layer.weight.dtype


# ---------------------------------------------------------------------------------------------
# a model
# ---------------------------------------------------------------------------------------------
def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's plain linears: every projection, the router and the head (not a LoRA's own)."""
    return {
        n: m for n, m in model.named_modules() if type(m) is nn.Linear and ".lora_" not in n and not n.endswith(".gate")
    }


def quantize_model(model: nn.Module, config: QuantizationConfig) -> list[str]:
    """Quantize a built model in place (`config`: what and how); returns the quantized modules' names. The
    config.json of the model gets compressed-tensors' `quantization_config`, so that it saves as one.
    A tied head that is quantized is untied: the embedding stays exact and the head reads its own copy."""
    from ..checkpoints.compressed_tensors import write_config

    if getattr(model, "parallel_dims", None) is not None:
        raise ValueError(
            "This model is partitioned already: quantize it as it loads, from_pretrained(..., "
            "quantization_config=..., distributed_config=DistributedConfig(tp_size=N))."
        )
    if any(".lora_" in n for n, _ in model.named_modules()):
        raise ValueError("This model has LoRA adapters: quantize the base first, then add or load the adapters.")
    if is_quantized(model):
        raise ValueError("This model is quantized already.")
    kind = config.kind
    done = []
    with torch.no_grad():
        for name, linear in _linears(model).items():
            if config.skips(name):
                continue
            if name == "lm_head" and model.config.tie_word_embeddings:
                model.config.tie_word_embeddings = False
                linear = nn.Linear(
                    linear.in_features,
                    linear.out_features,
                    bias=False,
                    device=linear.weight.device,
                    dtype=linear.weight.dtype,
                )
                linear.weight.data = model.model.embed_tokens.weight.detach()
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, QuantLinear.from_linear(linear, kind))
            done.append(name)
        for name, experts in _experts(model).items():
            if config.skips(name):
                continue
            experts.quantize(kind)
            done.append(name)
    ignore = sorted({n for n in _linears(model)} | {n for n, _ in model.named_modules() if n.endswith(".gate")})
    model.config.extra["quantization_config"] = write_config(kind, ignore)
    return done


def _experts(model: nn.Module) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, Experts)}


def prepare_for_checkpoint(model: nn.Module, scheme) -> None:
    """Give a model built on the meta device the quantized modules a compressed-tensors checkpoint holds
    (`scheme`: `checkpoints.compressed_tensors.Scheme`): every Linear but those `ignore`d, experts included."""
    dtype = model.model.embed_tokens.weight.dtype
    for name, linear in _linears(model).items():
        if scheme.skips(name) or name.endswith(".gate"):
            continue
        if name == "lm_head" and model.config.tie_word_embeddings:
            model.config.tie_word_embeddings = False
        parent, _, leaf = name.rpartition(".")
        setattr(
            model.get_submodule(parent) if parent else model,
            leaf,
            QuantLinear(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                scheme.kind,
                dtype,
                linear.weight.device,
            ),
        )
    for name, experts in _experts(model).items():
        if not scheme.skips(name):
            experts.quantize(scheme.kind, empty=True)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) or getattr(m, "quantized", None) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """The bytes of every distinct parameter and persistent buffer (int8 weights count one byte each)."""
    seen = {}
    for p in list(model.parameters()) + list(model.buffers()):
        seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


__all__ = [
    "QuantizationConfig",
    "TorchAoConfig",
    "as_quantization_config",
    "quantize_rows",
    "dequantize",
    "widen",
    "QuantLinear",
    "compute_dtype",
    "quantize_model",
    "prepare_for_checkpoint",
    "is_quantized",
    "weight_bytes",
    "KINDS",
    "FP8",
]
