"""AWS Trainium and Inferentia: which road a Neuron host takes, and TorchNeuron's rules.

Two generations of torch-neuronx exist, and they reach staticformers by different device kinds:

- **The XLA releases** (torch-neuronx up to 2.9, Inf2 and Trn1): torch_xla with Neuron's PJRT plugin.
  There is no `neuron` device; a model goes to `device_map="xla"` with `PJRT_DEVICE=NEURON`, and the
  `xla` backend (`backends/xla/`) runs it: `torch.compile(backend="openxla")` per declared shape,
  compilations counted by torch_xla's metrics (which Neuron's plugin feeds), the persistent cache under
  `$STATICFORMERS_CACHE/xla` (the Neuron compiler's own under `$STATICFORMERS_CACHE/neuron`).
- **TorchNeuron** (the `neuron` device, `torch.compile(backend="neuron")`, Trn2/Trn3): this module. Every
  step is compiled with `fullgraph=True` (a graph break raises instead of splitting the step) and never
  `dynamic=True`, which TorchNeuron rejects; a `CompileConfig(dynamic=True)` is refused before
  anything compiles. Compilations are Dynamo's graphs handed to the backend (`GraphCounter`), and, when
  torch_neuronx exposes its Dynamo backend's metrics (`neuron_dynamo_backend.get_dynamo_metrics()`),
  the compilations it reports during each call are recorded beside them (`NeuronFunction`).

The c10d backend `neuron` exists once `torch_neuronx` is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..compilation.compiler import CompiledFunction, compile_function
from .base import Backend


def neuron_compilations() -> Optional[int]:
    """Compilations torch_neuronx's Dynamo backend reports so far (its metrics' counts whose name says
    compile), or None when this torch_neuronx exposes no such metrics."""
    try:
        backend = importlib.import_module("torch_neuronx.neuron_dynamo_backend")
        metrics = backend.get_dynamo_metrics()
    except Exception:
        return None
    if dataclasses.is_dataclass(metrics):
        metrics = dataclasses.asdict(metrics)
    if not isinstance(metrics, dict):
        return None
    counts = [
        v for k, v in metrics.items() if "compil" in str(k).lower() and isinstance(v, int) and not isinstance(v, bool)
    ]
    return sum(counts) if counts else None


@dataclass
class NeuronFunction(CompiledFunction):
    """A compiled function that also records the compilations torch_neuronx's metrics report in its calls."""

    neuron_compiles: int = 0
    _metrics: bool = field(default=True, repr=False)

    def _counted(self, call, args):
        before = neuron_compilations() if self._metrics else None
        out = call(*args)
        if before is None:
            self._metrics = False  # not exposed here: stop asking
        else:
            self.neuron_compiles += (neuron_compilations() or before) - before
        return out

    def first_call(self, args: tuple):
        return self._counted(self.compiled, args)

    def run(self, args: tuple, checked: bool):
        return self._counted(self.compiled, args) if self._metrics else self.compiled(*args)


class NeuronBackend(Backend):
    """What differs on TorchNeuron (see `base.Backend` and the module docstring)."""

    name = kind = "neuron"
    precompile_by_default = True  # neuronx-cc compiles a graph for minutes

    def compile_one(self, fn, name: str, shape: tuple, settings, precompile: bool = False):
        if settings.dynamic:
            raise ValueError(
                "Neuron compiles one graph per shape and rejects dynamic shapes: drop CompileConfig(dynamic=True)."
            )
        self.before_compile(settings)
        # fullgraph=True whatever the settings say: a graph break must raise, never split a step
        return compile_function(
            fn,
            name,
            shape,
            settings.backend,
            settings.mode,
            dict(settings.options),
            fullgraph=True,
            dynamic=False,
            function_class=NeuronFunction,
        )

    def before_process_group(self, device: torch.device) -> None:
        importlib.import_module("torch_neuronx")  # registers the "neuron" c10d backend


__all__ = ["NeuronBackend", "NeuronFunction", "neuron_compilations"]
