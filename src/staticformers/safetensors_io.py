"""Reading safetensors files with plain reads straight into the tensors that keep the data, and
writing them with the permissions every other file gets.

`safetensors.safe_open` memory-maps the file: every page it touches counts in the process's RSS
until the file is closed, so loading a fp32 checkpoint as bf16 peaked at the file *plus* the model
(about 2x the checkpoint here). Reading each tensor with `readinto` into its final storage (or into
one temporary of that tensor's size when the dtype changes) keeps the peak near the model's size.
The format is simple: an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the data.

`safetensors.torch.save_file` writes through a private temporary file and keeps its mode, 0600, so
other users of a shared machine could not read a model saved for them; `save_file` here gives the
file the mode `open()` would (0666 less the umask), as config.json and the tokenizer files get.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator, Optional

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024


def save_file(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    """`safetensors.torch.save_file`, then the umask's permissions (see the module docstring)."""
    from safetensors.torch import save_file as write

    write(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


class SafetensorsFormatError(ValueError):
    """A file that is not a valid safetensors file."""


class SafetensorsFile:
    """One open safetensors file: its header, and tensors read on demand."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb")
        try:
            self.tensors, self.metadata, self._data_start = self._read_header()
        except Exception:
            self._f.close()
            raise

    def _bad(self, why: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(f"{self.path} is not a readable safetensors file ({why}): re-download or re-save it.")

    def _read_header(self):
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) < 8:
            raise self._bad("shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise self._bad(f"header length {n} does not fit in a file of {size} bytes")
        try:
            header = json.loads(self._f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._bad(f"header is not JSON: {err}") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        data_size = size - 8 - n
        for name, info in header.items():
            try:
                begin, end = info["data_offsets"]
                dtype = DTYPES[info["dtype"]]
                count = 1
                for d in info["shape"]:
                    count *= int(d)
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"entry {name!r} lacks a valid dtype, shape or data_offsets") from None
            if not (0 <= begin <= end <= data_size) or end - begin != count * torch.empty((), dtype=dtype).element_size():
                raise self._bad(f"tensor {name!r} points outside the file or has the wrong size (truncated file?)")
        return header, metadata, 8 + n

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.tensors[name]["dtype"]]

    def read(self, name: str, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> torch.Tensor:
        """The tensor, converted to `dtype` on `device`; read straight into place when nothing changes."""
        info = self.tensors[name]
        src = DTYPES[info["dtype"]]
        buf = torch.empty(info["shape"], dtype=src)
        begin, end = info["data_offsets"]
        if end > begin:
            self._f.seek(self._data_start + begin)
            view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
            got = self._f.readinto(view)
            while got < end - begin:
                more = self._f.readinto(view[got:])
                if not more:
                    raise self._bad(f"tensor {name!r} is cut short")
                got += more
        if (dtype is None or dtype == src) and (device is None or torch.device(device).type == "cpu"):
            return buf
        return buf.to(device=device, dtype=dtype if dtype is not None else src)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)
