"""GenerationConfig and CompileConfig, with transformers' names.

`generation_config.json` from a checkpoint supplies defaults; keyword arguments to `generate()`
override them for one call. Unknown keys in the file are kept, so a save round-trips them.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field, fields
from typing import Optional, Union

GENERATION_CONFIG_NAME = "generation_config.json"


@dataclass
class GenerationConfig:
    max_new_tokens: Optional[int] = None
    max_length: Optional[int] = None
    min_new_tokens: Optional[int] = None
    do_sample: bool = False
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, list, None] = None
    pad_token_id: Optional[int] = None
    cache_implementation: Optional[str] = None
    disable_compile: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> "GenerationConfig":
        known = {f.name for f in fields(cls)} - {"extra"}
        out = cls(**{k: v for k, v in raw.items() if k in known})
        out.extra = {k: copy.deepcopy(v) for k, v in raw.items() if k not in known and k != "transformers_version"}
        return out

    @classmethod
    def from_json_file(cls, path: str) -> "GenerationConfig":
        from ..checkpoints.json_files import read_json_object

        raw = read_json_object(path, "fix or delete it")
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out = {k: v for k, v in out.items() if v is not None and not (k == "disable_compile" and not v)}
        out.update(copy.deepcopy(self.extra))
        return out

    def update(self, **kwargs) -> dict:
        """Set the known keys; return the ones this config does not know."""
        known = {f.name for f in fields(self)} - {"extra"}
        rest = {}
        for k, v in kwargs.items():
            if k in known:
                setattr(self, k, v)
            else:
                rest[k] = v
        return rest

    def copy(self) -> "GenerationConfig":
        return copy.deepcopy(self)

    def save_pretrained(self, directory: str) -> None:
        from ..utils.atomic_files import write_text_atomic  # one rename: a kill leaves the old file or the new

        os.makedirs(directory, exist_ok=True)
        write_text_atomic(os.path.join(directory, GENERATION_CONFIG_NAME), json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass
class CompileConfig:
    """How generate() compiles its prefill and decode functions (transformers' name).

    backend None means the device's own ("neuron" on Neuron, "inductor" elsewhere). `regional` (ours,
    not transformers') chooses the layout of each shape's graphs: True compiles the embedding, one
    decoder layer (shared by every layer) and the head as separate functions, False the whole model as
    one graph, None (default) the device backend's choice: regions on the CPU (`backends/cpu/regions.py`),
    whole graphs elsewhere (`compilation/steps.py`).
    Regions need weights as graph inputs and no forward hooks: with weight freezing, tensor parallel or
    hooks set, a shape is one whole-model graph whatever `regional` says. `fast_decode` (ours) lets the
    device's backend pick the formulation measured fastest per shape (on the CPU under inductor:
    weight-streaming reductions, oneDNN GEMMs); False keeps the modules' own computation everywhere.
    """

    backend: Optional[str] = None
    mode: Optional[str] = None
    fullgraph: bool = True
    dynamic: bool = False
    options: Optional[dict] = None
    regional: Optional[bool] = None
    fast_decode: bool = True


def load_generation_config(path: str, **hub) -> Optional[GenerationConfig]:
    """A checkpoint's generation_config.json as a GenerationConfig, or None when it has none."""
    from ..checkpoints.hub import resolve_file

    gen_file = resolve_file(path, GENERATION_CONFIG_NAME, required=False, **hub)
    return GenerationConfig.from_json_file(gen_file) if gen_file is not None else None
