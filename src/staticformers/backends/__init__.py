"""The device interface the engine and the Trainer call, and one backend per device kind.

`for_device(device)` returns the backend of a device's kind: `cpu/` (inductor tuned for the CPU: per-layer
regions, weight-streaming formulations, saved compiled functions), `cuda.py` (CUDA, XPU, MPS), `xla/`
(torch_xla on PJRT: TPU, Neuron's plugin, XLA's CPU device), `neuron.py` (Trainium/Inferentia), and
`base.Backend`, the generic answers, for any other kind. `devices.py` resolves
`device_map=` / `device=` values; `memory_check.py` refuses allocations the device cannot hold.

What a backend answers is listed in `base.py`. The engine reaches it through the interface declared on
its own side (`generation/device_interface.py`); a backend never imports `generation/` and keeps its
per-model state in its own `StepBuilder`.

May import: compilation, adapters, models, checkpoints, utils.
"""

from __future__ import annotations

import functools

import torch

from .base import Backend, StepBuilder, cuda_graphs, step_name


@functools.lru_cache(maxsize=None)
def _for_kind(kind: str) -> Backend:
    if kind == "cpu":
        from .cpu import CPUBackend

        return CPUBackend()
    if kind in ("cuda", "xpu", "mps"):
        from . import cuda

        return {"cuda": cuda.CUDABackend, "xpu": cuda.XPUBackend, "mps": cuda.MPSBackend}[kind]()
    if kind == "neuron":
        from .neuron import NeuronBackend

        return NeuronBackend()
    if kind == "xla":
        from .xla import XLABackend

        return XLABackend()
    return Backend()


def device_kind(device) -> str:
    """The kind of a device: `torch.device`, or a string such as "cpu", "cuda:1", "neuron"."""
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


def for_device(device) -> Backend:
    """The backend of a device (`torch.device`, or a string such as "cpu", "cuda:1", "neuron")."""
    return _for_kind(device_kind(device))


__all__ = ["Backend", "StepBuilder", "for_device", "device_kind", "step_name", "cuda_graphs"]
