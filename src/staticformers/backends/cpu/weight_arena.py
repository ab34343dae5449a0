"""One block of huge pages for a model's weights, laid out in the order a step reads them.

Why this exists: a decode step on the CPU streams every weight once, and its projections are bound by the
memory's rate. Loaded one by one, the weights are separate allocations of 4 KiB pages: each page a TLB miss and a
place where the hardware prefetcher stops, and every projection a short stream of its own. Copied into one
allocation that Linux backs with 2 MiB pages (`madvise(MADV_HUGEPAGE)`; transparent huge pages in `madvise` or
`always` mode), in the modules' order (a layer's q, k, v, o, gate, up, down, then the next layer's), the same
kernels read the same bytes markedly faster (BENCHMARKS.md, "The weights in one block of huge pages").

`arrange_weights(model)` does it once per model, before the engine builds its first step: each parameter keeps
its `Parameter` object (optimizers and modules hold those) and gets a view of the block as its data. It leaves
the model as it is, and says why at debug level, where:
- `STATICFORMERS_WEIGHT_ARENA=0` is set;
- a parameter is not a plain CPU tensor owning its whole storage (tensor-parallel shards, views of a fused
  tensor);
- the host has less free memory than the weights' bytes and a margin (each weight is copied, then its old
  storage freed, so the peak is briefly above the model's size).
Tied parameters (one storage for two names) stay tied: they get one view.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Optional

import torch

from ...utils.cpu_features import weight_arena_off
from .host_memory import libc

logger = logging.getLogger("staticformers")

HUGE_PAGE = 2 * 2**20
ALIGN = 64  # each weight starts on a cache line
MADV_HUGEPAGE = 14
MARGIN = 1.25  # free host memory wanted, as a multiple of the weights' bytes
ATTR = "_staticformers_weight_arena"  # on the model: the block its weights were copied into


def _owning(p: torch.Tensor) -> bool:
    """Whether `p` is a plain, contiguous CPU tensor that is the whole of its storage."""
    return (
        type(p.data) is torch.Tensor
        and p.device.type == "cpu"
        and p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    )


def _offset(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def huge_page_block(nbytes: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(allocation, its part starting on a 2 MiB boundary of `nbytes` bytes, whether Linux took the advice);
    the pages are advised before they are first touched, so the copy faults them in as huge pages. The advice
    covers whole huge pages, all inside the allocation."""
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    whole = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    start = (-whole.data_ptr()) % HUGE_PAGE
    block = whole[start : start + nbytes]
    madvise = getattr(libc(), "madvise", None)
    advised = (
        madvise is not None and madvise(ctypes.c_void_p(block.data_ptr()), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    )
    return whole, block, advised


def _trim() -> None:
    """Give the freed copies' heap pages back to the system (glibc keeps them otherwise)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _weights(model) -> list:
    """The parameters with data, in module order, each shared Parameter once."""
    return [p for p in model.parameters() if p.numel() > 0]


def _inside(block: torch.Tensor, p: torch.Tensor) -> bool:
    return block.data_ptr() <= p.data_ptr() < block.data_ptr() + block.numel()


def arranged(model) -> bool:
    """Whether every parameter of `model` lies in the block `arrange_weights` made for it."""
    block = getattr(model, ATTR, None)
    return block is not None and all(_inside(block, p) for p in _weights(model))


def arrange_weights(model, available: Optional[int] = None) -> bool:
    """Copy `model`'s parameters into one block of huge pages in module order (see the module docstring), once
    per model: again only when none of them lies in its block any more (the model was converted or moved; the
    old block is freed). `available`: the host's free bytes (None: not checked). True if they moved now."""
    block = getattr(model, ATTR, None)
    if block is not None:
        if any(_inside(block, p) for p in _weights(model)):
            return False  # in place, or partly replaced (an adapter added): left as it is
        delattr(model, ATTR)
    if weight_arena_off():
        return False
    params = _weights(model)
    if not params or not all(_owning(p) for p in params):
        logger.debug("weights left in place: a parameter is not a whole CPU tensor of its own")
        return False
    places: dict[int, int] = {}  # storage address -> offset in the block
    total = 0
    for p in params:
        if p.data_ptr() not in places:
            places[p.data_ptr()] = total
            total = _offset(total + p.numel() * p.element_size())
    if available is not None and available < total * MARGIN:
        logger.debug("weights left in place: %d bytes free, %d wanted to copy them", available, total * MARGIN)
        return False
    start = time.perf_counter()
    whole, block, advised = huge_page_block(total)
    views: dict[int, torch.Tensor] = {}
    for p in params:
        old = p.data_ptr()
        view = views.get(old)
        if view is None:
            at = places[old]
            view = block[at : at + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            views[old] = view
        p.data = view
    _trim()
    object.__setattr__(model, ATTR, whole)
    logger.info(
        "weights copied into one block of %.1f MiB%s in %.2f s",
        total / 2**20,
        " of huge pages" if advised else "",
        time.perf_counter() - start,
    )
    return True


__all__ = ["arrange_weights", "arranged", "huge_page_block"]
