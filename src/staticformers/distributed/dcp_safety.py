"""Reading a `torch.distributed.checkpoint` folder without running code from it.

PyTorch's `FileSystemReader.read_metadata` calls `pickle.load` on `.metadata`, and its default load
planner reads every non-tensor value (an optimizer's `lr`, `betas`, ...) with
`torch.load(weights_only=False)`: a checkpoint folder from someone else could run any command by
giving an object a `__reduce__` (`os.system`, `open`, ...). This module closes both:

- `SafeFileSystemReader.read_metadata` unpickles `.metadata` with `MetadataUnpickler`, which admits
  only the classes DCP's metadata is made of (`Metadata`, `TensorStorageMetadata`,
  `ChunkStorageMetadata`, `BytesStorageMetadata`, `TensorProperties`, `MetadataIndex`,
  `StorageMeta`, `_StorageInfo`, `torch.Size`, torch dtypes / layouts / memory formats, a path) and
  plain containers; any other global is refused before it is looked up. The result is then checked:
  every storage file it names must resolve inside the folder (`utils/contained_paths.py`), with non-negative
  integer offsets and lengths.
- `SafeLoadPlanner.load_bytes` reads non-tensor values with `torch.load(weights_only=True)` (plain
  Python values and tensors only); tensors are read that way by PyTorch already.

Every refusal is one sentence naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..utils.contained_paths import OutsideFolderError, file_in_folder

METADATA_FILE = ".metadata"

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to the layout
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(ValueError):
    """A DCP folder whose metadata or values hold something other than plain data."""


class MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only the globals DCP metadata needs (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):  # torch.float32, torch.strided
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")


def read_metadata_file(path: str) -> Metadata:
    """The `Metadata` in `path`, unpickled with `MetadataUnpickler`; anything else is refused."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        TypeError,
        ValueError,
        IndexError,
        KeyError,
        ImportError,
    ) as err:
        raise UnsafeCheckpointError(
            f"{path} is not plain torch.distributed.checkpoint metadata ({err}): it was refused without running "
            f"anything; restore the checkpoint from a source you trust."
        ) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{path} holds a {type(metadata).__name__}, not DCP metadata: restore the checkpoint."
        )
    return metadata


def check_storage(metadata: Metadata, folder: str, path: str) -> None:
    """Every storage entry names a file inside `folder`, at non-negative integer offsets."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{path} has no storage table: restore the checkpoint.")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        try:
            file_in_folder(folder, name, path)
        except OutsideFolderError as err:
            raise UnsafeCheckpointError(str(err)) from None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise UnsafeCheckpointError(
                f"{path} gives {getattr(index, 'fqn', index)!r} an invalid offset or length: restore the checkpoint."
            )
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"{path} stores {getattr(index, 'fqn', index)!r} through transforms "
                f"({info.transform_descriptors}) that staticformers does not read."
            )


def _inside(folder, name: str) -> str:
    try:
        return file_in_folder(os.fspath(folder), name, os.fspath(folder))
    except OutsideFolderError as err:
        raise UnsafeCheckpointError(str(err)) from None


def check_checkpoint_folder(folder: str) -> Metadata:
    """Read and check `folder/.metadata` as `SafeFileSystemReader` will (call before `dcp.load`, which
    wraps a reader's refusal in an AssertionError of its own)."""
    path = _inside(folder, METADATA_FILE)
    metadata = read_metadata_file(path)
    check_storage(metadata, os.fspath(folder), path)
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata goes through `MetadataUnpickler` and `check_storage`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        folder = os.fspath(self.path)
        path = _inside(folder, METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        metadata = read_metadata_file(path)
        check_storage(metadata, folder, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that reads non-tensor values with `torch.load(weights_only=True)`
    (the parent's `load_bytes` with only that call changed)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as err:
            raise UnsafeCheckpointError(
                f"The value {read_item.dest_index.fqn!r} in the DCP checkpoint is not plain data "
                f"({type(err).__name__}): it was refused without running anything; restore the checkpoint."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "MetadataUnpickler",
    "read_metadata_file",
    "check_storage",
    "check_checkpoint_folder",
    "UnsafeCheckpointError",
]
