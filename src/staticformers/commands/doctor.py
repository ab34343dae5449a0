"""`staticformers doctor`: what the seed's device check prints (`True 4`), and more."""

from __future__ import annotations

import json

HELP = "show the devices here, the one \"auto\" picks, and versions"


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from ..backends.devices import describe

    info = describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"python {info['python']}  torch {info['torch']}  torch-neuronx {info['torch_neuronx'] or 'not installed'}")
    print(f"{'device':<8}{'available':<11}{'count':<7}{'compile':<10}{'c10d':<8}bf16")
    for name, d in info["devices"].items():
        print(f"{name:<8}{str(d['available']):<11}{d['count']:<7}{d['compile_backend']:<10}{d['dist_backend']:<8}"
              f"{'yes' if d['bf16'] else 'no'}")
    neuron = info["devices"]["neuron"]
    print(f"torch.neuron.is_available(), torch.neuron.device_count(): {neuron['available']} {neuron['count']}")
    print(f"device_map=\"auto\" -> {info['auto']} (compile backend {info['auto_compile_backend']}, "
          f"bf16 {'yes' if info['auto_bf16'] else 'no'})")
    return 0
