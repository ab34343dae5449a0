"""PyTorch's `HuggingFaceStorageReader`, reading each rank's slices with plain reads (no memory map).

`torch.distributed.checkpoint` plans which slice of which tensor each rank needs (its DTensor
shards, in any layout); the stock reader then takes them through `safetensors.safe_open`, whose
memory map keeps every touched page of the file in the process's RSS while it is open. This reader
keeps the plan and replaces only the reading: a row range in the shard's dtype is read with
`readinto` straight into the shard (the project's `safetensors_io`, see its docstring); any other
slice is read in row chunks of at most 16 MiB, narrowed and copied (converting the dtype). A rank's
peak stays near its own shards.

A mixture of experts' checkpoint holds one tensor per expert while the model holds them stacked
(`checkpoints/names.py`). Given the checkpoint's layout, the reader describes each stacked parameter to
DCP as one tensor whose chunks are the per-expert files' tensors (expert e's gate rows at offset
`[e, 0, 0]`, its up rows at `[e, I, 0]`, ...), so DCP plans the stacked DTensor's shards as it plans
any other, and a rank reads only the rows of the experts it holds. A part of a fused tensor (Phi-3's
`qkv_proj` holding q, k and v) is described as its own parameter's one chunk, read from the fused
tensor's rows: each rank reads only its heads of each part.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.futures import Future

from ..backends import for_device
from ..checkpoints.names import Piece, by_file, target_shapes
from ..checkpoints.safetensors_io import DTYPES, SafetensorsFile


CHUNK_BYTES = 16 * 2**20  # the most a slice read holds beside its shard


def _readinto(f: SafetensorsFile, name: str, byte_offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes at `byte_offset` of tensor `name`'s data."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    f._f.seek(f._data_start + f.tensors[name]["data_offsets"][0] + byte_offset)
    got = 0
    while got < len(view):
        more = f._f.readinto(view[got:])
        if not more:
            raise f._bad(f"tensor {name!r} is cut short")
        got += more


def read_slice(f: SafetensorsFile, name: str, offsets: list, lengths: list, target: torch.Tensor) -> None:
    """Copy tensor `name`[offsets : offsets + lengths] into `target` (same shape), reading only those rows.

    A row range read in the target's dtype goes straight into it; otherwise rows are read in chunks of
    at most CHUNK_BYTES, narrowed on the other dimensions and copied (converting the dtype).
    """
    info = f.tensors[name]
    shape = [int(d) for d in info["shape"]]
    dtype = DTYPES[info["dtype"]]
    if not shape:
        target.copy_(f.read(name))
        return
    row_elems = 1
    for d in shape[1:]:
        row_elems *= d
    row_bytes = row_elems * dtype.itemsize
    start, count = offsets[0], lengths[0]
    whole_rows = all(o == 0 and n == d for o, n, d in zip(offsets[1:], lengths[1:], shape[1:]))
    if whole_rows and target.dtype == dtype and for_device(target.device).hosts_memory and target.is_contiguous():
        _readinto(f, name, start * row_bytes, target)
        return
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    for first in range(0, count, step):
        n = min(step, count - first)
        buf = torch.empty([n, *shape[1:]], dtype=dtype)
        _readinto(f, name, (start + first) * row_bytes, buf)
        piece = buf
        for dim in range(1, len(offsets)):
            piece = piece.narrow(dim, offsets[dim], lengths[dim])
        target.narrow(0, first, n).copy_(piece)


class _OnlyTheseFiles:
    """The file system DCP lists: the checkpoint's own shards (its index decides), not every
    `*.safetensors` in the folder (a stale shard or a `consolidated.safetensors` would join in)."""

    def __init__(self, fs, files: list[str]):
        self._fs, self._files = fs, [os.path.abspath(f) for f in files]

    def ls(self, path) -> list[str]:
        return list(self._files)

    def __getattr__(self, name):
        return getattr(self._fs, name)


class SlicedSafetensorsReader(HuggingFaceStorageReader):
    """`HuggingFaceStorageReader` with plain, row-ranged reads (see the module docstring).

    `files`: the checkpoint's shards (`loading.weight_files`); None reads every safetensors file of `path`.
    `layout`: the files' names -> the pieces of the model's parameters (`loading.checkpoint_layout`); the
    pieces of a stacked parameter become chunks of it (see the module docstring).
    """

    def __init__(self, path: str, files: Optional[list[str]] = None, layout: Optional[dict[str, Piece]] = None):
        super().__init__(path)
        if files is not None:
            self.fs = _OnlyTheseFiles(self.fs, files)
        self.layout = layout or {}
        # (parameter, chunk offsets) -> (the file's name, one expert's tensor): on every rank (DCP may read
        # the metadata on one rank only)
        self._file_name = {
            (p.target, tuple(p.offsets)): (p.hub, not p.whole, (p.source_rows or (0,))[0], p.transposed)
            for p in self.layout.values()
            if p.target != p.hub or not p.whole or p.transposed
        }

    def read_metadata(self) -> Metadata:
        metadata = super().read_metadata()
        if not self._file_name:
            return metadata
        tensors, storage = metadata.state_dict_metadata, metadata.storage_data
        shapes = target_shapes(self.layout)
        for hub, pieces in by_file(self.layout).items():
            if hub not in tensors or all(p.target == hub and p.whole and not p.transposed for p in pieces):
                continue
            entry = tensors.pop(hub)
            info = storage.pop(MetadataIndex(fqn=hub, offset=[0] * len(pieces[0].file_shape)))
            for piece in pieces:
                stacked = not piece.whole
                offsets = list(piece.offsets)
                sizes = [1, *piece.shape] if stacked else list(piece.target_shape)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                if piece.target not in tensors:
                    tensors[piece.target] = TensorStorageMetadata(
                        properties=entry.properties, size=torch.Size(shapes[piece.target]), chunks=[]
                    )
                tensors[piece.target].chunks.append(chunk)
                storage[MetadataIndex(fqn=piece.target, offset=offsets)] = _HFStorageInfo(
                    relative_path=info.relative_path, shape=torch.Size(sizes), dtype=info.dtype
                )
        return metadata

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for file_name, requests in per_file.items():
            with SafetensorsFile(file_name) as f:
                for req in requests:
                    target = planner.resolve_tensor(req).detach()
                    if list(target.size()) != list(req.lengths):
                        raise AssertionError(
                            f"{req.storage_index.fqn}: slice {list(req.lengths)} does not fit "
                            f"the shard {list(target.size())}"
                        )
                    index = req.storage_index
                    name, stacked, first_row, transposed = self._file_name.get(
                        (index.fqn, tuple(index.offset)), (index.fqn, False, 0, False)
                    )
                    offsets, lengths, into = list(req.storage_offsets), list(req.lengths), target
                    if stacked:  # one expert's tensor: the chunk's leading dim of 1 is not in the file
                        offsets, lengths, into = offsets[1:], lengths[1:], target[0]
                    offsets[0] += first_row  # a part of a fused tensor: its rows in the file
                    if transposed:  # the file holds the parameter with its last two dims swapped (gpt-oss)
                        offsets[-2:], lengths[-2:], into = offsets[:-3:-1], lengths[:-3:-1], into.transpose(-1, -2)
                    read_slice(f, name, offsets, lengths, into)
                    planner.commit_tensor(req, target)
        done: Future = Future()
        done.set_result(None)
        return done


__all__ = ["SlicedSafetensorsReader", "read_slice"]
