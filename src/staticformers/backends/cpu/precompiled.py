"""Dynamo precompile artifacts: a compiled region saved whole, so a later process skips Dynamo's trace.

Why this exists: with inductor's on-disk caches warm, a new process still re-traces every graph with
Dynamo, builds and profiles its guards and looks up the cached kernels: most of a warm start
(BENCHMARKS.md). `torch.compile(...).aot_compile(...)` returns
the traced, compiled function with its guards as one object that `save_compiled_function` writes and
`AOTCompiledFunction.deserialize` reads back far faster than a trace, checked by its own guards when
called.

The artifact's name is a hash of everything the graph depends on that its guards might not check in
the same way: this package's source files, torch's and Python's versions, the function and its
compile settings, and a signature of the call's arguments (every tensor's shape, strides, dtype and
device; every module's type, plain attributes and parameters; other objects' plain attributes). A
stale or foreign artifact therefore has another name. One that loads but whose guards refuse the
call is deleted and the function compiles the usual way (`compiled.CPUCompiledFunction`).

Artifacts that no process has loaded for `STATICFORMERS_PRECOMPILED_MAX_AGE_DAYS` days (default 30;
0 keeps them forever) are deleted whenever a new one is saved: a load marks its artifact used, and
every upgrade or source edit of this package names all artifacts anew, so without this the folder
would only grow. Files a killed write left behind go too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import sys
import time
from typing import Any, Optional

import torch

from ...compilation import cache_safety

logger = logging.getLogger("staticformers")

FOLDER = "precompiled"
ENV = "STATICFORMERS_PRECOMPILE"
MAX_AGE_ENV = "STATICFORMERS_PRECOMPILED_MAX_AGE_DAYS"
DEFAULT_MAX_AGE_DAYS = 30.0
SUFFIX = ".bin"
LEFTOVER_SECONDS = 3600.0  # a write's temporary file older than this was abandoned


def enabled() -> bool:
    """Artifacts are used unless `STATICFORMERS_PRECOMPILE=0`."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no")


@functools.lru_cache(maxsize=1)
def package_hash() -> str:
    """A hash of this package's Python sources: any edit names every artifact anew."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


_PLAIN = (bool, int, float, str, type(None))
# plain attributes no region graph depends on: the caches a layer region takes ignore a layer's index,
# so one artifact serves every layer whichever layer made the first call (`staticformers compile` warms a
# decode step from its first layer, a prefill's last position from its last); were a graph to read one,
# Dynamo's guards would refuse the artifact for another value and the region would compile as usual
_UNREAD = frozenset({"layer_idx"})


def signature(obj: Any, depth: int = 0) -> Any:
    """What of `obj` a traced graph may depend on, as a hashable description (see the module docstring)."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), tuple(obj.stride()), str(obj.dtype), str(obj.device), obj.requires_grad)
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a config
        return ("C", repr(obj))
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(signature(o, depth) for o in obj))
    if isinstance(obj, dict):
        return ("D", tuple((signature(k, depth), signature(v, depth)) for k, v in obj.items()))
    if isinstance(obj, torch.nn.Module):
        parts = []
        for name, m in obj.named_modules():
            attrs = tuple(
                (k, signature(v, 2))
                for k, v in sorted(vars(m).items())
                if not k.startswith("_") and k not in _UNREAD and (isinstance(v, _PLAIN) or dataclasses.is_dataclass(v))
            )
            tensors = tuple(
                (k, signature(t)) for k, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None
            )
            parts.append((name, type(m).__qualname__, attrs, tensors))
        return ("M", tuple(parts))
    if depth < 2 and hasattr(obj, "__dict__"):
        return (
            "O",
            type(obj).__qualname__,
            tuple((k, signature(v, depth + 1)) for k, v in sorted(vars(obj).items()) if not k.startswith("_")),
        )
    return ("?", type(obj).__qualname__)


def usable(fn: Any, args: tuple) -> bool:
    """Whether a call may go through an artifact: no closure (its values would be baked in) and no forward
    or backward hooks on any module argument or globally (Dynamo does not guard their absence, so a
    loaded artifact would skip a hook added since; such calls trace as usual)."""
    from ...models.hooks import global_hooks, hooked

    if getattr(fn, "__closure__", None) or global_hooks(backward=True):
        return False
    return not any(hooked(m, backward=True) for arg in args if isinstance(arg, torch.nn.Module) for m in arg.modules())


def artifact_path(root: str, name: str, settings: Any, args: tuple) -> str:
    """Where the artifact of `name` compiled under `settings` for these arguments lives: the name hashes
    what the artifact's guards do not all check (sources, versions, this CPU, thread count, inductor's
    global config) with the settings and the arguments' signature."""
    from torch._inductor import config as inductor_config

    from .isa_probes import cpu_fingerprint

    h = hashlib.sha256()
    for part in (
        package_hash(),
        torch.__version__,
        sys.version,
        cpu_fingerprint(),
        str(torch.get_num_threads()),
        repr(sorted(inductor_config.save_config_portable().items())),
        name,
        repr(settings),
        repr(signature(args)),
        str(torch.is_grad_enabled()),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return os.path.join(root, FOLDER, f"{name}-{h.hexdigest()[:32]}{SUFFIX}")


def load(path: str) -> Optional[Any]:
    """The artifact at `path` as a callable, or None (absent, or unreadable: then it is deleted)."""
    if not os.path.exists(path) or not cache_safety.trusted_file(path):  # a pickle: only if no one else wrote it
        return None
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        with open(path, "rb") as f:
            fn = AOTCompiledFunction.deserialize(f.read())
    except Exception as exc:  # a truncated file, another torch: compile instead
        logger.info("precompiled artifact %s could not be loaded (%s); compiling", path, exc)
        discard(path)
        return None
    try:
        os.utime(path)  # used now: `prune` keeps it
    except OSError:
        pass
    return fn


def save(fn: Any, path: str) -> None:
    """Write `fn` (an `aot_compile` result) to `path`; a failure only costs the next process a compile."""
    try:
        cache_safety.make_private_folder(os.path.dirname(path))
        fn.save_compiled_function(path)
        cache_safety.drop_group_write(path)
    except Exception as exc:
        logger.info("precompiled artifact %s not saved (%s)", path, exc)
        discard(path)
        return
    prune(os.path.dirname(path))


def max_age_days() -> float:
    """`STATICFORMERS_PRECOMPILED_MAX_AGE_DAYS`, or the default when unset or not a number (said once)."""
    raw = os.environ.get(MAX_AGE_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_AGE_DAYS
    try:
        days = float(raw)
        if days < 0 or days != days:
            raise ValueError
        return days
    except ValueError:
        cache_safety.warn_once(
            f"{MAX_AGE_ENV}={raw!r} is not a number of days >= 0; using "
            f"{DEFAULT_MAX_AGE_DAYS:g} (set it to a number of days, or 0 to keep artifacts forever)."
        )
        return DEFAULT_MAX_AGE_DAYS


def prune(folder: str, now: Optional[float] = None) -> list[str]:
    """Delete the artifacts in `folder` unused for longer than `max_age_days()` and the temporary files of
    writes abandoned over an hour ago; returns the names deleted. Another process may be reading a
    file: it holds its bytes already (`load` reads it whole), and a missing artifact is compiled."""
    days = max_age_days()
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if entry.name.endswith(SUFFIX):
            stale = days > 0 and age > days * 86400
        else:
            stale = entry.name.startswith("tmp") and age > LEFTOVER_SECONDS
        if stale:
            discard(entry.path)
            removed.append(entry.name)
    if removed:
        logger.info("pruned %d unused precompiled file(s) from %s", len(removed), folder)
    return removed


def discard(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
