"""PEFT's adapter folders in and out: `adapter_config.json` + `adapter_model.safetensors`.

Why this exists: an adapter trained with `peft` must load here, and ours in `peft`, with nothing
converted by hand. PEFT stores each LoRA weight under the module's full name behind the
`base_model.model.` prefix, without the adapter's name (`base_model.model.model.layers.0.self_attn.
q_proj.lora_A.weight`), and the config as its LoraConfig's fields. Here:

- reading checks everything before the model is touched: the config through `LoraConfig.from_peft_dict`
  (what we cannot honour is refused), the weights through the checked safetensors reader (header,
  sizes, truncation), every key a `lora_A`/`lora_B` weight of a projection this model has, A `[r, in]`
  and B `[out, r]` with the rank the config gives that module, floating point and finite;
- a pickle (`adapter_model.bin`) is never unpickled: it is refused with a sentence saying how to
  convert it;
- loading an adapter under a name the model already holds, with the same modules and ranks, writes
  the new weights into the existing tensors (PEFT's hot-swap): parameter identity and addresses stay,
  so the generation engine's compiled steps keep running (nothing compiles);
- saving writes the active adapter as PEFT does, each file replaced in one rename;
- a family whose checkpoints fuse projections (Phi-3's `qkv_proj`) has PEFT's fused module in the files
  and its split parts in the model: A shared, B split by rows on reading, joined on saving
  (`fused_targets.py`).
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from .lora_config import AdapterConfigError, LoraConfig
from .bank_registry import bank_of
from . import fused_targets
from .lora import (
    DEFAULT_ADAPTER,
    adapter_dtype,
    check_adapter_name,
    linear_candidates,
    lora_modules,
    peft_target_names,
    set_adapter,
    wrap,
)
from ..utils.atomic_files import write_atomic, write_text_atomic
from ..checkpoints.hub import resolve_file
from ..checkpoints.safetensors_io import SafetensorsFile, SafetensorsFormatError, save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


class AdapterFileError(ValueError):
    """An adapter folder that cannot be loaded into this model (one sentence naming the file)."""


def peft_key(module_name: str, part: str) -> str:
    """PEFT's name of a LoRA weight (`part` "A" or "B")."""
    return f"{PREFIX}{module_name}.lora_{part}.weight"


def param_name(module_name: str, part: str, adapter_name: str) -> str:
    """Our (and PEFT's in-memory) parameter name of that weight."""
    return f"{module_name}.lora_{part}.{adapter_name}.weight"


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def is_adapter_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def read_config(path: str, **hub) -> LoraConfig:
    """The folder's (or Hub repo's) adapter_config.json as a LoraConfig, checked."""
    from ..checkpoints.hub import CheckpointNotFoundError
    from ..checkpoints.json_files import read_json_object

    try:
        file = resolve_file(path, ADAPTER_CONFIG, **hub)
    except CheckpointNotFoundError:
        raise AdapterFileError(
            f"{path} has no {ADAPTER_CONFIG}: it is not a PEFT adapter folder (pass the folder "
            f"peft's or staticformers' save_pretrained wrote)."
        ) from None
    data = read_json_object(file, "restore it from the adapter's source", AdapterFileError)
    return LoraConfig.from_peft_dict(data, source=file)


def weights_file(path: str, **hub) -> str:
    """The adapter's safetensors file; a folder with only a pickle is refused (it is never unpickled)."""
    found = resolve_file(path, ADAPTER_WEIGHTS, required=False, **hub)
    if found is not None:
        return found
    if resolve_file(path, ADAPTER_PICKLE, required=False, **hub) is not None:
        raise AdapterFileError(
            f"{path} holds only a pickle adapter ({ADAPTER_PICKLE}), which staticformers never unpickles: convert it "
            f"to safetensors first (with peft: PeftModel.from_pretrained(...).save_pretrained(dir, "
            f"safe_serialization=True))."
        )
    raise AdapterFileError(f"{path} has no {ADAPTER_WEIGHTS}: the adapter folder is incomplete.")


def read_weights(file: str) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> {"A": tensor, "B": tensor} from a PEFT safetensors file, checked on its own (keys,
    pairs, shapes, dtypes, finite values)."""
    name = os.path.basename(file)
    try:
        f = SafetensorsFile(file)
    except SafetensorsFormatError as err:
        raise AdapterFileError(str(err)) from None
    out: dict[str, dict[str, torch.Tensor]] = {}
    with f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None:
                raise AdapterFileError(
                    f"{file} holds {key!r}, which is not the lora_A or lora_B weight of a linear "
                    f"layer: staticformers loads plain LoRA adapters (no DoRA, embeddings or saved "
                    f"modules)."
                )
            if not f.dtype(key).is_floating_point or len(f.shape(key)) != 2:
                raise AdapterFileError(
                    f"{key} in {name} is {list(f.shape(key))} {f.dtype(key)}: a LoRA weight is a "
                    f"floating-point matrix; the file is damaged or not a LoRA adapter."
                )
            out.setdefault(m.group("module"), {})[m.group("part")] = f.read(key)
    for module, parts in out.items():
        if set(parts) != {"A", "B"}:
            missing = "B" if "A" in parts else "A"
            raise AdapterFileError(
                f"{file} has lora_{'A' if missing == 'B' else 'B'} but no lora_{missing} for "
                f"{module}: the adapter file is incomplete."
            )
        a, b = parts["A"], parts["B"]
        if a.shape[0] != b.shape[1]:
            raise AdapterFileError(
                f"{file}: {module}'s lora_A is {list(a.shape)} and lora_B {list(b.shape)}, whose "
                f"ranks differ: the file is damaged."
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterFileError(
                f"{file}: {module}'s LoRA weights hold NaN or infinite values: the adapter is "
                f"broken; train or download it again."
            )
    if not out:
        raise AdapterFileError(f"{file} holds no LoRA weights.")
    return out


def check_fits(model, config: LoraConfig, weights: dict, source: str) -> None:
    """Every module of `weights` is a projection of `model` that the adapter's config targets, with the
    shapes the config gives it (PEFT refuses a config whose targets the model lacks, and applies no weight
    of a module its config does not target)."""
    projections = linear_candidates(model)
    candidates = fused_targets.candidates(projections, model)  # PEFT's names, as the files spell them
    try:
        targeted = set(peft_target_names(model, config, projections))
    except AdapterConfigError as err:
        raise AdapterFileError(f"{source}: its {ADAPTER_CONFIG} does not fit this model: {err}") from None
    strays = sorted(m for m in weights if m in candidates and m not in targeted)
    if strays:
        raise AdapterFileError(
            f"{source} has weights for {strays[0]}{f' and {len(strays) - 1} more' if len(strays) > 1 else ''}"
            f", which its {ADAPTER_CONFIG} does not target (target_modules="
            f"{config.target_modules!r}): the config and the weights disagree; fix the config."
        )
    for module, parts in weights.items():
        features = candidates.get(module)
        if features is None:
            raise AdapterFileError(
                f"{source} has weights for {module}, which is not a projection of this model's "
                f"decoder layers (staticformers puts adapters on those only): the adapter targets "
                f"other modules or was trained on another architecture."
            )
        in_features, out_features = features
        r = config.rank_for(module)
        a, b = parts["A"], parts["B"]
        if tuple(a.shape) != (r, in_features) or tuple(b.shape) != (out_features, r):
            raise AdapterFileError(
                f"{source}: {module}'s lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but this model's layer "
                f"is {in_features} -> {out_features} with r={r} in {ADAPTER_CONFIG}: the adapter was "
                f"trained on another model, or its config does not match its weights."
            )


def read_adapter(model, path: str, **hub) -> tuple[LoraConfig, dict]:
    """The adapter at `path` (folder or Hub id), checked against `model`, its weights per module of the model
    (a fused module's split, `fused_targets.split`); nothing is changed."""
    path = os.fspath(path)
    config = read_config(path, **hub)
    file = weights_file(path, **hub)
    weights = read_weights(file)
    check_fits(model, config, weights, file)
    return config, fused_targets.split(model, weights, linear_candidates(model))


# ---------------------------------------------------------------------------------------------
# loading into the model
# ---------------------------------------------------------------------------------------------
def load_adapter(
    model,
    peft_model_id: str,
    adapter_name: Optional[str] = None,
    is_trainable: bool = False,
    revision: Optional[str] = None,
    cache_dir: Optional[str] = None,
    local_files_only: bool = False,
    token: Optional[str] = None,
) -> str:
    """Load a PEFT adapter (folder or Hub id) as `adapter_name` (default "default"); see the module docstring.
    The base is frozen, and the adapter too unless `is_trainable` (transformers' default). The first
    adapter of a model becomes active. Returns the adapter's name."""
    name = check_adapter_name(adapter_name or DEFAULT_ADAPTER)
    hub = dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)
    config, weights = read_adapter(model, peft_model_id, **hub)
    configs = getattr(model, "peft_config", None) or {}
    if name in configs:
        _hot_swap(model, name, config, weights, peft_model_id, is_trainable)
        return name
    first = not configs
    _install(model, name, config, weights, is_trainable)
    model.peft_config = {**configs, name: config.copy(inference_mode=not is_trainable)}
    if first:
        set_adapter(model, name)
    if not is_trainable:
        model.eval()
    return name


def _install(model, name: str, config: LoraConfig, weights: dict, trainable: bool) -> None:
    if getattr(model, "parallel_dims", None) is not None:
        raise ValueError(
            "load_adapter on a partitioned model is not supported: load it in one process, or add a "
            "new adapter with add_adapter and train it partitioned."
        )
    frozen = [p for n, p in model.named_parameters() if ".lora_" not in n]  # the base (other adapters keep theirs)
    projections = linear_candidates(model)
    layers = wrap(model, list(weights))
    for module, layer in layers.items():
        a, b = weights[module]["A"], weights[module]["B"]
        peft = fused_targets.peft_name(model, module, projections)
        layer.add(
            name,
            config.rank_for(peft),
            config.alpha_for(peft),
            config.scaling_for(peft),
            float(config.lora_dropout),
            False,
            adapter_dtype(layer),
            layer.base_layer.weight.device,
        )
        with torch.no_grad():
            layer.lora_A[name].weight.copy_(a)
            layer.lora_B[name].weight.copy_(b)
    fused_targets.share_a(model, name, linear_candidates(model))
    for layer in layers.values():
        for p in list(layer.lora_A[name].parameters()) + list(layer.lora_B[name].parameters()):
            p.requires_grad_(trainable)
    for p in frozen:  # the base is frozen, as PEFT's injection does it
        p.requires_grad_(False)


def _hot_swap(model, name: str, config: LoraConfig, weights: dict, source: str, trainable: bool) -> None:
    """New weights for adapter `name` written into its tensors (same modules, same ranks), in place."""
    layers = {m: layer for m, layer in lora_modules(model).items() if name in layer.lora_A}
    projections = linear_candidates(model)
    peft = {m: fused_targets.peft_name(model, m, projections) for m in weights}
    if set(layers) != set(weights) or any(layers[m].r[name] != config.rank_for(peft[m]) for m in weights):
        raise ValueError(
            f"The model has an adapter named {name!r} on other modules or with other ranks than "
            f"{source}: pass another adapter_name, or model.delete_adapter({name!r}) first."
        )
    with torch.no_grad():
        for module, layer in layers.items():
            layer.lora_A[name].weight.copy_(weights[module]["A"])
            layer.lora_B[name].weight.copy_(weights[module]["B"])
            layer.lora_alpha[name], layer.scaling[name] = (
                config.alpha_for(peft[module]),
                config.scaling_for(peft[module]),
            )
            for p in list(layer.lora_A[name].parameters()) + list(layer.lora_B[name].parameters()):
                p.requires_grad_(trainable)
    model.peft_config[name] = config.copy(inference_mode=not trainable)
    bank = bank_of(model)
    if bank is not None and name in bank.slots:
        bank.put_named(name)  # in place too


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------
def adapter_tensors(model, adapter_name: str, tensors: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor (CPU, contiguous) of one adapter; `tensors` (param name -> tensor) overrides the
    model's values (the Trainer's fp32 master weights)."""
    out = {}
    for module, layer in lora_modules(model).items():
        if adapter_name not in layer.lora_A:
            continue
        for part, holder in (("A", layer.lora_A), ("B", layer.lora_B)):
            value = (tensors or {}).get(param_name(module, part, adapter_name))
            if value is None:
                value = holder[adapter_name].weight
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            out[peft_key(module, part)] = value.detach().to("cpu").contiguous()
    return fused_targets.fuse(model, out, peft_key, linear_candidates(model))


def saved_adapter(model) -> str:
    """The adapter `save_pretrained` writes: the active one (transformers saves one adapter at a time)."""
    names = list(getattr(model, "active_adapter_names", None) or [])
    if len(names) != 1:
        if not names and len(model.peft_config) == 1:
            return next(iter(model.peft_config))
        raise ValueError(
            f"save_pretrained writes one adapter and {len(names)} are active ({', '.join(names)}): "
            f"model.set_adapter(name) first."
        )
    return names[0]


def save_adapter(
    model,
    directory: str,
    adapter_name: Optional[str] = None,
    tensors: Optional[dict] = None,
    weights: Optional[dict] = None,
) -> str:
    """Write adapter_config.json and adapter_model.safetensors of one adapter into `directory` (created).
    `weights` (PEFT key -> tensor) are written as given (a partitioned model's gathered ones)."""
    directory = os.fspath(directory)
    if os.path.isfile(directory):
        raise ValueError(f"{directory} is a file: save_pretrained needs a folder path.")
    name = adapter_name or saved_adapter(model)
    if name not in model.peft_config:
        raise ValueError(f"The model has no adapter named {name!r}: it has {', '.join(map(repr, model.peft_config))}.")
    os.makedirs(directory, exist_ok=True)
    weights = weights if weights is not None else adapter_tensors(model, name, tensors)
    write_atomic(
        os.path.join(directory, ADAPTER_WEIGHTS), lambda tmp: save_file(weights, tmp, metadata={"format": "pt"})
    )
    config = model.peft_config[name].copy(
        base_model_name_or_path=getattr(model, "name_or_path", None) or model.peft_config[name].base_model_name_or_path,
        inference_mode=True,
    )
    write_text_atomic(
        os.path.join(directory, ADAPTER_CONFIG), json.dumps(config.to_peft_dict(), indent=2, sort_keys=True)
    )
    return directory


def read_checkpoint_adapter(
    directory: str, expected: dict[str, tuple], fused=None
) -> Optional[dict[str, torch.Tensor]]:
    """A training checkpoint's adapter as {param name: tensor} for the names in `expected` (one adapter's
    weights, name -> shape), or None when `directory` holds no adapter. `fused`: the family's
    `checkpoints.names.FusedNames`, whose fused modules' weights are split over their parts (A to each part
    that holds its own, B by the parts' rows). Raises AdapterFileError when the file does not fit."""
    file = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(directory, ADAPTER_PICKLE)):
            weights_file(directory)  # the pickle refusal
        return None
    weights = read_weights(file)
    if not all(".lora_" in n for n in expected):
        raise AdapterFileError(
            f"{file}: the checkpoint holds an adapter alone, but this run also trains other "
            f"weights ({next(n for n in expected if '.lora_' not in n)})."
        )
    adapters = {n.split(".lora_")[1].split(".")[1] for n in expected}
    if len(adapters) != 1:
        raise AdapterFileError(f"{file}: a checkpoint holds one adapter, and this run trains {len(adapters)}.")
    name = adapters.pop()
    out = {}
    for module, parts in weights.items():
        pieces = _fused_parts(module, fused, name, expected)
        if pieces:
            start = 0
            for piece in pieces:
                if param_name(piece, "A", name) in expected:
                    out[param_name(piece, "A", name)] = parts["A"]
                rows = expected[param_name(piece, "B", name)][0]
                out[param_name(piece, "B", name)] = parts["B"][start : start + rows]
                start += rows
            continue
        for part, value in parts.items():
            out[param_name(module, part, name)] = value
    extra = sorted(set(out) - set(expected))
    missing = sorted(set(expected) - set(out))
    if extra or missing:
        what = f"has weights for {extra[0]}" if extra else f"lacks {missing[0]}"
        raise AdapterFileError(f"{file} {what}: the checkpoint belongs to another adapter or model.")
    for n, t in out.items():
        if tuple(t.shape) != tuple(expected[n]):
            raise AdapterFileError(
                f"{file}: {n} has shape {list(t.shape)}, not {list(expected[n])}: the checkpoint "
                f"belongs to another adapter or model."
            )
    return out


def _fused_parts(module: str, fused, adapter: str, expected: dict) -> Optional[list[str]]:
    """The model's parts of PEFT's fused `module` (`fused`: FusedNames) when `expected` holds their B, else None."""
    m = re.match(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<module>.+)$", module) if fused is not None else None
    if m is None or param_name(module, "A", adapter) in expected:
        return None
    for name, parts in fused.groups:
        full = [f"{m['layer']}.{p}" for p in parts]
        if name == m["module"] and all(param_name(p, "B", adapter) in expected for p in full):
            return full
    return None


__all__ = [
    "load_adapter",
    "save_adapter",
    "read_adapter",
    "read_config",
    "read_weights",
    "adapter_tensors",
    "peft_key",
    "param_name",
    "is_adapter_folder",
    "read_checkpoint_adapter",
    "AdapterFileError",
    "AdapterConfigError",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ADAPTER_PICKLE",
]
