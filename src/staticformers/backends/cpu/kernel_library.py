"""The CPU backend's C++ kernels as one library: `gemv.cpp`, `decode_attention.cpp` and `decode_layers.cpp`, after
the helpers they share (`bf16_rows.h`).

Why this exists: most of a kernel file's build is the compiler parsing PyTorch's headers, and built one by one the
three files took about three times as long as built as one text; an empty compile cache paid that on a model's first
step, in the middle of tracing its graphs. `LIBRARY` builds them once per process (then from inductor's disk cache),
and `build_ahead` starts that build in a thread when the backend makes a generation step under inductor, so the
compiler runs while its graphs are traced. `gemv.py`, `decode_attention.py` and `decode_layers.py` load their
kernels from it.
"""

from __future__ import annotations

import os
import threading

import torch

from .operators import NativeLibrary

HERE = os.path.dirname(os.path.abspath(__file__))
BF16_ROWS = os.path.join(HERE, "bf16_rows.h")  # bf16 row helpers that gemv.cpp and decode_layers.cpp share
GEMV = os.path.join(HERE, "gemv.cpp")
DECODE_ATTENTION = os.path.join(HERE, "decode_attention.cpp")
DECODE_LAYERS = os.path.join(HERE, "decode_layers.cpp")


def has_vector_isa() -> bool:
    """Whether ATen runs a vector instruction set here (AVX-512 or AVX2; not its scalar `DEFAULT`), which the kernels
    need: inductor then builds for one too."""
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


LIBRARY = NativeLibrary((BF16_ROWS, GEMV, DECODE_ATTENTION, DECODE_LAYERS), ready=has_vector_isa)


def probe_side_by_side() -> None:
    """Answer inductor's probe of each x86 vector instruction set this CPU advertises at once, one thread a set.

    Inductor probes each set by compiling a small library with its flags and loading it, one set after another
    (three compiles here: AVX-512 with VNNI, AVX-512, AVX2), before it builds anything; each answer is then kept for
    the process, so the pick that follows finds them ready. One thread a set: two threads probing one set at once
    raced and picked another set. Where inductor probes otherwise, this leaves it to do so."""
    try:
        from torch._inductor import cpu_vec_isa

        flags = cpu_vec_isa.x86_isa_checker()
        sets = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    except (ImportError, AttributeError):
        return
    threads = [threading.Thread(target=bool, args=(isa,), name=f"staticformers-probe-{isa}") for isa in sets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def build_ahead() -> None:
    """Start building the library in a thread, where it may be built here; a later first use waits for it. The
    vector instruction set is picked first, in this thread (its probes side by side): two threads probing at once
    picked different sets, so that the next process, picking alone, found neither the kernels nor the graphs under
    its build flags and compiled them all again."""
    if has_vector_isa():
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        probe_side_by_side()
        pick_vec_isa()  # remembered by inductor for the process
        LIBRARY.start()


__all__ = ["BF16_ROWS", "LIBRARY", "build_ahead", "has_vector_isa", "probe_side_by_side"]
