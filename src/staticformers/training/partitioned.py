"""`DistributedTraining`: what the Trainer does differently for a model partitioned by `DistributedConfig`.

The Trainer keeps every distributed decision in hook methods; when the model carries `parallel_dims`
(set by `from_pretrained(..., distributed_config=...)`), the Trainer holds one of these
(`trainer.distributed`) and its hooks delegate to it. This module imports the training package's
pieces, never the Trainer itself:

- data: each data-parallel rank (dp_replicate x fsdp) takes its own slice of every global batch
  (the Trainer's `StaticBatchSampler` with this rank and size); tp ranks of one shard share it;
- loss: token counts and logged sums are all-reduced over the data-parallel ranks, and each rank's
  loss is its tokens' sum over the *global* token count; FSDP2 averages gradients over the
  data-parallel ranks, so the backward is scaled by their number (`grad_scale.ScaleGrad`) to make the update
  equal one process on the whole batch (the logged value is unchanged);
- precision: parameters are the master weights (no copies). bf16 is FSDP2's mixed precision
  (`DistributedConfig(fsdp_mixed_precision=True)`: fp32 shards, bf16 compute, fp32 reduction); a
  model loaded in bf16 trains in bf16;
- gradient clipping: the per-mesh-group norm of `training.clip_grad_norm_`;
- compile (`torch_compile=True`): each decoder block is compiled with the device's backend, the
  unit FSDP2 gathers; the step itself runs eagerly around them. With tp_size > 1 the blocks stay
  eager (a warning says so): on torch 2.13 AOTAutograd over blocks that hold tensor-parallel hooks
  gave wrong gradients at tp2 x fsdp2 and failed in DTensor's backward at tp4. The blocks' graphs are
  counted like every other compiled function (`compilation.regions.compile_blocks`);
- checkpoints: model and optimizer through `torch.distributed.checkpoint` (every rank writes its
  shards into the same atomic folder; rank 0 adds scheduler, RNG and trainer state last), so they
  resume in another layout; `save_model` gathers one Hugging Face checkpoint on rank 0. With LoRA
  adapters (`add_adapter` on the partitioned model, `distributed/lora_partition.py`) only the adapter's
  weights and optimizer state are checkpointed, and `save_model` writes the adapter in PEFT's format.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..adapters.lora import has_adapters
from ..backends.devices import compile_backend_for
from ..compilation.regions import compile_blocks
from . import checkpoint_folders as ckpt
from .optim import MasterWeights
from .state import TrainerState
from .state_files import apply_file, apply_state, check_optimizer_state, check_scheduler_state, load_torch_file
from ..distributed.lora_partition import save_adapter_distributed
from ..distributed.dcp_checkpoint import load_checkpoint, save_checkpoint, save_pretrained_distributed
from ..distributed.grad_scale import ScaleGrad
from ..distributed.training_support import clip_grad_norm_

logger = logging.getLogger("staticformers")

DCP_FOLDER = ckpt.DCP_FOLDER  # inside a checkpoint-N folder: the DCP shards of model and optimizer


class DistributedTraining:
    """The distributed side of one Trainer (see the module docstring); `trainer` is the Trainer it serves."""

    def __init__(self, trainer):
        model = trainer.model
        if model.parallel_dims is None:
            raise ValueError(
                "DistributedTraining needs a model loaded with from_pretrained(..., distributed_config=...)."
            )
        self.trainer, self.model, self.dims = trainer, model, model.parallel_dims
        self.block_counters: list = []  # the compiled blocks' graph counters (compile_blocks)

    @property
    def args(self):
        return self.trainer.args

    # ---- where and who -------------------------------------------------------------------------
    def setup_device(self) -> torch.device:
        return next(iter(self.model.parameters())).device

    def data_parallel_info(self) -> tuple[int, int]:
        return self.dims.dp_rank, self.dims.dp

    def is_world_process_zero(self) -> bool:
        return dist.get_rank() == 0

    # ---- model, precision, optimizer -----------------------------------------------------------
    def compute_dtype(self) -> torch.dtype:
        return next(iter(self.model.parameters())).dtype

    def prepare_model(self) -> nn.Module:
        model = self.model
        a = self.args
        if a.bf16 and self.compute_dtype() == torch.float32 and self.dims.config.param_dtype is None:
            logger.warning(
                "bf16=True with a float32 distributed model: it trains in float32. Load it with "
                "DistributedConfig(fsdp_mixed_precision=True) for bf16 compute over fp32 shards."
            )
        if a.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if a.torch_compile and not self.block_counters:
            if self.dims.tp > 1:
                # measured on torch 2.13: AOTAutograd over blocks holding TP hooks gives wrong gradients
                # (tp2 x fsdp2) or fails in DTensor's backward (tp4); FSDP-only layouts compile exactly
                logger.warning(
                    "torch_compile=True with tp_size=%d: the decoder blocks run eagerly (compiling "
                    "tensor-parallel blocks for training is not reliable in this PyTorch); "
                    "FSDP/HSDP layouts compile per block.",
                    self.dims.tp,
                )
            else:
                backend = a.torch_compile_backend
                if backend is None:
                    backend = compile_backend_for(next(iter(model.parameters())).device)
                self.block_counters = compile_blocks(model, backend)
        model.train()
        return model

    def create_master_weights(self, model: nn.Module) -> MasterWeights:
        return MasterWeights(model, copies=False)  # FSDP2's sharded parameters are the master weights

    # ---- loss and gradients --------------------------------------------------------------------
    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.dims.dp == 1:
            return value
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.dims.dp_group())
        return out

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch loss whose gradient undoes FSDP2's average over the data-parallel ranks."""
        return ScaleGrad.apply(loss, float(self.dims.dp)) if self.dims.dp > 1 and loss.requires_grad else loss

    def clip_gradients(self) -> torch.Tensor:
        max_norm = self.args.max_grad_norm
        return clip_grad_norm_(self.trainer.master.master, max_norm if max_norm else float("inf"))

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint_files(self, directory: str) -> None:
        """Every rank: DCP shards of model and optimizer; then rank 0 writes the rest, trainer_state.json last."""
        t = self.trainer
        save_checkpoint(os.path.join(directory, DCP_FOLDER), self.model, t.optimizer)
        if self.is_world_process_zero():
            torch.save(t.lr_scheduler.state_dict(), os.path.join(directory, ckpt.SCHEDULER))
            torch.save(ckpt.capture_rng_state(t.device), os.path.join(directory, ckpt.RNG_STATE))
            with open(os.path.join(directory, ckpt.TRAINING_ARGS), "w", encoding="utf-8") as f:
                f.write(self.args.to_json_string())
            self.model.config.save_pretrained(directory)
            t.state.save_to_json(os.path.join(directory, ckpt.TRAINER_STATE))

    def load_checkpoint_files(self, directory: str) -> None:
        dcp_dir = os.path.join(directory, DCP_FOLDER)
        if not os.path.isdir(dcp_dir):
            raise ValueError(
                f"{directory} holds no {DCP_FOLDER}/ shards: it was written by a single-process run; "
                f"load its weights with from_pretrained(checkpoint, distributed_config=...) instead."
            )
        t = self.trainer
        state = TrainerState.load_from_json(os.path.join(directory, ckpt.TRAINER_STATE))
        scheduler_file = os.path.join(directory, ckpt.SCHEDULER)
        scheduler = load_torch_file(scheduler_file)
        check_scheduler_state(scheduler, scheduler_file, len(t.optimizer.param_groups))
        # DCP metadata is unpickled safely (distributed/dcp_safety.py)
        load_checkpoint(dcp_dir, self.model, t.optimizer)
        check_optimizer_state(t.optimizer, os.path.join(dcp_dir, ".metadata"))
        apply_state(scheduler_file, "learning-rate scheduler", t.lr_scheduler.load_state_dict, scheduler)
        apply_file(
            os.path.join(directory, ckpt.RNG_STATE),
            "random number generators",
            lambda rng: ckpt.restore_rng_state(rng, t.device),
        )
        t.state = state

    def save_checkpoint(self) -> str:
        """The Trainer's atomic folder, opened by rank 0 and written into by every rank."""
        t = self.trainer
        step = t.state.global_step
        path = ckpt.checkpoint_path(self.args.output_dir, step)
        t.state.last_checkpoint = path
        t.check_weights_finite()  # every rank: a NaN anywhere means no checkpoint at all
        main = self.is_world_process_zero()
        context = ckpt.atomic_checkpoint(self.args.output_dir, step) if main else None
        shared = [context.__enter__() if main else None]
        dist.broadcast_object_list(shared, src=0)
        failure = None
        try:
            t.save_checkpoint_files(shared[0])
            t.save_tokenizer(shared[0])  # rank 0, before the rename that commits the checkpoint
        except BaseException as err:  # every rank must still reach the barrier below
            failure = err
        if main:
            if failure is None:
                context.__exit__(None, None, None)  # fsync, rename into checkpoint-N
            else:
                context.__exit__(type(failure), failure, failure.__traceback__)  # removes the folder
            if failure is None:
                ckpt.rotate_checkpoints(self.args.output_dir, self.args.save_total_limit, keep=path)
        dist.barrier()
        if failure is not None:
            raise failure
        return path

    def model_state_for_saving(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_model(self, output_dir: Optional[str] = None) -> str:
        """Every rank calls it; rank 0 writes one Hugging Face checkpoint (and the tokenizer)."""
        output_dir = output_dir or self.args.output_dir
        if has_adapters(self.model):  # the trained adapter alone, gathered, in PEFT's format
            save_adapter_distributed(self.model, output_dir)
        else:
            save_pretrained_distributed(self.model, output_dir)  # gathers to rank 0
        self.trainer.save_tokenizer(output_dir)
        dist.barrier()
        return output_dir


__all__ = ["DistributedTraining"]
