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
    "AutoModelForCausalLM": "staticformers.api.auto",
    "ModelForCausalLM": "staticformers.api.auto",
    "CausalLM": "staticformers.models.decoder",
    "CausalLMOutput": "staticformers.models.decoder",
    "AutoConfig": "staticformers.models.model_config",
    "ModelConfig": "staticformers.models.model_config",
    "resolve_device": "staticformers.backends.devices",
    "AutoTokenizer": "staticformers.tokenization.tokenizer",
    "TextStreamer": "staticformers.generation.streamers",
    "TextIteratorStreamer": "staticformers.generation.streamers",
    "GenerationConfig": "staticformers.generation.generation_config",
    "CompileConfig": "staticformers.generation.generation_config",
    "ShapePlan": "staticformers.generation.plan",
    "GenerationLoop": "staticformers.generation.loop",
    "GenerationRequest": "staticformers.generation.loop",
    "SamplingParams": "staticformers.generation.sampling",
    "pipeline": "staticformers.api.pipeline",
    "TrainingArguments": "staticformers.training.arguments",
    "Trainer": "staticformers.training.trainer",
    "DistributedConfig": "staticformers.distributed.distributed_config",
    "LoraConfig": "staticformers.adapters.lora_config",
    "QuantizationConfig": "staticformers.models.quantization",
    "TorchAoConfig": "staticformers.models.quantization",
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
