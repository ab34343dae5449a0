"""The compiled training and evaluation functions, and the count of graphs they build.

`forward_loss(model, batch...)` runs the model with labels and returns the loss. With
`torch_compile=True` it is compiled with the device's backend (`fullgraph=True, dynamic=False`):
Dynamo captures forward and loss as one graph, AOTAutograd derives the backward graph, and
`loss.backward()` runs it; the optimizer step stays eager. The model object is never wrapped, so
its state dict keeps its names and the caller's model is the one that trains.

Every batch has the same shapes and dtypes and the token count (`num_items_in_batch`) is a 0-d
tensor, not a Python number, so nothing is specialised on values: a run builds exactly one
training graph and one evaluation graph. `CountingBackend` counts the graphs the backend is
handed (and the seconds spent compiling them) so tests and logs can prove it.
"""

from __future__ import annotations

import time
import types
from typing import Any, Callable, Optional

import torch


def forward_loss(model, input_ids, labels, position_ids, num_items_in_batch):
    """Loss of one batch: summed token losses divided by `num_items_in_batch` (a 0-d tensor)."""
    return model(input_ids=input_ids, labels=labels, position_ids=position_ids,
                 num_items_in_batch=num_items_in_batch).loss


def fresh_function(fn: Callable, name: str) -> Callable:
    """A copy of `fn` with its own code object: Dynamo caches graphs per code object, so each
    Trainer role gets its own cache (and its own recompile limit), never a neighbour's."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles and delegates to `backend`."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.graphs = 0
        self.compile_seconds = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        start = time.perf_counter()
        inner = lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
        compiled = inner(gm, example_inputs)
        self.compile_seconds += time.perf_counter() - start
        return compiled


class StepFunction:
    """`forward_loss` compiled (or not) for one role ("train" or "eval"), with its graph count."""

    def __init__(self, role: str, compile: bool, backend: Optional[str]):
        fn = fresh_function(forward_loss, f"forward_loss_{role}")
        if compile and backend == "inductor":
            try:  # the shared on-disk compile cache: a second process compiles nothing it compiled before
                from ..compile import enable_persistent_cache

                enable_persistent_cache()
            except ImportError:  # pragma: no cover
                pass
        self.role = role
        self.counter = CountingBackend(backend) if compile else None
        self.fn: Callable = torch.compile(fn, backend=self.counter, fullgraph=True, dynamic=False) if compile else fn

    @property
    def graphs(self) -> int:
        return self.counter.graphs if self.counter is not None else 0

    @property
    def compile_seconds(self) -> float:
        return self.counter.compile_seconds if self.counter is not None else 0.0

    def __call__(self, model, batch: dict, num_items_in_batch: torch.Tensor) -> torch.Tensor:
        return self.fn(model, batch["input_ids"], batch["labels"], batch.get("position_ids"), num_items_in_batch)


__all__ = ["forward_loss", "CountingBackend", "StepFunction"]
