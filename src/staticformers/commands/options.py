"""What several commands check the same way before they load anything: a `--backend` name, a `--device`
(in the command line's words: its flags, not the Python API's `device_map=`), what to install for
Neuron, and the `--threads` of the commands that run a model (set for the process before torch loads)."""

from __future__ import annotations

from typing import Optional


def check_backend(name: Optional[str]) -> None:
    """Refuse a `--backend` that torch.compile does not know, before the model loads or anything prints."""
    if name is None:
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if (
        name in ("neuron", "lazy") or name in known
    ):  # "neuron" registers itself when torch-neuronx loads; "lazy": XLA's tracing
        return
    common = [b for b in ("inductor", "aot_eager", "eager", "cudagraphs") if b in known]
    raise ValueError(
        f"--backend {name!r} is not a torch.compile backend here: use {', '.join(common)} "
        f"(or leave it out for the device's own)."
    )


def add_threads(parser) -> None:
    """`--threads N`: the CPU kernels' thread count (the commands that run a model)."""
    parser.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        metavar="N",
        help="CPU threads for the kernels (default: the CPUs this process may use, from its "
        "affinity and CPU quota; or $STATICFORMERS_NUM_THREADS; `staticformers doctor` shows it)",
    )


def thread_count(text: str) -> int:
    import argparse

    from ..utils.cpus import positive_count

    try:
        return positive_count(text, "--threads")
    except ValueError:  # argparse prints an ArgumentTypeError's own words after "argument --threads:"
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a thread count: give a whole number of at least 1, or "
            f"leave --threads out to use the CPUs this process may use."
        ) from None


def before_torch(args) -> None:
    """What the command line sets for the process before torch loads (it imports no torch itself): the
    `--threads` a command was given, for the CPU backend to apply, and OpenMP's short spin before sleeping unless the user
    chose a wait policy (`utils/cpus.py`)."""
    import os

    from ..utils.cpus import THREADS_ENV, prefer_bounded_spin

    if getattr(args, "threads", None) is not None:
        os.environ[THREADS_ENV] = str(args.threads)
    prefer_bounded_spin()


# what a host needs for the `neuron` device (docs/trainium.md says more)
NEURON_INSTALL = (
    "the neuron device is TorchNeuron's (Trn2/Trn3, Neuron SDK 2.33 or later): pip install "
    "'torch-neuronx==2.13.*' 'neuronx-cc==2.*' --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "into a venv, then `make demo VENV=that-venv` in this checkout, which keeps its torch (SKIP_TORCH=1 keeps "
    "any venv's torch); Inf2/Trn1's "
    'XLA-based torch-neuronx (2.9 and before) has no neuron device: use device_map="xla" there '
    "with PJRT_DEVICE=NEURON (docs/trainium.md, docs/xla.md)"
)

_MISSING = {  # kind -> (what is wrong, what else to do)
    "cuda": (
        "this PyTorch ({torch}) sees no CUDA GPU here",
        "run on a machine with an NVIDIA GPU and a CUDA build of PyTorch",
    ),
    "xla": (
        "torch_xla does not import with this PyTorch ({torch}) here, and it provides the xla device",
        "install torch-xla with the torch it pins, in an environment of its own (docs/xla.md)",
    ),
    "neuron": (
        "torch-neuronx is not installed here, and it provides the neuron device",
        "install it on a Trainium instance (staticformers doctor says which)",
    ),
    "xpu": ("this PyTorch ({torch}) sees no Intel GPU here", "run on a machine with one and PyTorch's XPU build"),
    "mps": ("this PyTorch ({torch}) has no Apple-silicon (MPS) device here", "run on Apple silicon with macOS 12.3+"),
}


def check_device(name: str) -> None:
    """Refuse a `--device` that is not on this machine, before anything loads, in one sentence naming the flag."""
    import torch

    from ..backends.devices import KINDS, DeviceUnavailableError, auto_device, resolve_device

    try:
        resolve_device(name)
    except DeviceUnavailableError:
        kind = name.split(":")[0].strip().lower()
        here = KINDS[kind].device_count() if kind in KINDS else 0
        if here:  # the kind is here, the index is not
            which = f"--device {kind}" if here == 1 else f"--device {kind}:0 to {kind}:{here - 1}"
            raise ValueError(f"--device {name}: this machine has {here} {kind} device(s): pass {which}.") from None
        why, fix = _MISSING.get(kind, ("it is not available here", "pick another"))
        raise ValueError(
            f"--device {name}: {why.format(torch=torch.__version__)}: leave --device out (auto picks "
            f"{auto_device()} here), or {fix}."
        ) from None
    except ValueError:
        raise ValueError(
            f"--device {name!r} is not a device: pass auto, neuron, xla, cuda, xpu, mps or cpu, optionally "
            f"with :N (cuda:1)."
        ) from None


__all__ = ["NEURON_INSTALL", "add_threads", "before_torch", "check_backend", "check_device", "thread_count"]
