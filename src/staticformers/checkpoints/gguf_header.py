"""A GGUF file's header read in one pass over its bytes: the metadata as Python values, and each tensor's name, ggml
type, dimensions and data offset.

Why by hand: the `gguf` package's `GGUFReader` makes a numpy memory-map view for every part of every metadata field.
For SmolLM2-135M's vocabulary (49,152 tokens and 48,900 merges) that took 3.7-4.1 s of a 4.5 s load (BENCHMARKS.md,
"A GGUF header in one pass"). The header is a handful of little-endian fields (ggml's GGUF specification: magic,
version, counts, then key, type and value per field, then name, dimensions, type and offset per tensor). Here each
string is one slice of the memory-mapped file, decoded, and each array of numbers one `numpy.frombuffer`.
`gguf_file.py` keeps the package for what it does well (the ggml types, their block sizes, dequantising) and hands
any file this does not read (big-endian, version 1, a truncated or unknown field) to `GGUFReader`, which reads it or
says what is wrong.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # the versions with 64-bit counts and lengths (what the gguf package reads)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, BOOL = 8, 9, 7
# value type -> (struct format, numpy dtype), little-endian
SCALARS = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
FLOATS = (6, 12)


class NotParsed(Exception):
    """A file this reader leaves to the gguf package's (see the module docstring)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `dims` in ggml's order (innermost first), `offset` from the start of the tensor data (`Header`'s;
    `gguf_file.py` keeps them from the start of the file)."""

    name: str
    ggml_type: int
    dims: tuple
    offset: int


@dataclass
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_start: int  # the file offset of the tensor data


class _Cursor:
    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def take(self, n: int) -> int:
        start = self.at
        if n < 0 or start + n > len(self.buf):
            raise NotParsed("the header runs past the end of the file")
        self.at = start + n
        return start

    def unpack(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, n = self.unpack("<I"), self.unpack("<Q")
            if item in (STRING, ARRAY):
                return [self.value(item) for _ in range(n)]
            if item not in SCALARS:
                raise NotParsed(f"array of value type {item}")
            dtype = np.dtype(SCALARS[item][1])
            start = self.take(n * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, n, start).tolist()
        if kind not in SCALARS:
            raise NotParsed(f"value type {kind}")
        v = self.unpack(SCALARS[kind][0])
        return bool(v) if kind == BOOL else float(v) if kind in FLOATS else int(v)


def read_header(path: str) -> Header:
    """The header of the GGUF file at `path`; `NotParsed` for a file this reader leaves to the gguf package."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise NotParsed("empty file") from None
    try:
        return _parse(buf)
    except struct.error as err:
        raise NotParsed(str(err)) from None
    finally:
        buf.close()


def _parse(buf) -> Header:
    c = _Cursor(buf)
    if buf[c.take(4) : 4] != MAGIC:
        raise NotParsed("no GGUF magic")
    version = c.unpack("<I")
    if version not in VERSIONS:
        raise NotParsed(f"version {version}")
    tensor_count, kv_count = c.unpack("<Q"), c.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = c.string()
        metadata[key] = c.value(c.unpack("<I"))
    tensors = []
    for _ in range(tensor_count):
        name = c.string()
        dims = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
        ggml_type, offset = c.unpack("<I"), c.unpack("<Q")
        tensors.append(TensorInfo(name, ggml_type, dims, offset))
    if len({t.name for t in tensors}) != len(tensors):
        raise NotParsed("a tensor name twice")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise NotParsed("general.alignment is not a power of two")
    data_start = -(-c.at // alignment) * alignment
    return Header(version, metadata, tensors, data_start)


__all__ = ["Header", "NotParsed", "TensorInfo", "read_header"]
