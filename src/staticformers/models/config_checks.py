"""Type and range checks for the values of `config.json`, each refusal one sentence naming the key.

A config value of the wrong type or out of range does not fail where it is read: `"false"` (a
string) counts as true, `rms_norm_eps: -1` or `rope_theta: 0` give NaN logits, `eos_token_id: -1`
never stops generation, `hidden_size: true` builds a model of width 1. `config.ModelConfig.from_dict`
passes every value it uses through these checks before building anything, so such a file is
refused with the key, the value and what to write instead.

JSON booleans are Python `bool`s, a subclass of `int`: every integer check refuses them, and every
boolean check refuses everything but true, false and null. Numbers must be finite (Python's json
module reads `NaN`, `Infinity` and `1e999` as floats).
"""

from __future__ import annotations

import math
from typing import Any, Optional


class ConfigError(ValueError):
    """A config.json we cannot build a model from."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any, key: str, source: str) -> int:
    if not _is_int(value) or value <= 0:
        hint = " (write the number without quotes)" if isinstance(value, str) else ""
        raise ConfigError(f"{source}: {key}={_shown(value)} must be a positive integer{hint}.")
    return value


def optional_positive_int(value: Any, key: str, source: str) -> Optional[int]:
    return None if value is None else positive_int(value, key, source)


def non_negative_int(value: Any, key: str, source: str) -> int:
    if not _is_int(value) or value < 0:
        raise ConfigError(f"{source}: {key}={_shown(value)} must be an integer of 0 or more.")
    return value


def positive_number(value: Any, key: str, source: str, above: float = 0.0) -> float:
    """A finite int or float greater than `above`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (write the number without quotes)" if isinstance(value, str) else ""
        raise ConfigError(f"{source}: {key}={_shown(value)} must be a number{hint}.")
    if not math.isfinite(value) or value <= above:
        raise ConfigError(f"{source}: {key}={_shown(value)} must be a finite number above {above:g}.")
    return float(value)


def boolean(value: Any, key: str, source: str, default: bool = False) -> bool:
    """true / false (null: `default`); a string such as "false" is refused, not read as true."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key}={_shown(value)} must be true or false (JSON booleans, without quotes).")
    return value


def optional_boolean(value: Any, key: str, source: str) -> Optional[bool]:
    return None if value is None else boolean(value, key, source)


def string(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {key}={_shown(value)} must be a string.")
    return value


def token_ids(value: Any, key: str, source: str, vocab_size: int, allow_list: bool) -> Any:
    """null, a token id in [0, vocab_size), or (`allow_list`) a non-empty list of them."""
    if value is None:
        return None
    items = value if allow_list and isinstance(value, list) else [value]
    if not items or not all(_is_int(v) and 0 <= v < vocab_size for v in items):
        what = "a token id or a list of token ids" if allow_list else "a token id"
        raise ConfigError(
            f"{source}: {key}={_shown(value)} must be {what} from 0 to {vocab_size - 1} (the vocabulary), or null."
        )
    return value


def mapping(value: Any, key: str, source: str) -> dict:
    """null -> {}; a JSON object as it is; anything else is refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key}={_shown(value)} must be a JSON object (or null).")
    return value


def string_list(value: Any, key: str, source: str, allowed: tuple[str, ...], length: int) -> list:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{source}: {key} must be a list of strings, not {_shown(value)}.")
    if len(value) != length:
        raise ConfigError(f"{source}: {key} has {len(value)} entries for {length} layers.")
    bad = sorted({v for v in value if v not in allowed})
    if bad:
        raise ConfigError(
            f"{source}: {key} holds {', '.join(map(repr, bad))}: each entry must be one of "
            f"{', '.join(map(repr, allowed))}."
        )
    return value


# RoPE scaling parameters the decoder reads, and what each must be
_ROPE_NUMBERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)


def rope_parameters(params: dict, rope_type: str, source: str) -> None:
    """The numeric RoPE scaling parameters: finite and positive; llama3's frequency factors ordered."""
    for key in _ROPE_NUMBERS:
        if params.get(key) is not None:
            positive_number(params[key], f"rope scaling {key}", source)
    if params.get("original_max_position_embeddings") is not None:
        positive_int(
            params["original_max_position_embeddings"], "rope scaling original_max_position_embeddings", source
        )
    if "truncate" in params:
        boolean(params["truncate"], "rope scaling truncate", source, default=True)
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ConfigError(
            f"{source}: rope scaling 'llama3' needs high_freq_factor > low_freq_factor "
            f"(got {params['high_freq_factor']} and {params['low_freq_factor']})."
        )


__all__ = [
    "ConfigError",
    "positive_int",
    "optional_positive_int",
    "non_negative_int",
    "positive_number",
    "boolean",
    "optional_boolean",
    "string",
    "token_ids",
    "mapping",
    "string_list",
    "rope_parameters",
]
