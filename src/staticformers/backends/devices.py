"""Device kinds and the one resolver behind every `device_map=` and `device=` argument.

The seed's first limitation is that `device_map="auto"` silently loads on the CPU on Trainium. Here
`"auto"` looks for Neuron first, then an XLA accelerator, CUDA, XPU, MPS and the CPU, and logs which it
chose and why.
Each kind also knows what the rest of the library needs to ask of it: its `torch.compile` backend,
its `torch.distributed` backend, whether it does bf16, and how many devices it has.

Neuron is available when `torch_neuronx` imports and `torch.neuron.is_available()` is true. Tests
install a stand-in `torch.neuron` module; nothing here caches availability, so they can.

XLA (`torch_xla` on PJRT) is available when `torch_xla` imports; its PJRT device is `$PJRT_DEVICE`
(TPU, NEURON, CUDA, or CPU, which emulates a compile-per-shape device on the host). `"auto"` picks it
only when that device is an accelerator: the CPU plugin is chosen by name alone (`device_map="xla"`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import logging
from dataclasses import dataclass
from typing import Callable, Union

import torch

logger = logging.getLogger("staticformers")

DeviceLike = Union[str, int, torch.device, None]

# the order in which "auto" looks
AUTO_ORDER = ("neuron", "xla", "cuda", "xpu", "mps", "cpu")


@dataclass(frozen=True)
class DeviceKind:
    """What the library needs to know about one kind of device."""

    name: str
    compile_backend: str
    dist_backend: str
    what_to_do: str  # the second half of the sentence when it is missing

    def is_available(self) -> bool:
        return _AVAILABLE[self.name]()

    def device_count(self) -> int:
        return _COUNT[self.name]() if self.is_available() else 0

    def supports_bf16(self) -> bool:
        if not self.is_available():
            return False
        if self.name == "cuda":
            return bool(torch.cuda.is_bf16_supported())
        return True  # Neuron (every Trainium generation), XPU, MPS (torch>=2.3) and CPU


def _neuron_module():
    """`torch.neuron` when torch-neuronx is installed (or a test installed a stand-in), else None."""
    mod = getattr(torch, "neuron", None)
    if mod is not None:
        return mod
    try:
        importlib.import_module("torch_neuronx")
    except Exception:
        return None
    return getattr(torch, "neuron", None)


def _neuron_available() -> bool:
    mod = _neuron_module()
    try:
        return bool(mod is not None and mod.is_available())
    except Exception:
        return False


def _neuron_count() -> int:
    mod = _neuron_module()
    return int(mod.device_count()) if mod is not None else 0


def _xla_module():
    """`torch_xla` when it is installed and imports with this torch, else None (never raises)."""
    if importlib.util.find_spec("torch_xla") is None:
        return None
    try:
        from .xla import runtime
    except Exception:  # a torch_xla built for another torch
        return None
    return runtime.torch_xla_module()


def _xla_available() -> bool:
    return _xla_module() is not None


def _xla_count() -> int:
    from .xla import runtime

    return runtime.device_count()


def xla_accelerator() -> bool:
    """Whether torch_xla is here with a PJRT device that is not the CPU plugin (what "auto" may pick)."""
    if not _xla_available():
        return False
    from .xla import runtime

    return runtime.pjrt_device() not in (None, "CPU")


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def _mps_available() -> bool:
    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


_AVAILABLE: dict[str, Callable[[], bool]] = {
    "neuron": _neuron_available,
    "xla": _xla_available,
    "cuda": lambda: torch.cuda.is_available(),
    "xpu": _xpu_available,
    "mps": _mps_available,
    "cpu": lambda: True,
}
_COUNT: dict[str, Callable[[], int]] = {
    "neuron": _neuron_count,
    "xla": _xla_count,
    "cuda": lambda: torch.cuda.device_count(),
    "xpu": lambda: torch.xpu.device_count(),
    "mps": lambda: 1,
    "cpu": lambda: 1,
}

KINDS: dict[str, DeviceKind] = {
    "neuron": DeviceKind(
        "neuron",
        "neuron",
        "neuron",
        'install torch-neuronx on a Trainium/Inferentia instance, or use device_map="auto"',
    ),
    "xla": DeviceKind(
        "xla",
        "openxla",
        "xla",
        "install torch-xla with the torch it pins (the `xla` extra) and set PJRT_DEVICE (TPU, NEURON, or CPU to "
        'emulate one on the host), or use device_map="auto"',
    ),
    "cuda": DeviceKind(
        "cuda",
        "inductor",
        "nccl",
        'install a CUDA build of PyTorch on a machine with an NVIDIA GPU, or use device_map="auto"',
    ),
    "xpu": DeviceKind(
        "xpu",
        "inductor",
        "xccl",
        'install PyTorch with XPU support on a machine with an Intel GPU, or use device_map="auto"',
    ),
    "mps": DeviceKind("mps", "inductor", "gloo", 'run on Apple silicon with macOS 12.3+, or use device_map="auto"'),
    "cpu": DeviceKind("cpu", "inductor", "gloo", ""),
}


class DeviceUnavailableError(RuntimeError):
    """The requested device is not on this machine."""


def kind_of(device: torch.device | str) -> DeviceKind:
    """The DeviceKind of a torch device or device string (`"cuda:1"` -> cuda)."""
    name = device.split(":")[0].strip().lower() if isinstance(device, str) else torch.device(device).type
    if name not in KINDS:
        raise ValueError(f'Unknown device kind {name!r}: use one of {", ".join(KINDS)} or "auto".')
    return KINDS[name]


def auto_device() -> torch.device:
    """The first available of neuron, an XLA accelerator, cuda, xpu, mps, cpu; logged at INFO with the reason."""
    skipped = []
    for name in AUTO_ORDER:
        kind = KINDS[name]
        if xla_accelerator() if name == "xla" else kind.is_available():
            reason = "is available" if not skipped else f"is available ({', '.join(skipped)} not found)"
            logger.info('device_map="auto" chose %s: %s', name, reason)
            return torch.device(name, 0) if name not in ("cpu", "mps") else torch.device(name)
        skipped.append(name)
    raise AssertionError("the CPU is always available")  # pragma: no cover


def resolve_device(device: DeviceLike = "auto") -> torch.device:
    """Turn any `device_map`/`device` value into a torch.device that exists on this machine.

    Accepts "auto", "neuron", "neuron:N", "xla", "xla:N", "cuda", "cuda:N", "xpu", "mps", "cpu", a torch.device, an int
    (an index on the best accelerator here), or None (same as "auto"). A device that is not here is
    refused with one sentence saying what to do.
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return auto_device()
    if isinstance(device, bool):
        raise ValueError(
            f'device={device!r} is not a device: pass "auto", "cpu", "cuda", "neuron", an index or a torch.device.'
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f'Device index {device} is negative: pass an index from 0, or "cpu".')
        best = auto_device()
        if best.type == "cpu":
            raise DeviceUnavailableError(
                f'Device index {device} asks for an accelerator, and none is available here: pass device_map="cpu".'
            )
        device = torch.device(best.type, device)
    if isinstance(device, dict):
        raise ValueError(
            "device_map as a dict of module placements is not supported: staticformers places the whole model "
            'on one device (use DistributedConfig to split it across devices); pass "auto" or a device name.'
        )
    if isinstance(device, str):
        name = device.strip().lower()
        base = name.split(":")[0]
        if base not in KINDS:
            raise ValueError(
                f'Unknown device {device!r}: use one of "auto", "neuron", "xla", "cuda", "xpu", "mps", "cpu" '
                f'(optionally with ":N"), an int index or a torch.device.'
            )
        if base == "neuron":
            kind = KINDS["neuron"]
            if not kind.is_available():
                raise DeviceUnavailableError(f"Device {device!r} is not available here: {kind.what_to_do}.")
            index = int(name.split(":")[1]) if ":" in name else 0
            _check_index(device, kind, index)
            return torch.device("neuron", index)
        try:
            device = torch.device(name)
        except RuntimeError as err:
            raise ValueError(f"Device {device!r} is not a valid device string ({err}).") from None
    if not isinstance(device, torch.device):
        raise ValueError(f'device={device!r} is not a device: pass "auto", a device name, an index or a torch.device.')
    kind = KINDS.get(device.type)
    if kind is None:
        raise ValueError(f"Device type {device.type!r} is not supported: use neuron, xla, cuda, xpu, mps or cpu.")
    if not kind.is_available():
        raise DeviceUnavailableError(f"Device {str(device)!r} is not available here: {kind.what_to_do}.")
    if device.index is not None:
        _check_index(str(device), kind, device.index)
    elif device.type in ("cuda", "xpu", "xla"):
        device = torch.device(device.type, 0)
    if device.type == "xla":
        from .xla import runtime

        runtime.prepare()  # the persistent compilation cache must be set before the runtime starts
    return device


def _check_index(label: str, kind: DeviceKind, index: int) -> None:
    count = kind.device_count()
    if index >= count:
        raise DeviceUnavailableError(
            f"Device {label!r} is not here: this machine has {count} {kind.name} device(s), indices 0 to {count - 1}."
        )


def compile_backend_for(device: torch.device | str) -> str:
    """The torch.compile backend for a device: "neuron" on Neuron, "openxla" on XLA, "inductor" elsewhere."""
    return kind_of(device).compile_backend


def default_backend(device: torch.device | str) -> str:
    """`$STATICFORMERS_COMPILE_BACKEND` when set (e.g. "eager" to debug), else the device's own."""
    from ..compilation.compiler import BACKEND_ENV

    return os.environ.get(BACKEND_ENV) or compile_backend_for(device)


def dist_backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for a device: neuron, xla, nccl, xccl or gloo."""
    return kind_of(device).dist_backend


def supports_bf16(device: torch.device | str) -> bool:
    return kind_of(device).supports_bf16()


def synchronize(device: torch.device) -> None:
    """Wait for the device to finish queued work (used by timers and benchmarks): its backend's answer."""
    from . import for_device

    for_device(device).synchronize(device)


def describe() -> dict:
    """Everything `staticformers doctor` prints, as data."""
    import platform

    kinds = {}
    for name in AUTO_ORDER:
        kind = KINDS[name]
        available = kind.is_available()
        kinds[name] = {
            "available": available,
            "count": kind.device_count() if available else 0,
            "compile_backend": kind.compile_backend,
            "dist_backend": kind.dist_backend,
            "bf16": kind.supports_bf16() if available else False,
        }
    chosen = auto_device()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_neuronx": _neuron_version(),
        "torch_xla": _xla_version(),
        "pjrt_device": _pjrt_device(),
        "devices": kinds,
        "auto": str(chosen),
        "auto_compile_backend": compile_backend_for(chosen),
        "auto_bf16": supports_bf16(chosen),
    }


def _xla_version() -> str | None:
    mod = _xla_module()
    return getattr(mod, "__version__", None) if mod is not None else None


def _pjrt_device() -> str | None:
    if not _xla_available():
        return None
    from .xla import runtime

    return runtime.pjrt_device()


def _neuron_version() -> str | None:
    try:
        return importlib.import_module("torch_neuronx").__version__
    except Exception:
        return None
