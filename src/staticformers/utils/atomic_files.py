"""Writing files so that a process killed at any moment leaves the old version or the new one.

A file is written under a temporary name in the same folder, flushed to disk, then renamed over the
old one (`os.replace`, atomic on POSIX), and the folder is flushed so the rename itself survives a
power cut. Temporary names start with a dot and end in `.tmp-<pid>`, so they are never mistaken
for the real file and a leftover of a killed writer is recognisable.
"""

from __future__ import annotations

import os
from typing import Callable

TMP_MARK = ".tmp-"


def temp_path(path: str) -> str:
    """Where `path` is written before it is renamed into place."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TMP_MARK}{os.getpid()}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """Flush every file under `path`, then the folders."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes the content to a temporary path; it then replaces `path` in one rename."""
    tmp = temp_path(path)
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_text_atomic(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_atomic(path, write)


__all__ = ["write_atomic", "write_text_atomic", "temp_path", "is_temp_name", "fsync_file", "fsync_dir", "fsync_tree"]
