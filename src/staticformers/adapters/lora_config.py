"""`LoraConfig`: PEFT's LoRA settings, with PEFT's names, defaults and `adapter_config.json` spelling.

Why this exists: an adapter is described by the same fields whether it was made here or by `peft`
(`r`, `lora_alpha`, `lora_dropout`, `target_modules`, `bias`, `use_rslora`, `init_lora_weights`,
...). `to_peft_dict()` writes what PEFT writes to `adapter_config.json` (so `PeftModel.from_pretrained`
reads ours), `from_peft_dict()` reads PEFT's file. What PEFT can do and we cannot (DoRA, trained
biases, Conv1D fan-in/fan-out, whole modules to save, PiSSA-style inits that rewrite the base
weights, layer replication, ...) is refused with one sentence, never silently ignored: a field this
file does not know is accepted only while it holds its off value (None, False, empty).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

# the modules PEFT targets when target_modules is None, for every family we load (PEFT's table)
DEFAULT_TARGETS = ["q_proj", "v_proj"]
ALL_LINEAR = "all-linear"
INITS = (True, False, "gaussian")
# keys PEFT writes whose value says nothing about the adapter's math (qalora_group_size: only with use_qalora)
_INERT_KEYS = {"peft_version", "megatron_core", "auto_mapping", "qalora_group_size", "runtime_config"}


class AdapterConfigError(ValueError):
    """A LoRA configuration staticformers cannot honour, or an adapter_config.json it cannot read."""


def _refuse(source: str, message: str) -> AdapterConfigError:
    return AdapterConfigError(f"{source}: {message}" if source else message)


@dataclass
class LoraConfig:
    """PEFT's `LoraConfig` fields (defaults as PEFT's). `target_modules`: a list of module names (a module
    matches when its full name equals one or ends with `.name`), a regular expression matched against the
    full name, or "all-linear" (every projection of the decoder layers); None: PEFT's default for these
    families, q_proj and v_proj. `layers_to_transform`: the layer indices to adapt (all when None)."""

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: Optional[Union[list, str]] = None
    bias: str = "none"
    use_rslora: bool = False
    init_lora_weights: Union[bool, str] = True
    modules_to_save: Optional[list] = None
    fan_in_fan_out: bool = False
    exclude_modules: Optional[Union[list, str]] = None
    layers_to_transform: Optional[Union[int, list]] = None
    layers_pattern: Optional[Union[str, list]] = None
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    use_dora: bool = False
    lora_bias: bool = False
    task_type: Optional[str] = "CAUSAL_LM"
    inference_mode: bool = False
    base_model_name_or_path: Optional[str] = None
    revision: Optional[str] = None
    peft_type: str = "LORA"

    def __post_init__(self):
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)
        if isinstance(self.exclude_modules, (set, tuple)):
            self.exclude_modules = sorted(self.exclude_modules)
        self.check()

    # ---- checks ------------------------------------------------------------------------------------
    def check(self, source: str = "") -> None:
        """Refuse, in one sentence, what staticformers cannot honour (see the module docstring)."""

        def bad(message: str) -> AdapterConfigError:
            return _refuse(source, message)

        if str(self.peft_type).upper() != "LORA":
            raise bad(f"peft_type={self.peft_type!r} is not LoRA: staticformers loads and trains LoRA adapters only.")
        if self.task_type not in (None, "CAUSAL_LM"):
            raise bad(
                f'task_type={self.task_type!r}: these models are causal language models; use task_type="CAUSAL_LM".'
            )
        if not _count(self.r):
            raise bad(f"r={self.r!r} must be a positive integer (the adapter's rank, e.g. 8 or 16).")
        if not _positive_number(self.lora_alpha):
            raise bad(f"lora_alpha={self.lora_alpha!r} must be a positive number (the scale is lora_alpha / r).")
        if not (_number(self.lora_dropout) and 0 <= self.lora_dropout < 1):
            raise bad(f"lora_dropout={self.lora_dropout!r} must be a number in [0, 1).")
        if self.bias != "none":
            raise bad(
                f"bias={self.bias!r} trains the base layers' biases, which staticformers does not do: use "
                f'bias="none" (PEFT\'s default).'
            )
        if self.fan_in_fan_out:
            raise bad(
                "fan_in_fan_out=True is for GPT-2's Conv1D layers; these models' projections are nn.Linear: "
                "leave it False."
            )
        if self.use_dora:
            raise bad("use_dora=True (DoRA) is not supported: use plain LoRA (use_dora=False).")
        if self.lora_bias:
            raise bad("lora_bias=True (a bias on lora_B) is not supported: leave it False.")
        if self.modules_to_save:
            raise bad(
                f"modules_to_save={self.modules_to_save!r} trains whole copies of modules beside the adapter, "
                f"which staticformers does not do: leave it None (the adapter alone trains)."
            )
        if (
            self.init_lora_weights not in INITS
            or isinstance(self.init_lora_weights, int)
            and not isinstance(self.init_lora_weights, bool)
        ):
            raise bad(
                f"init_lora_weights={self.init_lora_weights!r} is not supported: use True (B zero, A Kaiming), "
                f'"gaussian" or False (initialisations that rewrite the base weights, such as PiSSA or '
                f"OLoRA, are not)."
            )
        if not isinstance(self.use_rslora, bool):
            raise bad(f"use_rslora={self.use_rslora!r} must be true or false.")
        _check_names(self.target_modules, "target_modules", bad)
        _check_names(self.exclude_modules, "exclude_modules", bad)
        layers = self.layers_to_transform
        if layers is not None and not (
            isinstance(layers, int)
            and not isinstance(layers, bool)
            and layers >= 0
            or isinstance(layers, list)
            and layers
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        ):
            raise bad(f"layers_to_transform={layers!r} must be a layer index or a non-empty list of them.")
        if self.layers_pattern not in (None, "", [], "layers", ["layers"]):
            raise bad(
                f"layers_pattern={self.layers_pattern!r}: these models' decoder layers are model.layers; "
                f'use "layers" or leave it None.'
            )
        for name, pattern, valid in (
            ("rank_pattern", self.rank_pattern, _count),
            ("alpha_pattern", self.alpha_pattern, _positive_number),
        ):
            if not isinstance(pattern, dict) or not all(isinstance(k, str) and valid(v) for k, v in pattern.items()):
                raise bad(
                    f"{name}={pattern!r} must map module names or patterns to "
                    f"{'positive integer ranks' if name == 'rank_pattern' else 'positive numbers'}."
                )
            for key in pattern:
                try:
                    re.compile(rf"(.*\.)?({key})$")
                except re.error as err:
                    raise bad(
                        f"{name} key {key!r} is not a regular expression ({err}): write a module name such as "
                        f'"q_proj" or a valid pattern.'
                    ) from None

    # ---- per module --------------------------------------------------------------------------------
    def rank_for(self, module_name: str) -> int:
        """The rank of the adapter on `module_name` (`rank_pattern` first, PEFT's rule)."""
        key = pattern_key(self.rank_pattern, module_name)
        return int(self.rank_pattern[key]) if key is not None else int(self.r)

    def alpha_for(self, module_name: str) -> float:
        key = pattern_key(self.alpha_pattern, module_name)
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def scaling_for(self, module_name: str) -> float:
        """`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA (PEFT's formulas)."""
        r, alpha = self.rank_for(module_name), self.alpha_for(module_name)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    # ---- adapter_config.json -----------------------------------------------------------------------
    def to_peft_dict(self) -> dict[str, Any]:
        """What PEFT writes to adapter_config.json for this adapter."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(
            fan_in_fan_out=False,
            layer_replication=None,
            loftq_config={},
            megatron_config=None,
            megatron_core="megatron.core",
            use_qalora=False,
            trainable_token_indices=None,
            target_parameters=None,
            auto_mapping=None,
        )
        if isinstance(out["target_modules"], list):
            out["target_modules"] = sorted(out["target_modules"])
        return out

    @classmethod
    def from_peft_dict(cls, data: dict, source: str = "adapter_config.json") -> "LoraConfig":
        """The config in PEFT's adapter_config.json (`source` names the file in refusals)."""
        known = {f.name for f in fields(cls)}
        unknown = {k: v for k, v in data.items() if k not in known and k not in _INERT_KEYS and _on(v)}
        if unknown:
            key = sorted(unknown)[0]
            raise _refuse(
                source,
                f"{key}={unknown[key]!r} is a PEFT feature staticformers does not support: use an "
                f"adapter without it (plain LoRA on the decoder's linear layers).",
            )
        kwargs = {k: v for k, v in data.items() if k in known}
        for k in ("rank_pattern", "alpha_pattern"):
            if kwargs.get(k) is None:
                kwargs.pop(k, None)
        try:
            return cls(**kwargs)
        except AdapterConfigError as err:
            raise _refuse(source, str(err)) from None

    def copy(self, **changes) -> "LoraConfig":
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(changes)
        return LoraConfig(**data)


def pattern_key(patterns: dict, module_name: str) -> Optional[str]:
    """The key of `patterns` matching `module_name` (PEFT's rule: the name ends with the pattern), or None."""
    import re

    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive_number(v) -> bool:
    return _number(v) and v > 0


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _on(value) -> bool:
    """Whether a field holds something other than its off value (None, False, 0, empty)."""
    return bool(value) if not isinstance(value, (int, float)) or isinstance(value, bool) else value != 0


def _check_names(value, what: str, bad) -> None:
    if value is None or isinstance(value, str) and value:
        return
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return
    raise bad(
        f'{what}={value!r} must be a list of module names (such as ["q_proj", "v_proj"]), a regular '
        f'expression, or "all-linear".'
    )


__all__ = ["LoraConfig", "AdapterConfigError", "DEFAULT_TARGETS", "ALL_LINEAR", "pattern_key"]
