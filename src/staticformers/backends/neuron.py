"""AWS Trainium and Inferentia through torch-neuronx: the `neuron` compile backend, whole graphs, no dynamic shapes.

TorchNeuron (the `neuron` device with `torch.compile(backend="neuron")`) rejects `dynamic=True` and wants
`fullgraph=True`: every step here is compiled that way, one graph per declared shape. The c10d backend
`neuron` exists once `torch_neuronx` is imported.
"""

from __future__ import annotations

import importlib

import torch

from .base import Backend


class NeuronBackend(Backend):
    """What differs on Neuron (see `base.Backend` and the module docstring)."""

    name = kind = "neuron"
    precompile_by_default = True  # neuronx-cc compiles a graph for minutes

    def compile_one(self, fn, name: str, shape: tuple, settings, precompile: bool = False):
        if settings.dynamic:
            raise ValueError("Neuron compiles one graph per shape and rejects dynamic shapes: "
                             "drop CompileConfig(dynamic=True).")
        return super().compile_one(fn, name, shape, settings, precompile)

    def before_process_group(self, device: torch.device) -> None:
        importlib.import_module("torch_neuronx")  # registers the "neuron" c10d backend


__all__ = ["NeuronBackend"]
