"""PyTorch/XLA on PJRT (`device_map="xla"`): TPU, Neuron's PJRT plugin, or XLA's CPU device, which runs
on any host as a compile-per-shape device of its own.

How a step compiles here, and why. Two roads lead from a PyTorch function to an XLA executable:

- **`torch.compile(backend="openxla")`** (the default): Dynamo captures the step once per declared shape
  (`fullgraph=True`, never `dynamic=True`), AOT autograd lowers it, and torch_xla compiles the graph
  with XLA and keeps the executable; every later call replays it without running the model's Python.
  It is the road TorchNeuron's `"neuron"` backend takes, so a graph break or a shape outside the plan
  fails here as it would there.
- **lazy tracing** (`CompileConfig(backend="lazy")`): the step runs as plain PyTorch on XLA tensors,
  which record a graph; `torch_xla.sync()` cuts it, and XLA compiles each graph it has not seen (by
  hash). Every call re-runs the model's Python to rebuild the graph.

Both give the same tokens and both compile once per shape. Measured on a tiny decoder
(bench/generate.py --device xla, BENCHMARKS.md), the lazy road pays the model's Python on every decode
step to rebuild and hash the graph, where openxla replays the executable; openxla is the default. Lazy
tracing stays as the fallback for a step Dynamo cannot capture whole.

What is counted. A compilation is what XLA's `UncachedCompile` counter says (`runtime.counters()`):
each compiled function records the XLA compilations that happened inside its calls (`XLAFunction`),
and those records are its graphs in `compile_stats()`, the plan check (a second compilation for one
shape is a violation: raised in strict mode, warned otherwise) and the server's
`staticformers:graphs_compiled_total`.

What crosses to the host. Each loop step ends with `flush()`: what is queued (the prefill's cache
insert, sampling, penalty counts) runs as one graph, then only the chosen ids (and logprobs when asked)
are read. Random draws for sampling are made by the rows' CPU generators and sent to the device
(`host_generators`): a draw traced on the device would be a new graph every step.

The persistent compilation cache lives under `$STATICFORMERS_CACHE/xla` (`runtime.prepare`), set when
the device is first resolved, before the runtime starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...compilation.compiler import CompiledFunction, GraphRecord, compile_function, shape_violation
from ..base import Backend
from . import runtime

LAZY = "lazy"


@dataclass
class XLAFunction(CompiledFunction):
    """A compiled function whose graphs are XLA's own compilations during its calls (`UncachedCompile`);
    `sync_after`: cut the graph after each call (lazy tracing); `limit`: the graphs its shape may have."""

    xla_records: list = field(default_factory=list)
    sync_after: bool = False
    limit: Optional[int] = 1

    def _counted(self, call, args):
        before = runtime.counters()
        start = time.perf_counter()
        out = call(*args)
        if self.sync_after:
            runtime.sync()
        after = runtime.counters()
        new = after.uncached_compiles - before.uncached_compiles
        if new:
            if self.xla_records and self.limit is not None and len(self.xla_records) + new > self.limit:
                shape_violation(
                    f"{self.name} compiled {new} more XLA graph(s) after its first call, although its plan "
                    f"declares {self.limit} for shape {self.shape}: something outside the plan reached it."
                )
            seconds = (after.compile_seconds - before.compile_seconds) or (time.perf_counter() - start)
            loaded = after.persistent_hits - before.persistent_hits >= new
            self.xla_records.extend(GraphRecord(self.name, [], seconds / new, loaded) for _ in range(new))
        return out

    def first_call(self, args: tuple):
        return self._counted(self.compiled, args)

    def run(self, args: tuple, checked: bool):
        return self._counted(self.compiled, args)

    @property
    def records(self) -> list:
        return list(self.xla_records)


def _lazy(fn):
    """Run `fn` as it is on XLA tensors: the graph is traced, and cut by `runtime.sync()` after it."""
    return fn


class XLABackend(Backend):
    """What differs on XLA (see `base.Backend` and the module docstring)."""

    name = kind = "xla"
    precompile_by_default = True  # XLA compiles each new graph when it first runs: the server warms its plan first
    host_generators = True  # sampling draws come from CPU generators (a device draw is a new graph per step)
    trains_where_loaded = True  # a model loaded with device_map="xla" trains there
    torch_load_maps = False  # "don't know how to restore data location ... xla:0": checkpoints load on the host

    def compile_defaults(self, compile_backend: str) -> dict:
        return {}

    def before_compile(self, settings) -> None:
        runtime.prepare()

    def compile_one(self, fn, name: str, shape: tuple, settings, precompile: bool = False) -> CompiledFunction:
        if settings.dynamic:
            raise ValueError("XLA compiles one graph per shape: drop CompileConfig(dynamic=True).")
        self.before_compile(settings)
        if settings.backend == LAZY:
            return XLAFunction(
                name=name,
                shape=tuple(shape),
                backend=LAZY,
                fn=fn,
                compiled=_lazy(fn),
                code=None,
                xla_records=[],
                sync_after=True,
                limit=1,
            )
        compiled = compile_function(
            fn,
            name,
            shape,
            settings.backend,
            settings.mode,
            dict(settings.options),
            fullgraph=True,
            dynamic=False,
            function_class=XLAFunction,
            xla_records=[],
            sync_after=False,
            limit=1,
        )
        return compiled

    def flush(self, device: torch.device) -> None:
        runtime.sync()

    def synchronize(self, device: torch.device) -> None:
        runtime.sync(wait=True)

    def available_memory(self, device: torch.device) -> Optional[int]:
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(device)
            return int(info["bytes_limit"]) - int(info["bytes_used"])
        except Exception:  # the CPU plugin keeps no such account: the host's memory is what there is
            from ..base import host_available_memory

            return host_available_memory() if runtime.pjrt_device() == "CPU" else None

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        import torch_xla.core.xla_model as xm

        seed = int(xm.get_rng_state(device))  # an unsigned 64-bit value: kept as two 32-bit halves
        return torch.tensor([seed & 0xFFFFFFFF, seed >> 32], dtype=torch.int64)

    def set_rng_state(self, device: torch.device, state: torch.Tensor) -> None:
        import torch_xla.core.xla_model as xm

        low, high = (int(v) for v in state.view(-1)[:2])
        xm.set_rng_state(low | (high << 32), device)

    def before_process_group(self, device: torch.device) -> None:
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" c10d backend


__all__ = ["XLABackend", "XLAFunction", "LAZY"]
