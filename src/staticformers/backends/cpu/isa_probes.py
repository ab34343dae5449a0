"""Remembering inductor's CPU instruction-set probes across processes.

Why this exists: before inductor builds or loads any CPU kernel in a process, it checks every vector
instruction set the CPU advertises (AVX2, AVX-512 and its VNNI and BF16 extensions) by building a tiny
library once and then, in *every new process*, spawning a child Python that loads it (a library built
for instructions the machine cannot run would kill the process that loads it). That is several child
processes (BENCHMARKS.md has their cost), paid again by each `staticformers generate` and by every
warm-cache run, although the answer for one library on one machine never changes.

`remember_isa_probes()` wraps inductor's probe so that a successful load is recorded under the compile
cache (`isa-probes.json`), keyed by the library's path, size and modification time, this machine's CPU
and the Python that loaded it; a recorded library is not probed again. Anything not recorded (a failed
probe, a rebuilt library, another CPU sharing the cache folder) is probed exactly as inductor would.
A torch whose inductor has no separate probe step is left alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import tempfile
import threading
from typing import Callable

RECORD = "isa-probes.json"


@functools.lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
    """This machine's CPU as the probes see it: model name and feature flags (hashed)."""
    text = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            wanted = [line for line in f.read().splitlines() if line.startswith(("model name", "flags"))][:2]
        text += "\n".join(wanted)
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def probe_key(library: str) -> str | None:
    """What a recorded success is valid for, or None when the library is not there."""
    try:
        st = os.stat(library)
    except OSError:
        return None
    import torch

    return (
        f"{os.path.abspath(library)}|{st.st_size}|{st.st_mtime_ns}|{cpu_fingerprint()}|{sys.executable}"
        f"|{torch.__file__}"
    )


def read_record(path: str) -> set:
    """The recorded keys; an unreadable or malformed record counts as empty (it costs probes, no more)."""
    try:
        with open(path) as f:
            loaded = json.load(f).get("loaded", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {k for k in loaded if isinstance(k, str)} if isinstance(loaded, list) else set()


_WRITING = threading.Lock()  # probes answered in parallel threads of this process each add their key


def add_to_record(path: str, key: str) -> None:
    """Add `key` to the record atomically (another process writing at once may win; the loser re-probes once)."""
    with _WRITING:
        _add(path, key)


def _add(path: str, key: str) -> None:
    known = read_record(path)
    known.add(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".isa-probes-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"loaded": sorted(known)}, f, indent=0)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError:  # a read-only or full cache: probe every time, as inductor does
        pass


def remembering(probe: Callable, record_path: Callable[[], str]) -> Callable:
    """`probe(isa, library) -> bool`, answered from the record when it holds this library on this machine."""

    @functools.wraps(probe)
    def probe_load(isa, *args, **kwargs) -> bool:
        library = args[0] if args else kwargs.get("output_path")
        key = probe_key(library) if isinstance(library, str) else None
        path = record_path()
        if key is not None and key in read_record(path):
            return True
        ok = probe(isa, *args, **kwargs)
        if ok and key is not None:
            add_to_record(path, key)
        return ok

    probe_load.remembers_probes = True
    return probe_load


def remember_isa_probes(record_path: Callable[[], str]) -> bool:
    """Install the remembering probe on inductor (idempotent). Returns whether it is installed."""
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:  # pragma: no cover - a torch without inductor
        return False
    probe = getattr(VecISA, "_probe_load", None)
    if probe is None:  # pragma: no cover - an inductor that probes differently
        return False
    if not getattr(probe, "remembers_probes", False):
        VecISA._probe_load = remembering(probe, record_path)
    return True
