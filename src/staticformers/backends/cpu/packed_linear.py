"""bfloat16 linears over weights that oneDNN packs once, as an operator the CPU's compiled graphs call.

Why this exists: a bfloat16 `F.linear` on the CPU is oneDNN's inner product, and given a plain `[out, in]`
weight oneDNN reorders it into its blocked layout (the one its AMX / AVX-512 BF16 kernels read) on every
call. Packing each weight once and keeping the packed copy takes that reorder out of every step: about 2x
on the decoder's projections at 1 to 8 rows and 4-40% on a prompt's, with bit-identical results, since
the kernel is the same (BENCHMARKS.md, "Packed bf16 weights"). Inductor packs weights itself only when
they are frozen constants, and our graphs take weights as inputs (one layer graph serves every layer), so
the packing happens here, on the first call that meets each weight, and graphs call
`staticformers::packed_linear(x, weight, bias)` like any extern kernel.

The packed copies live in a table keyed by the weight's storage and shape. An entry holds a weak reference
to the weight and its version counter: a weight changed in place (a LoRA merge, a load into the same
tensor) is packed again, and a weight that is freed takes its entry with it. A packed copy costs one more
copy of that weight's bytes: when packing it would leave less than `RESERVE_FRACTION` of the host's memory
available, the weight is used as it is (the same kernel, unpacked) and a notice says so once.
`STATICFORMERS_PACKED_WEIGHTS=0` turns packing off. The operator is for inference (no autograd formula).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Optional

import torch

from .operators import define

OP = "staticformers::packed_linear"
ENV = "STATICFORMERS_PACKED_WEIGHTS"
ROWS_HINT = 8  # the row count oneDNN packs for: decode batches; a prompt's rows run as fast on it (measured)
RESERVE_FRACTION = 0.1  # of the host's memory, left available after a packed copy

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_packed: dict = {}  # key -> (weakref to the weight, its version, the packed copy)
_declined: dict = {}  # key -> weakref to a weight that memory refused, so the check is not repeated every call
STATS = {"packed": 0, "declined": 0}


def _key(weight: torch.Tensor) -> tuple:
    return (weight.data_ptr(), weight.dtype, tuple(weight.shape), tuple(weight.stride()))


def _room_for(nbytes: int) -> bool:
    try:
        import psutil

        memory = psutil.virtual_memory()
    except Exception:  # pragma: no cover - psutil is a dependency; a sandbox may hide /proc
        return True
    return memory.available - nbytes >= RESERVE_FRACTION * memory.total


def packing_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _current(key: tuple, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The packed copy under `key` while its weight lives and is unchanged since it was packed."""
    entry = _packed.get(key)
    return entry[2] if entry is not None and entry[0]() is not None and entry[1] == weight._version else None


def packed_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight` packed by oneDNN (made on first use, kept while the weight lives unchanged), or None where
    packing is off or memory refused it."""
    key = _key(weight)
    packed = _current(key, weight)
    if packed is not None:
        return packed
    refused = _declined.get(key)
    if (refused is not None and refused() is not None) or not packing_enabled():
        return None
    with _lock:
        packed = _current(key, weight)
        if packed is not None:
            return packed
        if not _room_for(weight.numel() * weight.element_size()):
            _declined[key] = weakref.ref(weight)
            STATS["declined"] += 1
            if STATS["declined"] == 1:
                _log.warning(
                    "staticformers: bf16 weights are not packed for oneDNN: another copy would leave less "
                    "than %d%% of this host's memory available. Steps run, unpacked and slower; free "
                    "memory to pack them.",
                    round(RESERVE_FRACTION * 100),
                )
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        _packed[key] = (weakref.ref(weight, lambda _ref, k=key: _packed.pop(k, None)), weight._version, packed)
        STATS["packed"] += 1
        return packed


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    w = packed_weight(weight)
    bias = bias.contiguous() if bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), w if w is not None else weight.contiguous(), bias, "none", [], ""
    )


def _shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _define() -> bool:
    """Define the operator when this PyTorch's oneDNN can pack bf16 weights on this CPU; whether it did."""
    mkldnn = torch.ops.mkldnn
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_is_mkldnn_bf16_supported")
        and mkldnn._is_mkldnn_bf16_supported()
    ):
        return False
    define("packed_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _packed_linear, "CPU", _shape)
    return True


PACKED = _define()  # a plain flag: read inside traced code


def packed_available(dtype: torch.dtype) -> bool:
    """Whether a linear in `dtype` can run over a packed weight here (bf16, with oneDNN's bf16 kernels)."""
    return PACKED and dtype == torch.bfloat16 and torch.backends.mkldnn.enabled and packing_enabled()


def packed_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` over the layer's packed weight; `F.linear` where a gradient is wanted (no backward) or
    the operator is absent."""
    if (
        not PACKED
        or x.dtype != torch.bfloat16
        or layer.weight.dtype != torch.bfloat16
        or (torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad))
    ):
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    return torch.ops.staticformers.packed_linear(x, layer.weight, layer.bias)


__all__ = ["ENV", "OP", "STATS", "packed_available", "packed_linear", "packed_weight"]
