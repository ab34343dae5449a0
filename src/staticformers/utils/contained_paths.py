"""File names read from a checkpoint, tokenizer or DCP folder must resolve inside that folder.

A shard index can name `../outside/evil.safetensors` or `/etc/passwd`, a folder can hold a symbolic
link out of itself, and DCP metadata names the files it reads: opened as given, any of these reads
(and echoes, in an error) a file the folder's author chose anywhere on the machine. Every loader
asks `file_in_folder` for such a path: the name must be relative, stay inside the folder once `..`
and every symbolic link are resolved, and the refusal says which name and folder without reading
the file it points to.

One exception, because the Hugging Face cache is built that way: a folder inside a Hub cache
snapshot (`.../models--org--name/snapshots/<revision>/`) holds symbolic links into the repo's own
`blobs/`, so there the repo folder (`models--org--name`) is the boundary.
"""

from __future__ import annotations

import os
from typing import Union


class OutsideFolderError(ValueError):
    """A file name from a file that points outside the folder it belongs to."""


def check_name(name: object, what: str) -> str:
    """`name` as a relative path that cannot climb out of its folder (no absolute path, no `..`)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise OutsideFolderError(f"{what} names {name!r}, which is not a file name: restore the file from its source.")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or os.path.splitdrive(name)[0] or ".." in parts:
        raise OutsideFolderError(
            f"{what} names {name!r}, a path outside its folder: files must be named relative "
            f"to the folder, without '..' (restore the file from its source)."
        )
    return name


def boundary(folder: Union[str, os.PathLike]) -> str:
    """The real path everything read from `folder` must stay in (its Hub repo folder for a cache snapshot)."""
    absolute = os.path.abspath(os.fspath(folder))
    head, tail = os.path.split(absolute)
    # .../models--org--name/snapshots/<revision>[/subfolder...]
    while tail:
        parent, name = os.path.split(head)
        if name == "snapshots" and os.path.isdir(os.path.join(parent, "blobs")):
            return os.path.realpath(parent)
        head, tail = parent, name
    return os.path.realpath(absolute)


def is_inside(path: str, root: str) -> bool:
    real = os.path.realpath(path)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def file_in_folder(folder: Union[str, os.PathLike], name: object, what: str) -> str:
    """The path of `name` in `folder`, refused (`OutsideFolderError`) when it resolves outside it.

    `what` says where the name came from ("model.safetensors.index.json of /ckpt"), for the sentence.
    The path returned is the joined one (not resolved), so messages keep the folder's spelling.
    """
    path = os.path.join(os.fspath(folder), check_name(name, what))
    if not is_inside(path, boundary(folder)):
        raise OutsideFolderError(
            f"{what} names {name!r}, which {'is a symbolic link that ' if os.path.islink(path) else ''}resolves "
            f"outside {os.fspath(folder)}: it was not opened; put the file itself inside the folder."
        )
    return path


__all__ = ["OutsideFolderError", "file_in_folder", "check_name", "boundary", "is_inside"]
