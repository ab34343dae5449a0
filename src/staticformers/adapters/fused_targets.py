"""LoRA on projections a family's checkpoints store fused (Phi-3's `qkv_proj` and `gate_up_proj`, GLM-4's
`gate_up_proj`, Qwen3.5's Gated DeltaNet `in_proj_qkv`), while the model holds them split (`checkpoints/names.py`).

PEFT adapts the fused module: `qkv(x) + B(A(x)) * s`, one A `[r, H]` and one B `[q + 2 kv, r]`. Split, that
is the same as each part `p` adapted with the *same* A and its rows of B: `p(x) + B_p(A(x)) * s`. So a target
named as PEFT names it (`qkv_proj`) wraps each part in its own LoRA layer, the parts sharing one `lora_A`
module (one parameter, trained once) and each holding its rows of B; PEFT's files hold A once and B whole,
and are split on reading and concatenated on saving here. Tensor parallel then shards each part's B with
the part's own heads. (With `lora_dropout` > 0 each part draws its own dropout mask where PEFT draws one.)

Targets are matched against PEFT's module names (`candidates`): on Phi-3 those are `qkv_proj`,
`gate_up_proj`, `o_proj` and `down_proj`, and `q_proj` names nothing, as in PEFT; on Qwen3.5 `in_proj_qkv` covers
`in_proj_qkv.q`, `.k` and `.v`. (A fused group whose parts are not projections, the DeltaNet's `conv1d`, is no
target.)
"""

from __future__ import annotations

import re
import torch
from torch import nn

_LAYER_MODULE = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<module>.+)$")


def groups(model: nn.Module, names) -> dict[str, tuple[str, ...]]:
    """PEFT's name of each fused projection -> the model's parts (full names, in row order), for the parts
    among `names` (the model's projection names); empty for a family without fused projections."""
    fused = getattr(getattr(getattr(model, "config", None), "family", None), "fused_names", None)
    if fused is None:
        return {}
    names = set(names)
    out: dict[str, tuple[str, ...]] = {}
    for name in sorted(names):
        m = _LAYER_MODULE.match(name)
        found = fused.part_of(m["module"]) if m else None
        if found is not None:
            parts = tuple(f"{m['layer']}.{p}" for p in found[1])
            if all(p in names for p in parts):
                out[f"{m['layer']}.{found[0]}"] = parts
    return out


def candidates(projections: dict[str, nn.Module], model: nn.Module) -> dict[str, tuple[int, int]]:
    """PEFT's module names of the model's projections (`projections`: the model's names -> modules), in the
    model's order, each with its (in_features, out_features): a fused projection's parts as one."""
    grouped = groups(model, projections)
    part_of = {p: fused for fused, parts in grouped.items() for p in parts}
    out: dict[str, tuple[int, int]] = {}
    for name, module in projections.items():
        fused = part_of.get(name)
        if fused is None:
            out[name] = (module.in_features, module.out_features)
        elif fused not in out:
            parts = grouped[fused]
            out[fused] = (module.in_features, sum(projections[p].out_features for p in parts))
    return out


def expand(model: nn.Module, names, projections: dict[str, nn.Module]) -> dict[str, tuple[str, ...]]:
    """Each PEFT module name of `names` -> the model's modules it covers (itself, or a fused one's parts)."""
    grouped = groups(model, projections)
    return {n: grouped.get(n, (n,)) for n in names}


def peft_name(model: nn.Module, module: str, projections: dict[str, nn.Module]) -> str:
    """PEFT's name of the model's projection `module` (a part's fused module, else itself): what a
    LoraConfig's `rank_pattern` / `alpha_pattern` are matched against."""
    for fused, parts in groups(model, projections).items():
        if module in parts:
            return fused
    return module


def split(model: nn.Module, weights: dict, projections: dict[str, nn.Module]) -> dict:
    """PEFT's weights (module -> {"A", "B"}) per model module: a fused module's A for each part, B by rows."""
    grouped = groups(model, projections)
    out = {}
    for module, parts in weights.items():
        if module not in grouped:
            out[module] = parts
            continue
        start = 0
        for part in grouped[module]:
            rows = projections[part].out_features
            out[part] = {"A": parts["A"], "B": parts["B"][start : start + rows]}
            start += rows
    return out


def share_a(model: nn.Module, adapter: str, projections: dict[str, nn.Module]) -> None:
    """Make each fused projection's parts use the first part's `lora_A[adapter]` (one parameter)."""
    for parts in groups(model, projections).values():
        layers = [model.get_submodule(p) for p in parts]
        if all(hasattr(layer, "lora_A") and adapter in layer.lora_A for layer in layers):
            for layer in layers[1:]:
                layer.lora_A[adapter] = layers[0].lora_A[adapter]


def fuse(model: nn.Module, tensors: dict[str, torch.Tensor], key, projections: dict[str, nn.Module]) -> dict:
    """PEFT's file tensors (`key(module, part)` -> tensor) with each fused projection's parts joined: A once
    (the parts share it), B concatenated by rows."""
    out = dict(tensors)
    for fused, parts in groups(model, projections).items():
        if not all(key(p, "A") in out for p in parts):
            continue
        a = out[key(parts[0], "A")]
        bs = [out[key(p, "B")] for p in parts]
        for p in parts:
            del out[key(p, "A")], out[key(p, "B")]
        out[key(fused, "A")], out[key(fused, "B")] = a, torch.cat(bs)
    return out


__all__ = ["groups", "candidates", "expand", "peft_name", "split", "share_a", "fuse"]
