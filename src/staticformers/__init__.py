"""staticformers: Hugging Face causal language models on accelerators that compile one graph per shape.

The public API uses transformers' names, so the seed's snippets run with only the import changed:

    from staticformers import AutoModelForCausalLM, AutoTokenizer, pipeline

Names are imported lazily: `import staticformers` stays cheap (the CLI's `doctor` starts fast), and
each submodule is loaded the first time one of its names is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "AutoModelForCausalLM": "staticformers.auto",
    "ModelForCausalLM": "staticformers.auto",
    "CausalLM": "staticformers.modeling",
    "CausalLMOutput": "staticformers.modeling",
    "AutoConfig": "staticformers.config",
    "ModelConfig": "staticformers.config",
    "resolve_device": "staticformers.devices",
    "AutoTokenizer": "staticformers.tokenizer",
    "TextStreamer": "staticformers.generation.streamers",
    "TextIteratorStreamer": "staticformers.generation.streamers",
    "GenerationConfig": "staticformers.generation.config",
    "CompileConfig": "staticformers.generation.config",
    "ShapePlan": "staticformers.generation.plan",
    "GenerationLoop": "staticformers.generation.loop",
    "GenerationRequest": "staticformers.generation.loop",
    "SamplingParams": "staticformers.generation.sampling",
    "pipeline": "staticformers.generation.pipeline",
    "TrainingArguments": "staticformers.training.arguments",
    "Trainer": "staticformers.training.trainer",
    "DistributedConfig": "staticformers.distributed.config",
    "LoraConfig": "staticformers.adapter_config",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'staticformers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
