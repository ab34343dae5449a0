"""Inductor's cache folder (`TORCHINDUCTOR_CACHE_DIR`) checked before anything imports Dynamo.

Why this exists: importing `torch._dynamo` creates inductor's cache folder, and raises (`NotADirectoryError`,
`PermissionError`) when it cannot, so an unusable `TORCHINDUCTOR_CACHE_DIR` (a path under a file, a
read-only folder) would end a compiled run before its first graph. `usable()` is called before every
compile: where the folder can neither be created nor written, it warns once, naming the folder and why,
and points inductor at a fresh private temporary folder for this process, so compiled runs go on without
a persistent cache. (Eager runs never import Dynamo: `backends/cpu/gemv.py` marks its constant without
it.)
"""

from __future__ import annotations

import os
import tempfile
import threading
import warnings
from typing import Optional

ENV = "TORCHINDUCTOR_CACHE_DIR"
_CHECKED: set = set()  # the folders found usable (or replaced) in this process
_LOCK = threading.Lock()


def _configured() -> str:
    value = os.environ.get(ENV)
    if value:
        return value
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # imports no Dynamo

    return default_cache_dir()


def problem(folder: str) -> Optional[str]:
    """Why inductor cannot keep its cache in `folder` (the OS's reason), or None when it can."""
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            return "it is not writable"
    except OSError as err:
        return err.strerror or type(err).__name__
    return None


def usable() -> str:
    """Inductor's cache folder, made usable: the configured one, or (once it is found unusable, with one
    warning) a fresh temporary folder that this process alone uses."""
    folder = _configured()
    if folder in _CHECKED:
        return folder
    with _LOCK:
        if folder in _CHECKED:
            return folder
        why = problem(folder)
        if why is not None:
            replacement = tempfile.mkdtemp(prefix="staticformers-inductor-")
            warnings.warn(
                f"staticformers: inductor's cache folder {folder!r} ({ENV}) cannot be used ({why}); this "
                f"process compiles without a persistent cache, in {replacement}. Set {ENV} to a writable "
                f"folder to keep compiled graphs between runs.",
                RuntimeWarning,
                stacklevel=2,
            )
            os.environ[ENV] = replacement
            _CHECKED.add(replacement)
            folder = replacement
        _CHECKED.add(folder)
    return folder


__all__ = ["ENV", "problem", "usable"]
