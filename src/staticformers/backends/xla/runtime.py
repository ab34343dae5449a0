"""torch_xla's runtime as the rest of the backend needs it: the import, the PJRT device and its count, the
persistent compilation cache, the sync that cuts a graph, and XLA's own counters.

Why a module of its own: torch_xla is imported only here (and only when asked), so that a torch without a
matching torch_xla never pays for it and never sees it fail. Everything that reads torch_xla's metrics
reads them through `counters()`, so a compilation has one meaning in the whole library: what XLA's
`UncachedCompile` counter says.

The persistent cache (`xr.initialize_cache`) must be set before the PJRT runtime starts: `prepare()`
does it the first time a device is resolved, under `$STATICFORMERS_CACHE/xla`, unless the user pointed
`$XLA_PERSISTENT_CACHE_PATH` elsewhere; a second process then loads every graph the first compiled
(`PersistentCacheHit` grows, `UncachedCompile` counts a compile-or-load either way). XLA's CPU plugin
(torch_xla 2.9) writes its executables there but cannot load them back ("Deserializing serialized
executable not supported": `PersistentCacheDeserializeFailure`), so on the CPU every process compiles;
TPU and Neuron's plugin load them.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger("staticformers")

CACHE_ENV = "XLA_PERSISTENT_CACHE_PATH"  # the user's own choice wins over ours
_prepared: Optional[str] = None


def torch_xla_module():
    """`torch_xla`, imported (raises ImportError when it is missing or built for another torch)."""
    return importlib.import_module("torch_xla")


def pjrt_device() -> Optional[str]:
    """The PJRT device type torch_xla runs on ("CPU", "TPU", "NEURON", "CUDA"), or None when none is set."""
    import torch_xla.runtime as xr

    try:
        return xr.device_type()
    except Exception:
        return os.environ.get("PJRT_DEVICE")


def device_count() -> int:
    """Devices this process can address on the PJRT device."""
    import torch_xla.runtime as xr

    try:
        return int(xr.global_runtime_device_count())
    except Exception:  # a runtime that cannot start here
        return 0


def cache_path() -> str:
    from ...compilation.compiler import cache_root

    return os.environ.get(CACHE_ENV) or os.path.join(cache_root(), "xla")


def prepare() -> Optional[str]:
    """Point XLA's persistent compilation cache at `cache_path()` before the runtime starts (idempotent).
    Returns the folder, or None when the runtime had already started without it (logged once)."""
    global _prepared
    if _prepared is not None:
        return _prepared
    import torch_xla.runtime as xr

    from ...compilation import cache_safety

    path = cache_path()
    cache_safety.make_private_folder(path)
    try:
        xr.initialize_cache(path, readonly=False)
    except Exception as err:  # the runtime started first (someone touched the device before us)
        logger.info("XLA's persistent compilation cache is not set (%s): graphs compile in every process", err)
        _prepared = ""
        return None
    _prepared = path
    return path


def sync(wait: bool = False) -> None:
    """Cut the graph here: run what is queued on the XLA devices as one graph (compiled once per distinct
    graph); `wait`: until the device has finished."""
    import torch_xla

    torch_xla.sync()
    if wait:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()


@dataclass(frozen=True)
class Counters:
    """XLA's own counts at one moment (see `counters()`); subtract two to count what happened between."""

    uncached_compiles: int
    cached_compiles: int
    persistent_hits: int
    persistent_found_unloadable: int  # in the persistent cache, but this PJRT plugin cannot load it (the CPU's)
    compile_seconds: float
    transfers_from_device: int  # D2H transfers (each `tolist()`, `item()`, `cpu()`)
    transfers_to_device: int
    executions: int

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(*(a - b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple:
        return (
            self.uncached_compiles,
            self.cached_compiles,
            self.persistent_hits,
            self.persistent_found_unloadable,
            self.compile_seconds,
            self.transfers_from_device,
            self.transfers_to_device,
            self.executions,
        )


def _metric(met, name: str) -> tuple[int, float]:
    data = met.metric_data(name)
    return (int(data[0]), float(data[1])) if data else (0, 0.0)


def counters() -> Counters:
    """torch_xla's counters now: `UncachedCompile`, `CachedCompile`, `PersistentCacheHit`, `CompileTime`
    (seconds), the transfer metrics and `ExecuteTime`'s count."""
    import torch_xla.debug.metrics as met

    def counter(name):
        return int(met.counter_value(name) or 0)

    compiles, compile_ns = _metric(met, "CompileTime")
    from_device, _ = _metric(met, "TransferFromDeviceTime")
    to_device, _ = _metric(met, "TransferToDeviceTime")
    executions, _ = _metric(met, "ExecuteTime")
    return Counters(
        counter("UncachedCompile"),
        counter("CachedCompile"),
        counter("PersistentCacheHit"),
        counter("PersistentCacheDeserializeFailure"),
        compile_ns / 1e9,
        from_device,
        to_device,
        executions,
    )


__all__ = ["Counters", "counters", "prepare", "sync", "pjrt_device", "device_count", "torch_xla_module", "cache_path"]
