"""A GGUF file (the GGML ecosystem's single-file checkpoint) read through the `gguf` package: its metadata and its tensors.

Why this exists: a GGUF holds the config, the tokenizer, the chat template and the weights in one file, the
weights often quantized in ggml's block formats. This module is the one place that opens such a file: it
gives the metadata as plain Python values and each tensor dequantised into a torch tensor of the asked
dtype (`gguf.quants.dequantize`, in numpy, one tensor at a time). It knows no model: the tensor names and
the config keys are `gguf_names.py`'s and `gguf_config.py`'s.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

import numpy as np
import torch

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

    The file is memory-mapped by the reader; `read` copies one tensor out at a time."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise GGUFError(
                f"{path} is not a file: pass gguf_file= the name of a .gguf file in the folder (or its path)."
            )
        gguf = _gguf()
        try:
            self._reader = gguf.GGUFReader(path)
        except Exception as err:  # the reader raises ValueError / struct errors on a bad header
            raise GGUFError(f"{path} is not a GGUF file the gguf package can read ({err}): re-download it.") from None
        self.path = path
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = _value(field, gguf)

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
        return self._tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple:
        """The tensor's shape in torch's order (GGUF stores ggml's, innermost first)."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def check_types(self) -> None:
        """Refuse, in one sentence, a file holding a tensor type we do not dequantise."""
        for name, tensor in self._tensors.items():
            if tensor.tensor_type.name not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{os.path.basename(self.path)} stores tensor {name} as {tensor.tensor_type.name}, a ggml type "
                    f"staticformers does not dequantise ({', '.join(SUPPORTED_TYPES)} are): use a GGUF of one of "
                    f"those types, or the model's safetensors checkpoint."
                )

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor `name` dequantised to float32 in numpy, then in `dtype`, in torch's shape."""
        gguf = _gguf()
        tensor = self._tensors[name]
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            self.check_types()
        if kind == "F32":
            values = np.asarray(tensor.data, dtype=np.float32)
        elif kind == "F16":
            values = np.asarray(tensor.data).view(np.float16).astype(np.float32)
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        out = torch.from_numpy(np.ascontiguousarray(values).reshape(self.shape(name)).copy())
        return out.to(dtype)


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
