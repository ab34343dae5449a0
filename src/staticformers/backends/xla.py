"""torch_xla devices (PJRT: TPU, Neuron's plugin, the CPU): the generic whole-graph steps, and a server that
compiles its plan before traffic by default, since XLA compiles each new graph when it first runs.
"""

from __future__ import annotations

from .base import Backend


class XLABackend(Backend):
    """What differs on XLA (see `base.Backend` and the module docstring)."""

    name = kind = "xla"
    precompile_by_default = True


__all__ = ["XLABackend"]
