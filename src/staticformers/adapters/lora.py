"""LoRA adapters applied to a built model from outside, with PEFT's layout and names.

Why this exists: fine-tuning a checkpoint with LoRA, and serving the result without merging it,
should use the API and the files people know (`peft`), while the decoder (`models/decoder.py`) stays the
architecture alone. So an adapter never changes the model code: each target `nn.Linear` is replaced
in its parent by a `LoraLinear` that keeps it as `base_layer`, as PEFT does. The parameters then have
PEFT's names (`model.layers.0.self_attn.q_proj.lora_A.default.weight`, the base weight under
`...q_proj.base_layer.weight`), which map one to one onto PEFT's files (`adapters/files.py`).

The math is PEFT's: `base(x) + lora_B(lora_A(dropout(x))) * scaling` for each active adapter, the
LoRA product in the adapter's dtype and the sum cast back to the base output's dtype; `scaling` is
`lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA). New adapters are initialised as PEFT does them
(A Kaiming-uniform, B zero; or "gaussian"; or both left as `nn.Linear` makes them), in float32 when
the base is bf16/fp16 (PEFT's `autocast_adapter_dtype`), and only they train: `add_adapter` freezes
the base. A module that wraps projections tells tensor parallel how its parts follow its base's
style (`tensor_parallel_plan`).

A family whose checkpoints fuse projections (Phi-3's `qkv_proj`) is adapted under PEFT's fused names, its
split parts sharing one A (`fused_targets.py`).

A batch whose rows use different adapters (`adapters/bank.py`) reads stacked weights instead of the
named ones while the generation engine runs it (`lora_routing`).

The functions here take the model; `auto.ModelForCausalLM` exposes them as methods with
transformers' names (`add_adapter`, `load_adapter`, `set_adapter`, `disable_adapters`,
`enable_adapters`, `active_adapters`, `merge_and_unload`, `unload`, `delete_adapter`).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from ..models.moe import SparseMoeBlock
from ..models.quantization import QuantLinear, compute_dtype
from .bank_registry import bank_of
from . import fused_targets
from .lora_config import ALL_LINEAR, DEFAULT_TARGETS, AdapterConfigError, LoraConfig

logger = logging.getLogger("staticformers")

DEFAULT_ADAPTER = "default"
BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch (`adapter_names`)
RESERVED = {BASE: "it names the base model without an adapter"}  # names no adapter may take, and why
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


class LoraLinear(nn.Module):
    """A linear projection with LoRA adapters beside it (see the module docstring). `base_layer` is the
    original `nn.Linear`; `lora_A[name]` (`in -> r`), `lora_B[name]` (`r -> out`) and `lora_dropout[name]`
    are PEFT's modules; `scaling[name]` is the adapter's scale. `active` names the adapters applied,
    `disabled` turns them all off."""

    def __init__(self, base_layer: nn.Linear):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.r: dict[str, int] = {}
        self.lora_alpha: dict[str, float] = {}
        self.scaling: dict[str, float] = {}
        self.active: tuple = ()
        self.disabled = False
        self.lora_routing = None  # an AdapterBank (adapters/bank.py) while one is attached

    def add(
        self,
        name: str,
        r: int,
        alpha: float,
        scaling: float,
        dropout: float,
        init: Union[bool, str],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Create adapter `name` of rank `r` (initialised as PEFT does, see the module docstring)."""
        a = nn.Linear(self.in_features, r, bias=False, dtype=dtype, device=device)
        b = nn.Linear(r, self.out_features, bias=False, dtype=dtype, device=device)
        if init is True:
            nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
            nn.init.zeros_(b.weight)
        elif init == "gaussian":
            nn.init.normal_(a.weight, std=1 / r)
            nn.init.zeros_(b.weight)
        self.lora_A[name], self.lora_B[name] = a, b
        self.lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r[name], self.lora_alpha[name], self.scaling[name] = r, alpha, scaling

    def remove(self, name: str) -> None:
        for d in (self.lora_A, self.lora_B, self.lora_dropout):
            del d[name]
        for d in (self.r, self.lora_alpha, self.scaling):
            d.pop(name)
        self.active = tuple(n for n in self.active if n != name)

    def delta_weight(self, name: str) -> torch.Tensor:
        """`B @ A * scaling` in float32: what merging adds to the base weight."""
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        return (b.float() @ a.float()) * self.scaling[name]

    def forward(self, x: torch.Tensor, base: Optional[Callable] = None) -> torch.Tensor:
        """`base(base_layer, x)` computes the base projection (default: the layer itself; a backend passes
        its own formulation), then each active adapter is added."""
        out = self.base_layer(x) if base is None else base(self.base_layer, x)
        routing = self.lora_routing
        if routing is not None and routing.engaged:
            return routing.forward(self, x, out)
        if self.disabled or not self.active:
            return out
        result = out
        for name in self.active:
            a = self.lora_A[name]
            h = x.to(a.weight.dtype)
            result = result + self.lora_B[name](a(self.lora_dropout[name](h))) * self.scaling[name]
        return result.to(out.dtype)

    def tensor_parallel_plan(self, style: str) -> dict[str, str]:
        """How this module's parts follow `style` of its base under tensor parallel (relative names): a
        column-wise base splits B like itself (its output columns) and keeps A whole; a row-wise base
        splits A (its input columns) and keeps B whole."""
        if style == "colwise":
            return {"base_layer": "colwise", **{f"lora_B.{n}": "colwise" for n in self.lora_B}}
        if style == "rowwise":
            return {"base_layer": "rowwise", **{f"lora_A.{n}": "rowwise" for n in self.lora_A}}
        return {"base_layer": style}

    def extra_repr(self) -> str:
        return f"adapters={list(self.r)}, active={list(self.active)}{', disabled' if self.disabled else ''}"


# ---------------------------------------------------------------------------------------------
# which modules
# ---------------------------------------------------------------------------------------------
def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Module name -> LoraLinear, in the model's order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_adapters(model: nn.Module) -> bool:
    """Whether the model holds named (PEFT) adapters."""
    return bool(getattr(model, "peft_config", None))


def linear_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """The projections an adapter may target: every `nn.Linear` of the decoder layers (or the LoraLinear
    already wrapping one), by full name. The output head and the embedding are not among them, nor a router
    that transformers names otherwise (`_foreign_router`)."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(name.startswith(w + ".") for w in out if isinstance(out[w], LoraLinear)):
            continue  # the parts of a LoRA layer (base_layer, lora_A, lora_B)
        if isinstance(module, LoraLinear) or isinstance(module, nn.Linear):
            if module is getattr(model, "lm_head", None) or not name.startswith("model.layers."):
                continue
            if _foreign_router(model, name):
                continue
            out[name] = module
    return out


def _foreign_router(model: nn.Module, name: str) -> bool:
    """Whether `name` is a sparse block's router (`mlp.gate` here) that transformers holds under another name and
    not as a linear layer: gpt-oss's `mlp.router`, which peft does not adapt ("all-linear" leaves it out) and no
    peft adapter file names, so an adapter on it could neither load from peft nor into it."""
    expert_names = getattr(getattr(getattr(model, "config", None), "family", None), "expert_names", None)
    if expert_names is None or expert_names.router == "gate" or not name.endswith(".gate"):
        return False
    return isinstance(model.get_submodule(name.rpartition(".")[0]), SparseMoeBlock)


def _layer_index(name: str) -> Optional[int]:
    m = re.match(r".*?\.[^.]*\.(\d+)\.", name)  # PEFT's rule: the first numbered segment
    return int(m.group(1)) if m else None


def target_names(model: nn.Module, config: LoraConfig) -> list[str]:
    """The full names of the model's modules `config` targets (PEFT's matching rules, on PEFT's module names:
    a fused projection's parts are targeted together, `fused_targets.py`), checked: every named target
    matches a projection; the output head is never one."""
    projections = linear_candidates(model)
    chosen = peft_target_names(model, config, projections)
    return [part for parts in fused_targets.expand(model, chosen, projections).values() for part in parts]


def peft_target_names(model: nn.Module, config: LoraConfig, projections: Optional[dict] = None) -> list[str]:
    """`target_names` as PEFT names them (Phi-3's `...self_attn.qkv_proj`, not its parts)."""
    candidates = fused_targets.candidates(projections if projections is not None else linear_candidates(model), model)
    targets = config.target_modules if config.target_modules is not None else DEFAULT_TARGETS
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        chosen = list(candidates)
    elif isinstance(targets, str):
        if re.fullmatch(targets, "lm_head"):
            raise AdapterConfigError(
                f"target_modules={targets!r} matches lm_head: staticformers puts adapters on the "
                f"decoder layers' projections only."
            )
        chosen = [n for n in candidates if re.fullmatch(targets, n)]
    else:
        if "lm_head" in targets or "embed_tokens" in targets:
            raise AdapterConfigError(
                f"target_modules={targets!r} names the output head or the embedding: staticformers "
                f"puts adapters on the decoder layers' projections only."
            )
        for t in targets:
            if not any(n == t or n.endswith("." + t) for n in candidates):
                short = sorted({n.rsplit(".", 1)[-1] for n in candidates})
                raise AdapterConfigError(
                    f"target_modules entry {t!r} matches no projection of this model: use names "
                    f'among {", ".join(short)} (or "all-linear").'
                )
        chosen = [n for n in candidates if any(n == t or n.endswith("." + t) for t in targets)]
    excluded = config.exclude_modules
    if excluded:
        if isinstance(excluded, str):
            chosen = [n for n in chosen if not re.fullmatch(excluded, n)]
        else:
            chosen = [n for n in chosen if not any(n == e or n.endswith("." + e) for e in excluded)]
    layers = config.layers_to_transform
    if layers is not None:
        wanted = {layers} if isinstance(layers, int) else set(layers)
        chosen = [n for n in chosen if _layer_index(n) in wanted]
    for n in chosen:
        parent, _, leaf = n.rpartition(".")
        if leaf in getattr(model.get_submodule(parent), "absorbed", ()):
            raise AdapterConfigError(
                f"target_modules={targets!r} selects {n}, which latent attention never runs as a projection (its "
                f"weight is absorbed into the query and the output): leave it out, e.g. exclude_modules=[{leaf!r}]."
            )
    if not chosen:
        raise AdapterConfigError(
            f"target_modules={targets!r} selects no projection of this model (after "
            f"exclude_modules and layers_to_transform): check the names in model.named_modules()."
        )
    return chosen


def wrap(model: nn.Module, names: Iterable[str]) -> dict[str, LoraLinear]:
    """Replace each named `nn.Linear` by a LoraLinear around it (a LoraLinear already there stays); returns them."""
    out = {}
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, LoraLinear):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            module = LoraLinear(module)
            setattr(parent, leaf, module)
        out[name] = module
    return out


def adapter_dtype(layer: LoraLinear) -> torch.dtype:
    """The dtype of a new adapter beside this base: float32 under a bf16/fp16 base (PEFT's autocast), else the base's."""
    dtype = compute_dtype(layer.base_layer)  # a quantized base (int8 values): its scales' dtype
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


# ---------------------------------------------------------------------------------------------
# the model-level operations
# ---------------------------------------------------------------------------------------------
def check_adapter_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name == BASE:
        raise ValueError(
            f"adapter_name={name!r} must be a non-empty name of letters, digits, '_' or '-' "
            f"(and not {BASE!r}, which means the base model)."
        )
    return name


def _configs(model) -> dict:
    if not hasattr(model, "peft_config") or model.peft_config is None:
        model.peft_config = {}
    return model.peft_config


def _require(model, what: str) -> dict:
    configs = getattr(model, "peft_config", None)
    if not configs:
        raise ValueError(
            f"{what} needs an adapter, and this model has none: add one with "
            f"model.add_adapter(LoraConfig(...)) or model.load_adapter(path)."
        )
    return configs


def add_adapter(
    model, config: LoraConfig, adapter_name: Optional[str] = None, trainable: bool = True, activate: bool = True
) -> list[str]:
    """Add a new adapter (`config` a LoraConfig) on the modules it targets; the base is frozen and the new
    adapter active and trainable (transformers' `add_adapter`). Returns the wrapped module names (a
    partitioned model's caller then partitions them: `distributed.adapters.partition_adapters`)."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"add_adapter needs a staticformers LoraConfig, not {type(config).__name__}.")
    name = check_adapter_name(adapter_name or DEFAULT_ADAPTER)
    configs = _configs(model)
    if name in configs:
        raise ValueError(
            f"The model has an adapter named {name!r} already: pass another adapter_name, or "
            f"model.delete_adapter({name!r}) first."
        )
    projections = linear_candidates(model)
    names = target_names(model, config)
    for p in model.parameters():
        p.requires_grad_(False)
    layers = wrap(model, names)
    for module_name, layer in layers.items():
        peft = fused_targets.peft_name(model, module_name, projections)  # what rank_pattern / alpha_pattern name
        layer.add(
            name,
            config.rank_for(peft),
            config.alpha_for(peft),
            config.scaling_for(peft),
            float(config.lora_dropout),
            config.init_lora_weights,
            adapter_dtype(layer),
            layer.base_layer.weight.device,
        )
    fused_targets.share_a(model, name, linear_candidates(model))
    for layer in layers.values():
        for p in list(layer.lora_A[name].parameters()) + list(layer.lora_B[name].parameters()):
            p.requires_grad_(trainable)
    configs[name] = config.copy(
        base_model_name_or_path=getattr(model, "name_or_path", None), inference_mode=not trainable
    )
    if activate:
        set_adapter(model, name)
    return names


def set_adapter(model, adapter_name: Union[str, list]) -> None:
    """Use `adapter_name` (or several, summed) from now on; the others stay loaded but inactive."""
    configs = _require(model, "set_adapter")
    names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
    missing = [n for n in names if n not in configs]
    if missing or not names:
        raise ValueError(
            f"The model has no adapter named {missing[0] if missing else adapter_name!r}: it has "
            f"{', '.join(map(repr, configs))}."
        )
    for layer in lora_modules(model).values():
        layer.active = tuple(n for n in names if n in layer.lora_A)
    model.active_adapter_names = names


def active_adapters(model) -> list[str]:
    _require(model, "active_adapters")
    return list(getattr(model, "active_adapter_names", []))


def enable_adapters(model, enabled: bool = True) -> None:
    _require(model, "enable_adapters" if enabled else "disable_adapters")
    for layer in lora_modules(model).values():
        layer.disabled = not enabled


def adapters_enabled(model) -> bool:
    return not any(layer.disabled for layer in lora_modules(model).values())


def delete_adapter(model, adapter_name: str) -> None:
    """Remove an adapter; a module left with none gets its base layer back."""
    configs = _require(model, "delete_adapter")
    if adapter_name not in configs:
        raise ValueError(f"The model has no adapter named {adapter_name!r}: it has {', '.join(map(repr, configs))}.")
    bank = bank_of(model)
    if bank is not None and adapter_name in bank.slots:
        bank.remove(adapter_name)
    for layer in lora_modules(model).values():
        if adapter_name in layer.lora_A:
            layer.remove(adapter_name)
    del configs[adapter_name]
    model.active_adapter_names = [n for n in getattr(model, "active_adapter_names", []) if n != adapter_name]
    _unwrap_empty(model)


def _unwrap_empty(model) -> None:
    for name, layer in lora_modules(model).items():
        if not layer.lora_A and layer.lora_routing is None:
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, layer.base_layer)


def detach_bank(model) -> None:
    """Drop the model's AdapterBank, if it has one (its stacked weights go with it)."""
    bank = bank_of(model)
    if bank is not None:
        bank.detach()


def _refuse_partitioned(model, what: str) -> None:
    if getattr(model, "parallel_dims", None) is not None:
        raise ValueError(
            f"{what} on a partitioned model is not supported: save the adapter (save_pretrained), "
            f"load it in one process and {what} there."
        )


def merge_and_unload(model, adapter_names: Optional[list] = None, safe_merge: bool = False, progressbar: bool = False):
    """Add the active adapters (or `adapter_names`) into the base weights and drop every adapter: the
    model is a plain one again (PEFT's `merge_and_unload`). `safe_merge`: refuse a merge that gives NaN or
    infinite weights. Returns the model."""
    configs = _require(model, "merge_and_unload")
    _refuse_partitioned(model, "merge_and_unload")
    names = list(adapter_names) if adapter_names is not None else list(getattr(model, "active_adapter_names", []))
    unknown = [n for n in names if n not in configs]
    if unknown:
        raise ValueError(f"The model has no adapter named {unknown[0]!r}: it has {', '.join(map(repr, configs))}.")
    quantized = [n for n, layer in lora_modules(model).items() if isinstance(layer.base_layer, QuantLinear)]
    if quantized:
        raise ValueError(
            f"merge_and_unload over a quantized base ({quantized[0]}) would round the adapter away: load "
            f"the unquantized base, load the adapter there and merge, then quantize."
        )
    detach_bank(model)
    with torch.no_grad():
        for name, layer in lora_modules(model).items():
            w = layer.base_layer.weight
            merged = w.float()
            for n in names:
                if n in layer.lora_A:
                    merged = merged + layer.delta_weight(n).to(w.device)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(
                    f"Merging into {name} gives NaN or infinite weights: the adapter is broken; "
                    f"nothing was merged into that layer."
                )
            w.copy_(merged.to(w.dtype))
    unload(model)
    return model


def unload(model):
    """Drop every adapter without merging: the base model as it was loaded. Returns the model."""
    _require(model, "unload")
    detach_bank(model)
    for name, layer in lora_modules(model).items():
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, layer.base_layer)
    model.peft_config = {}
    model.active_adapter_names = []
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def adapter_state(modules: Iterable[nn.Module]) -> tuple:
    """What decides the adapters' forward besides their weights (active names, disabled, the attached
    bank): part of the generation engine's fingerprint, so a change rebuilds the compiled steps."""
    return tuple(
        (
            id(m),
            m.active,
            m.disabled,
            tuple(m.scaling.items()),
            m.lora_routing.serial if m.lora_routing is not None else None,
        )
        for m in modules
        if isinstance(m, LoraLinear)
    )


def trainable_adapter(model) -> Optional[str]:
    """The one adapter whose weights train (requires_grad), None when none does; several are refused."""
    names = set()
    for layer in lora_modules(model).values():
        for n in layer.lora_A:
            if any(p.requires_grad for p in list(layer.lora_A[n].parameters()) + list(layer.lora_B[n].parameters())):
                names.add(n)
    if len(names) > 1:
        raise ValueError(
            f"Adapters {', '.join(sorted(map(repr, names)))} are all trainable: train one adapter at a "
            f"time (load the others with is_trainable=False)."
        )
    return names.pop() if names else None


__all__ = [
    "LoraConfig",
    "LoraLinear",
    "add_adapter",
    "set_adapter",
    "active_adapters",
    "enable_adapters",
    "delete_adapter",
    "merge_and_unload",
    "unload",
    "lora_modules",
    "has_adapters",
    "target_names",
    "adapter_state",
    "trainable_adapter",
    "DEFAULT_ADAPTER",
    "BASE",
]
