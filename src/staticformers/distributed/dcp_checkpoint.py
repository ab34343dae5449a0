"""Sharded training checkpoints with `torch.distributed.checkpoint`, and one Hugging Face export.

`save_checkpoint` writes the model and optimizer state as DCP shards (each rank writes what it owns,
the metadata records every tensor's global shape), plus a small JSON of the caller's own state
(step, scheduler, RNG seeds). `load_checkpoint` reads it into any layout: DCP reshards on load, so a
checkpoint written at tp=2 x fsdp=2 resumes at fsdp=4, tp=4 or in one process (measured, tests/test_distributed_trainer.py).
State dicts go through `torch.distributed.checkpoint.state_dict.get_state_dict` / `set_state_dict`,
which give the same fully-qualified names for a plain, a TP and an FSDP2 model.

A model with LoRA adapters checkpoints its trainable weights alone (`ignore_frozen_params`): the frozen
base is the checkpoint it was loaded from.

`save_pretrained_distributed` gathers full tensors to rank 0 only (`full_state_dict=True,
cpu_offload=True`) and writes one Hugging Face checkpoint there, which transformers loads.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

EXTRA_STATE = "extra_state.json"


def _options(model: nn.Module):
    """The state-dict options: a model with adapters leaves its frozen base out (and does not expect it back)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from ..adapters.lora import has_adapters

    return StateDictOptions(ignore_frozen_params=True, strict=False) if has_adapters(model) else None


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(
    checkpoint_dir: str,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    extra: Optional[dict] = None,
) -> None:
    """Every rank calls this: model (and optimizer) shards to `checkpoint_dir`, `extra` as JSON by rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    os.makedirs(checkpoint_dir, exist_ok=True)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model, options=_options(model))}
    dcp.save(state, checkpoint_id=checkpoint_dir)
    if extra is not None and _is_main():
        with open(os.path.join(checkpoint_dir, EXTRA_STATE), "w", encoding="utf-8") as f:
            json.dump(extra, f, indent=2)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(checkpoint_dir: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """Every rank calls this: fill the model (and optimizer) from a DCP checkpoint of any layout; returns `extra`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from .dcp_safety import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError, check_checkpoint_folder

    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a torch.distributed.checkpoint folder (no .metadata): pass the folder "
            f"save_checkpoint wrote."
        )

    check_checkpoint_folder(checkpoint_dir)  # a refusal here is one sentence (inside dcp.load it is wrapped)

    def read(state: dict) -> None:  # never PyTorch's default reader: it unpickles (dcp_safety.py)
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint_dir), planner=SafeLoadPlanner())
        except CheckpointException as err:  # DCP wraps each rank's error with its traceback: give ours back
            ours = [exc for exc, _ in err.failures.values() if isinstance(exc, UnsafeCheckpointError)]
            if ours:
                raise ours[0] from None
            raise

    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
        state = {"model": model_sd, "optim": optim_sd}
        read(state)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_options(model)
        )
    else:
        state = {"model": get_model_state_dict(model, options=_options(model))}
        read(state)
        set_model_state_dict(model, state["model"], options=_options(model))
    path = os.path.join(checkpoint_dir, EXTRA_STATE)
    if os.path.isfile(path):
        from ..checkpoints.json_files import read_json_object

        return read_json_object(path, "restore the checkpoint's extra state", ValueError)
    return {}


def save_pretrained_distributed(model: nn.Module, save_directory: str, **kwargs) -> None:
    """Every rank calls this; rank 0 writes one Hugging Face checkpoint of the whole model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..models.pretrained import save_pretrained

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _is_main():
        tensors = {
            k: v.contiguous()
            for k, v in full.items()
            if not (model.config.tie_word_embeddings and k == "lm_head.weight")
        }
        save_pretrained(model, save_directory, state_dict=tensors, **kwargs)
    del full
    if dist.is_initialized():
        dist.barrier()


__all__ = ["save_checkpoint", "load_checkpoint", "save_pretrained_distributed", "EXTRA_STATE"]
