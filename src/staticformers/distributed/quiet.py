"""Two notices PyTorch prints on every rank of a tensor-parallel x FSDP2 run that say nothing wrong about
this code, silenced by their exact text (nothing else is filtered), each with the reason.

1. FSDP2: "FSDP2-wrapped module (...) returned a view tensor. An in-place op on this view ... will
   silently drop the pre-backward hook". With tensor parallel, the model's logits are the output of
   the vocabulary-parallel `lm_head`, which DTensor's `to_local()` returns as a view of the local shard
   (PyTorch's own design). The warning is about what a caller might do with that view: nothing here
   modifies logits in place (the loss reads `logits.float()`), and copying them to dodge the notice
   would cost a `[batch, seq, vocab]` tensor per step.
2. DTensor: "While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)) to (Replicate(),
   Replicate()), 2 sequential all_gather operations will be performed ... may give inconsistent
   results between ranks due to different reduction orders". A weight sharded on dim 0 by FSDP and by
   tensor parallel (q/k/v, gate/up) is gathered for `save_model` in two all-gathers, as every 2-D
   layout must; an all-gather has no reduction, so the gathered weights are exact (the tests compare
   the saved checkpoint's logits with the trained ranks').
"""

from __future__ import annotations

import logging
import warnings

FSDP_VIEW = r"FSDP2-wrapped module \(.*\) returned a view tensor"
SEQUENTIAL_ALL_GATHER = "sequential all_gather operations will be performed"

_installed = False


class _DropSequentialAllGather(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return SEQUENTIAL_ALL_GATHER not in record.getMessage()


def silence_pytorch_notices() -> None:
    """Install both filters once per process (see the module docstring)."""
    global _installed
    if _installed:
        return
    _installed = True
    warnings.filterwarnings("ignore", message=FSDP_VIEW, category=UserWarning)
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_DropSequentialAllGather())


__all__ = ["silence_pytorch_notices"]
