"""Speculative decoding where users reach it: transformers' `generate()` arguments and vLLM's
`--speculative-config`, both turned into one `Speculator` for the generation loop.

- `generate(prompt_lookup_num_tokens=k)` (n-gram lookup in the row's own tokens; `max_matching_ngram_size`,
  transformers' name, is the longest n-gram tried, default 2 as there);
- `generate(assistant_model=draft, num_assistant_tokens=k)` (a draft model sharing the tokenizer; k
  defaults to 4: the verify step's width is fixed per plan, so transformers' adaptive schedule, which
  starts at 20, does not apply);
- `speculative_config` (vLLM's keys): `{"method": "ngram", "num_speculative_tokens": k,
  "prompt_lookup_max": n, "prompt_lookup_min": m}` or `{"model": PATH, "num_speculative_tokens": k}`.

Everything is checked here, before any device work, with one sentence per mistake.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..generation.speculative.draft import DraftModel
from ..generation.speculative.prompt_lookup import PromptLookup
from ..generation.speculative.step import Speculator

DEFAULT_ASSISTANT_TOKENS = 4
SPECULATIVE_ARGUMENTS = (
    "prompt_lookup_num_tokens",
    "assistant_model",
    "num_assistant_tokens",
    "max_matching_ngram_size",
)
_VLLM_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


def _draft_proposer(model, draft, k: int, parts: Callable) -> DraftModel:
    if not hasattr(draft, "config") or not hasattr(draft, "generate"):
        raise TypeError(
            f"assistant_model must be a staticformers model (AutoModelForCausalLM.from_pretrained), "
            f"not {type(draft).__name__}."
        )
    if draft is model:
        raise ValueError("assistant_model is the model itself: pass a smaller draft model that shares its tokenizer.")
    if draft.device != model.device:
        raise ValueError(
            f"assistant_model is on {draft.device} and the model on {model.device}: load both on one device."
        )
    proposer = DraftModel(*parts(draft), k)
    proposer.check(model)
    return proposer


def speculator_from_generate(model, kwargs: dict, parts: Callable) -> Optional[Speculator]:
    """The speculator `generate()`'s keyword arguments ask for (popped from `kwargs`), or None; `parts(draft)`
    gives a draft model's engine and compile settings."""
    lookup = kwargs.pop("prompt_lookup_num_tokens", None)
    draft = kwargs.pop("assistant_model", None)
    k = kwargs.pop("num_assistant_tokens", None)
    ngram = kwargs.pop("max_matching_ngram_size", None)
    if lookup is not None and draft is not None:
        raise ValueError("Pass prompt_lookup_num_tokens or assistant_model, not both.")
    if draft is not None:
        return Speculator(_draft_proposer(model, draft, DEFAULT_ASSISTANT_TOKENS if k is None else k, parts))
    if k is not None:
        raise ValueError("num_assistant_tokens needs an assistant_model (or use prompt_lookup_num_tokens).")
    if lookup is not None:
        if ngram is not None and (not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 1):
            raise ValueError(f"max_matching_ngram_size={ngram!r} must be a positive integer.")
        return Speculator(PromptLookup(lookup, max_ngram=2 if ngram is None else ngram))
    if ngram is not None:
        raise ValueError("max_matching_ngram_size needs prompt_lookup_num_tokens.")
    return None


def parse_speculative_config(raw: Any) -> dict:
    """vLLM's `--speculative-config` (a JSON object or a dict) checked: its keys and their values."""
    import json

    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--speculative-config is not valid JSON ({e.msg}): pass an object such as "
                '\'{"method": "ngram", "num_speculative_tokens": 4}\'.'
            ) from None
    if not isinstance(raw, dict):
        raise ValueError(
            '--speculative-config must be a JSON object, such as \'{"method": "ngram", "num_speculative_tokens": 4}\'.'
        )
    unknown = sorted(set(raw) - _VLLM_KEYS)
    if unknown:
        raise ValueError(
            f"--speculative-config has key(s) {', '.join(unknown)} that are not read here: use "
            f"{', '.join(sorted(_VLLM_KEYS))}."
        )
    method = raw.get("method", "draft_model" if "model" in raw else None)
    if method not in ("ngram", "draft_model"):
        raise ValueError(
            f'--speculative-config method {method!r} is not available: use "ngram" (prompt lookup) '
            f'or give "model": a draft model\'s path.'
        )
    if method == "draft_model" and not isinstance(raw.get("model"), str):
        raise ValueError('--speculative-config with a draft needs "model": the draft model\'s path.')
    k = raw.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"--speculative-config num_speculative_tokens={k!r} must be a positive integer.")
    out = {"method": method, "k": k, "model": raw.get("model")}
    if method == "ngram":
        out["max_ngram"] = raw.get("prompt_lookup_max", 3)
        out["min_ngram"] = raw.get("prompt_lookup_min", 1)
        PromptLookup(k, out["max_ngram"], out["min_ngram"])  # its checks
    return out


def speculator_from_config(model, config: dict, parts: Optional[Callable] = None, draft=None) -> Speculator:
    """The speculator a parsed `--speculative-config` describes; `draft` the loaded draft model for
    `"model"` (the caller loads it, as it loads the target) and `parts(draft)` its engine and settings."""
    if config["method"] == "ngram":
        return Speculator(PromptLookup(config["k"], config["max_ngram"], config["min_ngram"]))
    return Speculator(_draft_proposer(model, draft, config["k"], parts))


__all__ = ["SPECULATIVE_ARGUMENTS", "speculator_from_generate", "parse_speculative_config", "speculator_from_config"]
