"""A GGUF file (the GGML ecosystem's single-file checkpoint) read through the `gguf` package: its metadata and its tensors.

Why this exists: a GGUF holds the config, the tokenizer, the chat template and the weights in one file, the
weights often quantized in ggml's block formats. This module is the one place that opens such a file: it
gives the metadata as plain Python values (the header read by `gguf_header.py`) and each tensor dequantised into a
torch tensor of the asked dtype (`gguf.quants.dequantize`, in numpy, one tensor at a time). It knows no model: the
tensor names and the config keys are `gguf_names.py`'s and `gguf_config.py`'s.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Any, Optional

import numpy as np
import torch

from .gguf_header import NotParsed, TensorInfo, read_header

# ggml tensor types we dequantise (each tested against transformers' GGUF loader)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class GGUFError(ValueError):
    """A GGUF file we cannot read, or one holding something we do not load."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError("Reading a GGUF file needs the `gguf` package: pip install gguf.") from None
    return gguf


class GGUFFile:
    """An opened GGUF file: `metadata` (key -> value), `tensor_names`, `tensor_type(name)`, `read(name, dtype)`.

    The header is read in one pass (`gguf_header.py`; a file it leaves aside goes through the package's
    `GGUFReader`); the tensor data is memory-mapped and `read` copies one tensor out at a time."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise GGUFError(
                f"{path} is not a file: pass gguf_file= the name of a .gguf file in the folder (or its path)."
            )
        gguf = _gguf()
        self.path = path
        try:
            header = read_header(path)
            self.metadata: dict[str, Any] = header.metadata
            tensors = [replace(t, offset=header.data_start + t.offset) for t in header.tensors]
        except NotParsed:
            self.metadata, tensors = _through_reader(path, gguf)
        # a plain array over the map: numpy calls a memmap subclass hook on every array it derives from one
        self._data = np.memmap(path, mode="r").view(np.ndarray) if tensors else None
        self._tensors = {t.name: t for t in tensors}  # offsets from the start of the file

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture key: it is not a model GGUF file.")
        return arch

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return _type_name(self._tensors[name].ggml_type)

    def shape(self, name: str) -> tuple:
        """The tensor's shape in torch's order (GGUF stores ggml's, innermost first)."""
        return tuple(reversed(self._tensors[name].dims))

    def check_types(self) -> None:
        """Refuse, in one sentence, a file holding a tensor type we do not dequantise."""
        for name, tensor in self._tensors.items():
            kind = _type_name(tensor.ggml_type)
            if kind not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{os.path.basename(self.path)} stores tensor {name} as {kind}, a ggml type "
                    f"staticformers does not dequantise ({', '.join(SUPPORTED_TYPES)} are): use a GGUF of one of "
                    f"those types, or the model's safetensors checkpoint."
                )

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor `name` dequantised to float32 in numpy, then in `dtype`, in torch's shape."""
        gguf = _gguf()
        tensor = self._tensors[name]
        kind = _type_name(tensor.ggml_type)
        if kind not in SUPPORTED_TYPES:
            self.check_types()
        qtype = gguf.GGMLQuantizationType(tensor.ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        shape = self.shape(name)
        count = int(np.prod(shape)) * size // block
        assert self._data is not None  # a file with tensors has its data mapped
        if tensor.offset + count > len(self._data):
            raise GGUFError(f"{self.path} ends inside tensor {name}: the file is truncated; re-download it.")
        raw = self._data[tensor.offset : tensor.offset + count]
        if kind == "F32":
            values = raw.view(np.float32)
        elif kind == "F16":
            values = raw.view(np.float16).astype(np.float32)
        else:
            values = gguf.quants.dequantize(raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype)), qtype)
        out = torch.from_numpy(np.ascontiguousarray(values).reshape(shape).copy())
        return out.to(dtype)


def _type_name(ggml_type: int) -> str:
    """A ggml type's name ("Q4_K"), or "ggml type N" for a number the gguf package does not know."""
    try:
        return _gguf().GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


def _through_reader(path: str, gguf) -> tuple[dict, list[TensorInfo]]:
    """(metadata, tensors with their offsets from the start of the file) through the package's `GGUFReader`: the
    files `gguf_header.py` leaves aside."""
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # the reader raises ValueError / struct errors on a bad header
        raise GGUFError(f"{path} is not a GGUF file the gguf package can read ({err}): re-download it.") from None
    if reader.byte_order != "I":
        raise GGUFError(f"{path} is a big-endian GGUF file: convert it to little-endian (gguf's gguf_convert_endian).")
    metadata = {key: _value(field, gguf) for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [
        TensorInfo(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape.tolist()), int(t.data_offset))
        for t in reader.tensors
    ]
    return metadata, tensors


def _value(field, gguf) -> Any:
    """A metadata field as a Python value: a str, an int, a float, a bool, or a list of them."""
    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [_scalar(field.parts[i], types[-1], gguf) for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return _scalar(field.parts[field.data[0]], types[0], gguf)


def _scalar(part, kind, gguf):
    value: Any = part[0] if len(part) else None
    if kind == gguf.GGUFValueType.BOOL:
        return bool(value)
    if kind in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
        return float(value)
    return int(value)


@functools.lru_cache(maxsize=2)
def _opened(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str, required_keys: Optional[tuple] = None) -> GGUFFile:
    """A `GGUFFile`; `required_keys`: metadata keys whose absence is refused in one sentence. The last two
    files opened are kept (by path, size and modification time): loading a model and then its tokenizer from
    one file parses its metadata (a vocabulary of strings, slow to read) once."""
    if not os.path.isfile(path):
        return GGUFFile(path)  # refused there, in one sentence
    stat = os.stat(path)
    f = _opened(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
    for key in required_keys or ():
        if key not in f.metadata:
            raise GGUFError(f"{path} has no {key} key: it is not a complete model GGUF file.")
    return f


__all__ = ["GGUFFile", "GGUFError", "SUPPORTED_TYPES", "open_gguf"]
