"""Reading safetensors files with plain reads straight into the tensors that keep the data, and
writing them with the permissions every other file gets.

`safetensors.safe_open` memory-maps the file: every page it touches counts in the process's RSS
until the file is closed, so loading a fp32 checkpoint as bf16 peaked at the file *plus* the model
(about 2x the checkpoint here). Reading each tensor with `readinto` into its final storage (or into
one temporary of that tensor's size when the dtype changes) keeps the peak near the model's size.
The format is simple: an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the data. The header is checked as the safetensors library checks
it (see `_read_header`), so a file it would refuse is refused here too, with one sentence.

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
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}
_MAX_HEADER = 100 * 1024 * 1024


def save_file(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    """`safetensors.torch.save_file`, then the umask's permissions (see the module docstring)."""
    from safetensors.torch import save_file as write

    write(tensors, path, metadata=metadata)
    os.chmod(path, new_file_mode())


def new_file_mode() -> int:
    """The mode a plain `open()` gives a new file (0666 less the umask). The umask is read from /proc where
    it can be (setting it to read it back races with other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


class SafetensorsFormatError(ValueError):
    """A file that is not a valid safetensors file."""


class _RepeatedName(ValueError):
    pass


def _no_repeated_names(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedName(key)
        out[key] = value
    return out


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
        return SafetensorsFormatError(
            f"{self.path} is not a readable safetensors file ({why}): re-download or re-save it."
        )

    def _read_header(self):
        """Parse and check the header as the safetensors library does: a JSON object (no repeated
        names), each entry a known dtype, a shape of non-negative integers and two integer offsets whose
        span fits the shape; the tensors tile the data exactly (no overlap, no gap, no trailing bytes)."""
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) < 8:
            raise self._bad("shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise self._bad("its header length does not fit in the file")
        raw = self._f.read(n)
        if not raw.startswith(b"{"):
            raise self._bad("the header does not start with a JSON object")
        try:
            header = json.loads(raw, object_pairs_hook=_no_repeated_names)
        except _RepeatedName as err:
            raise self._bad(f"the header names tensor {err.args[0]!r} twice") from None
        except (UnicodeDecodeError, ValueError):
            raise self._bad("the header is not valid JSON") from None
        if not isinstance(header, dict):
            raise self._bad("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("its __metadata__ is not an object of strings")
        spans = []
        for name, info in header.items():
            spans.append((*self._check_entry(name, info), name))
        expected = 0
        for begin, end, name in sorted(spans):
            if begin != expected:
                why = "overlaps another tensor" if begin < expected else "leaves a gap before it"
                raise self._bad(f"tensor {name!r} {why}")
            expected = end
        data_size = size - 8 - n
        if expected != data_size:
            why = "truncated file?" if expected > data_size else f"{data_size - expected} bytes after the last tensor"
            raise self._bad(f"its tensors do not fill the data exactly ({why})")
        return header, metadata, 8 + n

    def _check_entry(self, name: str, info) -> tuple[int, int]:
        if not isinstance(info, dict):
            raise self._bad(f"entry {name!r} is not an object of dtype, shape and data_offsets")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self._bad(f"tensor {name!r} has a dtype we do not read ({str(dtype)[:20]!r})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise self._bad(f"tensor {name!r} has no valid shape (a list of non-negative integers)")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise self._bad(f"tensor {name!r} has no valid data_offsets (two increasing integers)")
        count = 1
        for d in shape:
            count *= d
        if offsets[1] - offsets[0] != count * DTYPES[dtype].itemsize:
            raise self._bad(
                f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, not the {count * DTYPES[dtype].itemsize} "
                f"its shape and dtype need"
            )
        return offsets[0], offsets[1]

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.tensors[name]["dtype"]]

    def read(
        self,
        name: str,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        finite: bool = False,
    ) -> torch.Tensor:
        """The tensor, converted to `dtype` on `device`; read straight into place when nothing changes. With
        `finite`, a floating-point tensor holding NaN or an infinity is refused (checked on the host, as read)."""
        info = self.tensors[name]
        src = DTYPES[info["dtype"]]
        buf = torch.empty(info["shape"], dtype=src)
        begin, end = info["data_offsets"]
        if end > begin:
            self._f.seek(self._data_start + begin)
            view = buf.reshape(-1).view(torch.uint8).numpy().data
            got = self._f.readinto(view)
            while got < end - begin:
                more = self._f.readinto(view[got:])
                if not more:
                    raise self._bad(f"tensor {name!r} is cut short")
                got += more
        if finite and buf.is_floating_point() and not bool(torch.isfinite(buf).all()):
            raise SafetensorsFormatError(
                f"{self.path}: tensor {name!r} holds NaN or infinite values, so the model "
                f"would compute nothing useful: re-download or re-save the checkpoint."
            )
        if (dtype is None or dtype == src) and (device is None or torch.device(device) == buf.device):
            return buf
        return buf.to(device=device, dtype=dtype if dtype is not None else src)

    def same_values(self, name: str, other: "SafetensorsFile", other_name: str) -> bool:
        """Whether tensor `name` here equals `other_name` in `other` (same dtype and shape, equal bytes, or
        equal values after conversion), compared in chunks of at most 16 MiB."""
        a, b = self.tensors[name], other.tensors[other_name]
        if a["shape"] != b["shape"]:
            return False
        if a["dtype"] != b["dtype"]:
            return torch.equal(self.read(name, dtype=torch.float32), other.read(other_name, dtype=torch.float32))
        total = a["data_offsets"][1] - a["data_offsets"][0]
        chunk = 16 * 2**20
        for start in range(0, total, chunk):
            if self._bytes(name, start, min(chunk, total - start)) != other._bytes(
                other_name, start, min(chunk, total - start)
            ):
                return False
        return True

    def _bytes(self, name: str, offset: int, count: int) -> bytes:
        self._f.seek(self._data_start + self.tensors[name]["data_offsets"][0] + offset)
        data = self._f.read(count)
        if len(data) != count:
            raise self._bad(f"tensor {name!r} is cut short")
        return data

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)
