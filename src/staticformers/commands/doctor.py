"""`staticformers doctor`: what the seed's device check prints (`True 4`), and more."""

from __future__ import annotations

import json

HELP = "show the devices here, the one \"auto\" picks, and versions"


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from .. import __version__
    from ..backends.devices import describe

    info = {"staticformers": __version__, **describe()}
    info["neuron_hint"] = neuron_hint(info)
    info["cpu_threads"] = cpu_threads()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"staticformers {info['staticformers']}  python {info['python']}  torch {info['torch']}  "
          f"torch-neuronx {info['torch_neuronx'] or 'not installed'}  "
          f"torch_xla {info['torch_xla'] or 'not installed'}"
          + (f" (PJRT device {info['pjrt_device']}, {info['devices']['xla']['count']} device(s))" if info["torch_xla"] else ""))
    print(f"{'device':<8}{'available':<11}{'count':<7}{'compile':<10}{'c10d':<8}bf16")
    for name, d in info["devices"].items():
        print(f"{name:<8}{str(d['available']):<11}{d['count']:<7}{d['compile_backend']:<10}{d['dist_backend']:<8}"
              f"{'yes' if d['bf16'] else 'no'}")
    neuron = info["devices"]["neuron"]
    print(f"torch.neuron.is_available(), torch.neuron.device_count(): {neuron['available']} {neuron['count']}")
    print(f"device_map=\"auto\" -> {info['auto']} (compile backend {info['auto_compile_backend']}, "
          f"bf16 {'yes' if info['auto_bf16'] else 'no'})")
    print(f"CPU threads: {info['cpu_threads']['reason']}; OpenMP wait: {info['cpu_threads']['wait']}")
    if info["neuron_hint"]:
        print(info["neuron_hint"])
    return 0


def cpu_threads() -> dict:
    """The CPU kernels' thread count a model run here would use, what it comes from, and OpenMP's wait policy."""
    from ..utils.cpus import choose_threads, wait_policy

    choice = choose_threads()
    return {"threads": choice.threads, "source": choice.source, "usable": choice.usable, "affinity": choice.affinity,
            "quota": choice.quota, "cpu_count": choice.cpu_count, "reason": choice.reason(), "wait": wait_policy()}


def neuron_hint(info: dict) -> str | None:
    """What to do for Neuron on this host, or None where the neuron device is here."""
    from .options import NEURON_INSTALL

    if info["devices"]["neuron"]["available"]:
        return None
    if info["torch_neuronx"] is None:
        return f"torch-neuronx is not installed: {NEURON_INSTALL}."
    return (f"torch-neuronx {info['torch_neuronx']} is installed but gives no available torch.neuron device (no "
            f"NeuronCore here, or an XLA-based release): {NEURON_INSTALL}.")
