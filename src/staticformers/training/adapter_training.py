"""What the Trainer does differently when only some parameters train (LoRA adapters, a frozen base).

Why this exists: with adapters (`adapters.add_adapter`, or `load_adapter(..., is_trainable=True)`)
the base weights are frozen (`requires_grad=False`): they take no gradient, get no optimizer state and
no master copy (`optim.MasterWeights` covers trainable parameters only), and a base already in the
compute dtype (bf16) is never copied. A frozen base in another dtype (an fp32 checkpoint trained with
`bf16=True`) is cast for the run, as everything is, and gets its own values back at the end, as the
trained parameters get theirs from their master copies. A model with nothing to train is refused
before anything is touched, and so are several adapters training at once (a checkpoint holds one)
and a trainable adapter that is not active (it would take no gradient).
"""

from __future__ import annotations

import torch
from torch import nn

from ..adapters.lora import has_adapters, trainable_adapter


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with no trainable parameter, or with several adapters training, in one sentence."""
    if not any(p.requires_grad for p in model.parameters()):
        if has_adapters(model):
            raise ValueError(
                "The model's adapters are frozen (load_adapter loads them for inference): load the adapter "
                "with load_adapter(path, is_trainable=True), or add a new one with add_adapter(LoraConfig(...))."
            )
        raise ValueError("The model has no trainable parameters (every requires_grad is False): nothing would train.")
    if has_adapters(model):
        name = trainable_adapter(model)
        active = getattr(model, "active_adapter_names", None) or []
        if name is not None and name not in active:
            raise ValueError(
                f"Adapter {name!r} is trainable but not active, so it would take no gradient: "
                f"model.set_adapter({name!r}) first."
            )


def frozen_originals(model: nn.Module, originals: dict) -> dict:
    """{id(parameter): original tensor} of the frozen parameters the run cast to another dtype."""
    return {
        id(p): originals[id(p)]
        for p in model.parameters()
        if not p.requires_grad and id(p) in originals and originals[id(p)].dtype != p.dtype
    }


@torch.no_grad()
def restore_frozen(model: nn.Module, frozen: dict) -> None:
    """Give the frozen parameters their original tensors back (see `frozen_originals`)."""
    for p in model.parameters():
        original = frozen.get(id(p))
        if original is not None and original.shape == p.shape:
            p.data = original


__all__ = ["check_trainable", "frozen_originals", "restore_frozen"]
