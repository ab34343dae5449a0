"""`staticformers doctor`: what the seed's device check prints (`True 4`), and more.

Nearly all of a plain `doctor`'s time is `import torch` (seconds, and far more on a busy machine or with a
CUDA build's libraries to map). On a host where no accelerator can be present (no NVIDIA, AMD or Neuron
device node, no torch-neuronx or torch_xla installed, a Linux host and a CPU build of torch), the answer
is known without it: the CPU alone, which `cpu_only_report` writes from `backends/devices.py`'s table
(tests/test_cli.py checks the two reports are equal). Anywhere else, or when torch is already imported
(tests, the demo), the devices are probed through torch as always.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

HELP = 'show the devices here, the one "auto" picks, and versions'
WIDTH = 100  # the hint's lines are wrapped at this width
# device nodes whose presence means an accelerator may be here (NVIDIA, AMD ROCm, Neuron)
ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/neuron0")
# kind -> (compile backend, torch.distributed backend): the table of backends/devices.py, read without torch
BACKENDS = {
    "neuron": ("neuron", "neuron"),
    "xla": ("openxla", "xla"),
    "cuda": ("inductor", "nccl"),
    "xpu": ("inductor", "xccl"),
    "mps": ("inductor", "gloo"),
    "cpu": ("inductor", "gloo"),
}


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from .. import __version__

    info = cpu_only_report() if may_skip_torch() else None
    if info is None:
        from ..backends.devices import describe

        info = describe()
    info = {"staticformers": __version__, **info}
    info["neuron_hint"] = neuron_hint(info)
    info["cpu_threads"] = cpu_threads()
    info["cpu_kernels"] = cpu_kernels()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(
        f"staticformers {info['staticformers']}  python {info['python']}  torch {info['torch']}  "
        f"torch-neuronx {info['torch_neuronx'] or 'not installed'}  "
        f"torch_xla {info['torch_xla'] or 'not installed'}"
        + (
            f" (PJRT device {info['pjrt_device']}, {info['devices']['xla']['count']} device(s))"
            if info["torch_xla"]
            else ""
        )
    )
    print(f"{'device':<8}{'available':<11}{'count':<7}{'compile':<10}{'c10d':<8}bf16")
    for name, d in info["devices"].items():
        print(
            f"{name:<8}{str(d['available']):<11}{d['count']:<7}{d['compile_backend']:<10}{d['dist_backend']:<8}"
            f"{'yes' if d['bf16'] else 'no'}"
        )
    neuron = info["devices"]["neuron"]
    print(f"torch.neuron.is_available(), torch.neuron.device_count(): {neuron['available']} {neuron['count']}")
    print(
        f'device_map="auto" -> {info["auto"]} (compile backend {info["auto_compile_backend"]}, '
        f"bf16 {'yes' if info['auto_bf16'] else 'no'})"
    )
    print(f"CPU threads: {info['cpu_threads']['reason']}; OpenMP wait: {info['cpu_threads']['wait']}")
    kernels = info["cpu_kernels"]
    print(f"CPU bf16 decode projections: {kernels['bf16_decode_why']}; weights: {kernels['weights']}")
    print(f"CPU bf16 decode layers: {kernels['decode_layers']}")
    if info["neuron_hint"]:
        print(
            textwrap.fill(
                info["neuron_hint"], WIDTH, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
            )
        )
    return 0


def may_skip_torch() -> bool:
    """Whether this host can have no device but the CPU, told without importing torch."""
    import importlib.metadata
    import importlib.util

    if "torch" in sys.modules or not sys.platform.startswith("linux"):  # macOS: MPS; elsewhere: ask torch
        return False
    if any(os.path.exists(node) for node in ACCELERATOR_NODES):
        return False
    if any(importlib.util.find_spec(name) is not None for name in ("torch_neuronx", "torch_xla")):
        return False
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False  # let the import say what is wrong
    return "+xpu" not in version  # an XPU build may see an Intel GPU


def cpu_only_report() -> dict:
    """`describe()`'s report for a host whose only device is the CPU (what `may_skip_torch` established)."""
    import importlib.metadata
    import platform

    devices = {
        name: {
            "available": name == "cpu",
            "count": int(name == "cpu"),
            "compile_backend": compile,
            "dist_backend": dist,
            "bf16": name == "cpu",
        }
        for name, (compile, dist) in BACKENDS.items()
    }
    return {
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "torch_neuronx": None,
        "torch_xla": None,
        "pjrt_device": None,
        "devices": devices,
        "auto": "cpu",
        "auto_compile_backend": BACKENDS["cpu"][0],
        "auto_bf16": True,
    }


def cpu_threads() -> dict:
    """The CPU kernels' thread count a model run here would use, what it comes from, and OpenMP's wait policy."""
    from ..utils.cpus import choose_threads, wait_policy

    choice = choose_threads()
    return {
        "threads": choice.threads,
        "source": choice.source,
        "usable": choice.usable,
        "affinity": choice.affinity,
        "quota": choice.quota,
        "cpu_count": choice.cpu_count,
        "reason": choice.reason(),
        "wait": wait_policy(),
    }


def cpu_kernels() -> dict:
    """The path the CPU's bf16 decode kernel takes here and where a model's weights go, told from the processor's
    flags and the environment without building the kernel (`utils/cpu_features.py`)."""
    from ..utils.cpu_features import bf16_decode_path, cpu_flags, decode_layers, huge_pages, thp_mode, vector_isa

    flags = cpu_flags()
    path, why = bf16_decode_path(flags)
    mode = thp_mode()
    return {
        "vector_isa": vector_isa(flags),
        "bf16_decode": path,
        "bf16_decode_why": why,
        "transparent_huge_pages": mode,
        "weights": huge_pages(mode),
        "decode_layers": decode_layers(flags),
    }


def neuron_hint(info: dict) -> str | None:
    """What to do for Neuron on this host, or None where the neuron device is here."""
    from .options import NEURON_INSTALL

    if info["devices"]["neuron"]["available"]:
        return None
    if info["torch_neuronx"] is None:
        return f"torch-neuronx is not installed: {NEURON_INSTALL}."
    return (
        f"torch-neuronx {info['torch_neuronx']} is installed but gives no available torch.neuron device (no "
        f"NeuronCore here, or an XLA-based release): {NEURON_INSTALL}."
    )
