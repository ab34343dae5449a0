"""The `neuron` backend's rules, checked without a NeuronCore: every step compiles with fullgraph=True
(a graph break raises), dynamic=True is refused before anything compiles, and torch_neuronx's Dynamo
metrics, when a torch_neuronx exposes them, are recorded per compiled function."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from staticformers.backends.neuron import NeuronBackend, neuron_compilations
from staticformers.generation.engine import CompileSettings


def with_a_break(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def test_fullgraph_is_forced_and_dynamic_refused():
    backend = NeuronBackend()
    loose = CompileSettings(backend="eager", fullgraph=False)
    compiled = backend.compile_one(with_a_break, "neuron_break", (3,), loose)
    with pytest.raises(Exception, match="graph_break|graph break"):
        compiled(torch.ones(3))
    with pytest.raises(ValueError, match=r"rejects dynamic shapes: drop CompileConfig\(dynamic=True\)"):
        backend.compile_one(lambda x: x, "neuron_dyn", (3,), CompileSettings(backend="eager", dynamic=True))


def test_torch_neuronx_metrics_are_recorded_when_present(monkeypatch):
    assert neuron_compilations() is None  # no torch_neuronx here
    metrics = {"num_compilations": 0, "cache_hits": 5, "compile_failed": False}
    fake = types.SimpleNamespace(get_dynamo_metrics=lambda: dict(metrics))
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.SimpleNamespace(neuron_dynamo_backend=fake))
    monkeypatch.setitem(sys.modules, "torch_neuronx.neuron_dynamo_backend", fake)

    def fake_neuron_compiler(gm, example_inputs):  # counts as torch_neuronx's backend would
        metrics["num_compilations"] += 1
        return gm.forward

    compiled = NeuronBackend().compile_one(
        lambda x: x + 1, "neuron_metrics", (2,), CompileSettings(backend=fake_neuron_compiler)
    )
    compiled(torch.ones(2))
    compiled(torch.ones(2))
    assert compiled.neuron_compiles == 1 and compiled.graphs == 1
