"""Which compile-cache files may be unpickled: only those no other user could have written.

Dynamo's precompiled artifacts (`$STATICFORMERS_CACHE/precompiled/*.bin`) and inductor's on-disk
caches are pickles: loading one runs whatever code it holds. They are safe to load only when nobody
but this user can have put them there. So before a load, the artifact and the folders above it up to
the cache root must be owned by this user and not writable by group or others, and the artifact
must not be a symbolic link. Anything else is not loaded (the function compiles as usual, which
loses nothing but time) and a warning says once, in one sentence, which folder or file is at fault
and how to fix it. The folders staticformers creates are private (0700) and the artifacts it writes
are not group- or world-writable, so a cache it made itself always passes.

On systems without POSIX owners (Windows) there is nothing to compare and everything passes.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from typing import Optional

logger = logging.getLogger("staticformers")

CACHE_ENV = "STATICFORMERS_CACHE"


def problem(path: str, is_folder: bool) -> Optional[str]:
    """Why `path` may hold files another user wrote (one sentence), or None when it is private to us."""
    if not hasattr(os, "getuid"):
        return None
    try:
        st = os.lstat(path) if not is_folder else os.stat(path)
    except FileNotFoundError:
        return None
    kind = "cache folder" if is_folder else "cache file"
    if not is_folder and stat.S_ISLNK(st.st_mode):
        return (
            f"The {kind} {path} is a symbolic link, so it may hold another user's code: it is not unpickled; "
            f"delete it (it is rebuilt)."
        )
    if st.st_uid != os.getuid():
        return (
            f"The {kind} {path} belongs to another user (uid {st.st_uid}), so it may hold their code: its "
            f"compiled artifacts are not unpickled; set {CACHE_ENV} to a folder of your own."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        fix = f"run `chmod go-w {path}`" + ("" if is_folder else " or delete it")
        return (
            f"The {kind} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), so it may hold "
            f"their code: its compiled artifacts are not unpickled; {fix}, or set {CACHE_ENV} to a private folder."
        )
    return None


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """Log `message` as a warning the first time it is said in this process (the caches' warnings)."""
    logger.warning(message)


def trusted_folder(folder: str) -> bool:
    """Whether `folder` is private to this user; says why not once."""
    why = problem(os.path.abspath(folder), is_folder=True)
    if why:
        warn_once(why)
    return why is None


def trusted_file(path: str, folders_up: int = 2) -> bool:
    """Whether the file at `path` and the `folders_up` folders holding it (the artifact folder and the
    cache root) are private to this user, so it may be unpickled; says why not once."""
    path = os.path.abspath(path)
    why = problem(path, is_folder=False)
    folder = os.path.dirname(path)
    for _ in range(folders_up):
        if why:
            break
        why = problem(folder, is_folder=True)
        folder = os.path.dirname(folder)
    if why:
        warn_once(why)
    return why is None


def make_private_folder(folder: str) -> None:
    """Create `folder` (and its parents) readable and writable by this user only (0700 for those created)."""
    os.makedirs(folder, mode=0o700, exist_ok=True)


def drop_group_write(path: str) -> None:
    """Take group and others' write permission off a file this process wrote (a umask of 002 grants it)."""
    try:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(path, mode & ~(stat.S_IWGRP | stat.S_IWOTH))
    except OSError:
        pass


__all__ = ["trusted_file", "trusted_folder", "problem", "make_private_folder", "drop_group_write", "warn_once"]
