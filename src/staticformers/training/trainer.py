"""`Trainer`: transformers' names, static shapes, a fixed set of compiled graphs, exact resume.

    trainer = Trainer(model=model, args=args, train_dataset=ds, eval_dataset=ev, processing_class=tok)
    trainer.train()                                # or train(resume_from_checkpoint=True)
    trainer.save_model("./final")                  # transformers loads it

Design choices:
- **Static shapes.** The dataset becomes a fixed table of `[max_length]` rows before training
  (`training/data.py`: padding or packing), and every batch is exactly
  `[per_device_train_batch_size, max_length]`. With `torch_compile=True` the forward pass and the
  loss compile as two regions (`training/step_functions.py`: one decoder layer shared by every layer, and
  the head with the loss; `fullgraph=True, dynamic=False`), AOTAutograd builds the backward, the
  optimizer runs eagerly: a fixed set of training and evaluation graphs per run, counted
  (`compile_stats()`).
- **The caller's model trains, in place.** It is never wrapped; its parameters are moved to the
  device and cast to the compute dtype in place, and at the end of `train()` they get back their
  original dtype holding the fp32 master values.
- **Precision** (`training/optim.py`): bf16 weights and activations with fp32 master weights and
  optimizer state when `bf16=True`; plain fp32 otherwise. AdamW with no decay on norms and biases.
- **Gradient accumulation** divides each micro-batch's summed loss by the token count of the
  whole accumulation window (`num_items_in_batch`), so it equals the larger batch.
- **Checkpoints** are folders written atomically (`training/checkpoint_folders.py`); resuming restores
  weights, optimizer, scheduler, RNG and the data position, and continues bit-identically.
- **A NaN or inf loss (or gradient norm)** stops training before the optimizer step, with a
  sentence naming the step; no checkpoint is written after it. NaN or inf weights stop it before a
  checkpoint is written (`guards.py`), so a checkpoint is never non-finite.

Every decision that depends on the process layout is a hook method: `setup_device`,
`data_parallel_info` (rank, world size), `is_world_process_zero`, `compute_dtype`, `prepare_model`,
`create_master_weights`, `create_optimizer`, `create_scheduler`, `get_train_sampler` (shards by
rank), `reduce_sum` (loss, token counts and eval sums across ranks), `compute_loss`,
`clip_gradients`, `save_checkpoint_files` / `load_checkpoint_files`, `save_model`. For a model
partitioned at load time (`model.parallel_dims` set), the Trainer holds a
`distributed.trainer.DistributedTraining` (`self.distributed`) and these hooks delegate to it; a
subclass may override any of them. What the device changes (the CPU's query-blocked attention, its
host-memory setting, the compile caches) comes from the device's backend (`staticformers.backends`).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
from torch import nn

from ..adapters.files import save_adapter
from ..adapters.lora import has_adapters, trainable_adapter
from ..backends import for_device
from ..checkpoints.names import names_for
from ..models.decoder import CausalLM
from ..utils.seeds import check_seed
from . import checkpoint_folders as ckpt
from .adapter_training import check_trainable, frozen_originals, restore_frozen
from .arguments import TrainingArguments
from .step_functions import StepFunction
from .chat_data import use_chat_template_file
from .data import RowTable, StaticBatchSampler, build_rows, count_label_tokens
from .guards import (
    TrainingDivergedError,
    check_batch_has_loss,
    check_finite_weights,
    check_labels,
    check_loss_tokens,
    check_max_length,
    check_step_memory,
    check_token_ids,
    rows_without_loss,
)
from .optim import MasterWeights, clip_grad_norm, create_adamw, create_scheduler, parameter_groups
from .plot import write_loss_curve
from .reporting import MetricsReporter, StepMeter, format_postfix, progress_bar
from .state import TrainerState, TrainOutput
from .state_files import (
    CorruptCheckpointError,
    apply_state,
    check_optimizer_state,
    check_scheduler_state,
    load_torch_file,
    read_weights,
)

logger = logging.getLogger("staticformers")

LOSS_CURVE = "loss_curve.png"


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices), as transformers' set_seed does."""
    check_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _Step(NamedTuple):
    """What one optimizer step gives the bookkeeping after it."""

    loss: float  # the window's loss per label token (its micro-batches' and ranks' parts summed)
    grad_norm: float  # the global norm, measured before clipping
    learning_rate: float  # the one the step used
    tokens: int  # label tokens in the window


@dataclass
class _Run:
    """One `train()` call: what its set-up fixed, what it gives back at the end, and its running numbers."""

    model: nn.Module  # what prepare_model() returned
    rows: RowTable
    sampler: StaticBatchSampler
    batches_per_epoch: int
    max_steps: int
    stats: dict  # the rows' stats (padding waste, loss-token share)
    main: bool  # this process writes files
    original_dtypes: dict  # id(parameter) -> its dtype before training
    frozen: dict  # frozen_originals(): the frozen parameters' own tensors, given back at the end
    bar: Any  # the progress bar
    meter: StepMeter
    saved_at: int = -1  # the step of the last checkpoint written


class Trainer:
    """Trains a causal LM on fixed-shape batches; see the module docstring."""

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        args: Optional[TrainingArguments] = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        optimizers: tuple = (None, None),
        tokenizer: Any = None,
    ):
        if model is None:
            raise ValueError(
                "Trainer needs a model: pass model=AutoModelForCausalLM.from_pretrained(...) or from_config(...)."
            )
        if processing_class is not None and tokenizer is not None:
            raise ValueError("Pass processing_class or its old name tokenizer, not both.")
        if data_collator is not None:
            logger.warning(
                "data_collator is not used: staticformers builds fixed-shape batches itself "
                "(TrainingArguments.max_length, packing)."
            )
        self.args = args if args is not None else TrainingArguments()
        check_max_length(self.args.max_length, getattr(model, "config", None))
        if self.args.eval_strategy != "no" and eval_dataset is None:
            raise ValueError(
                f'eval_strategy={self.args.eval_strategy!r} needs an eval_dataset: pass one, or eval_strategy="no".'
            )
        self.model = model
        self.processing_class = processing_class if processing_class is not None else tokenizer
        if self.args.chat_template_path is not None:  # as TRL: the tokenizer (and what save_model writes) gets it
            use_chat_template_file(self.processing_class, self.args.chat_template_path)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.optimizer, self.lr_scheduler = optimizers
        self._user_optimizer = self.optimizer is not None
        self.distributed = None  # a DistributedTraining for a partitioned model
        if isinstance(model, CausalLM) and model.parallel_dims is not None:  # loaded with distributed_config
            from .partitioned import DistributedTraining

            self.distributed = DistributedTraining(self)
        self.device = self.setup_device()
        self.backend = for_device(self.device)
        self.state = TrainerState()
        self.master: Optional[MasterWeights] = None
        # a partitioned model compiles per block (DistributedTraining.prepare_model); the step stays eager
        compiled = self.args.torch_compile and self.distributed is None
        ops = self.backend.training_ops(self.compute_dtype())
        self.train_step = StepFunction("train", compiled, self.args.torch_compile_backend, ops=ops)
        self.eval_step = StepFunction("eval", compiled, self.args.torch_compile_backend, ops=ops)
        self._train_rows: Optional[RowTable] = None
        self._rows_without_loss = 0  # training rows with no token that carries loss (counted with the rows)
        self._eval_rows: list[tuple[Any, RowTable]] = []  # (dataset, rows), matched by identity
        self._reporter: Optional[MetricsReporter] = None
        self.first_step_seconds: Optional[float] = None
        set_seed(self.args.seed)

    # =============================================================================================
    # hooks (the distributed layer overrides these)
    # =============================================================================================
    def setup_device(self) -> torch.device:
        """The device to train on: `args.device` (Neuron first, then CUDA, ..., the CPU), or the XLA device a
        model was loaded on (`device_map="xla"`: asked for by name, since "auto" never picks XLA's CPU plugin)."""
        if self.distributed is not None:
            return self.distributed.setup_device()
        placed = next((p.device for p in self.model.parameters()), None) if self.model is not None else None
        if placed is not None and for_device(placed).trains_where_loaded and not self.args.use_cpu:
            return placed
        return self.args.device

    def data_parallel_info(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel world size); one process here."""
        if self.distributed is not None:
            return self.distributed.data_parallel_info()
        return 0, 1

    def is_world_process_zero(self) -> bool:
        """Whether this process writes files (checkpoints, metrics, plots)."""
        if self.distributed is not None:
            return self.distributed.is_world_process_zero()
        return True

    def compute_dtype(self) -> torch.dtype:
        if self.distributed is not None:
            return self.distributed.compute_dtype()
        return torch.bfloat16 if self.args.bf16 else torch.float32

    def prepare_model(self) -> nn.Module:
        """Put the model on the device in the compute dtype (in place) and in train mode (a partitioned
        model: compiled per block when asked, `DistributedTraining.prepare_model`)."""
        if self.distributed is not None:
            return self.distributed.prepare_model()
        model = self.model
        model.to(self.device)
        dtype = self.compute_dtype()
        if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
            model.to(dtype)
        if self.args.gradient_checkpointing:
            if not hasattr(model, "gradient_checkpointing_enable"):
                raise ValueError(
                    f"gradient_checkpointing=True but {type(model).__name__} has no gradient_checkpointing_enable()."
                )
            model.gradient_checkpointing_enable()
        model.train()
        return model

    def create_master_weights(self, model: nn.Module) -> MasterWeights:
        """fp32 master copies of low-precision parameters (none when the model trains in fp32)."""
        if self.distributed is not None:
            return self.distributed.create_master_weights(model)
        if self._user_optimizer:
            return MasterWeights(model, copies=False)
        return MasterWeights(model)

    def create_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW over the master weights, no decay on norms and biases (unless one was passed in)."""
        if self._user_optimizer:
            return self.optimizer
        a = self.args
        groups = parameter_groups(model, self.master, a.weight_decay)
        return create_adamw(
            groups, a.learning_rate, (a.adam_beta1, a.adam_beta2), a.adam_epsilon, fused=a.optim == "adamw_torch_fused"
        )

    def create_scheduler(self, num_training_steps: int):
        """The learning-rate schedule (transformers' formulas), unless one was passed in."""
        if self._user_optimizer and self.lr_scheduler is not None:
            return self.lr_scheduler
        a = self.args
        return create_scheduler(
            self.optimizer,
            a.lr_scheduler_type,
            a.get_warmup_steps(num_training_steps),
            num_training_steps,
            **(a.lr_scheduler_kwargs or {}),
        )

    def get_train_rows(self) -> RowTable:
        """The training set as fixed `[max_length]` rows (built once per Trainer)."""
        if self._train_rows is None:
            if self.train_dataset is None:
                raise ValueError("Trainer.train() needs a train_dataset.")
            a = self.args
            rows = build_rows(
                self.train_dataset,
                self.processing_class,
                a.max_length,
                a.packing,
                a.packing_strategy,
                a.long_documents,
                a.assistant_only_loss,
                a.completion_only_loss,
            )
            self._check_rows(rows, "training data")
            check_loss_tokens(rows, "training data")
            self._rows_without_loss = rows_without_loss(rows.labels)
            if self._rows_without_loss:
                logger.warning(
                    "%d of the %d training rows have no token that carries loss (labels all -100 or a "
                    "single token): they only add padding to their batches.",
                    self._rows_without_loss,
                    rows.num_rows,
                )
            self._train_rows = rows
        return self._train_rows

    def _check_rows(self, rows: RowTable, what: str) -> None:
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is not None:
            check_token_ids(rows, vocab, what)
            check_labels(rows, vocab, what)

    def get_eval_rows(self, eval_dataset: Any = None) -> RowTable:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset: pass one to Trainer or to evaluate().")
        for cached, rows in self._eval_rows:  # by identity: a freed dataset's id() can be reused
            if cached is dataset:
                return rows
        a = self.args
        rows = build_rows(
            dataset,
            self.processing_class,
            a.max_length,
            a.packing,
            a.packing_strategy,
            a.long_documents,
            a.assistant_only_loss,
            a.completion_only_loss,
        )
        self._check_rows(rows, "evaluation data")
        self._eval_rows = self._eval_rows[-3:] + [(dataset, rows)]
        return rows

    def get_train_sampler(self, rows: RowTable) -> StaticBatchSampler:
        rank, world = self.data_parallel_info()
        return StaticBatchSampler(
            rows.num_rows,
            self.args.per_device_train_batch_size,
            shuffle=True,
            seed=self.args.seed,
            drop_last=self.args.dataloader_drop_last,
            rank=rank,
            world_size=world,
        )

    def get_eval_sampler(self, rows: RowTable) -> StaticBatchSampler:
        rank, world = self.data_parallel_info()
        return StaticBatchSampler(
            rows.num_rows,
            self.args.per_device_eval_batch_size,
            shuffle=False,
            drop_last=False,
            rank=rank,
            world_size=world,
        )

    def move_batch(self, batch: dict) -> dict:
        """The batch on the device; pinned first for a CUDA copy when `dataloader_pin_memory` (transformers' default)."""
        pin = self.args.dataloader_pin_memory and for_device(self.device).pin_memory
        return {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True) for k, v in batch.items()}

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over data-parallel ranks (identity with one process)."""
        if self.distributed is not None:
            return self.distributed.reduce_sum(value)
        return value

    def compute_loss(self, model: nn.Module, batch: dict, num_items_in_batch: torch.Tensor) -> torch.Tensor:
        """The (compiled) forward and loss of one micro-batch."""
        loss = self.train_step(model, batch, num_items_in_batch)
        return self.distributed.scale_loss(loss) if self.distributed is not None else loss

    def clip_gradients(self) -> torch.Tensor:
        """Global gradient norm of the master gradients, clipped to `max_grad_norm` (fp32)."""
        if self.distributed is not None:
            return self.distributed.clip_gradients()
        return clip_grad_norm(self.master.grads(), self.args.max_grad_norm)

    def model_state_for_saving(self) -> dict[str, torch.Tensor]:
        """Weights to write (transformers' names, CPU): the fp32 master weights while training."""
        if self.distributed is not None:
            return self.distributed.model_state_for_saving()
        if self.master is not None:
            return {n: m.detach().to("cpu").contiguous() for n, m in self.master.by_name().items()}
        from ..models.pretrained import export_state_dict

        return export_state_dict(self.model)

    def save_checkpoint_files(self, directory: str) -> None:
        """Write one checkpoint's files into `directory` (a temporary folder; trainer_state.json last)."""
        if self.distributed is not None:
            return self.distributed.save_checkpoint_files(directory)
        if has_adapters(self.model):  # the trained adapter alone, in PEFT's format
            save_adapter(self.model, directory, trainable_adapter(self.model), tensors=self.model_state_for_saving())
        else:
            from ..models.pretrained import save_pretrained

            save_pretrained(self.model, directory, state_dict=self.model_state_for_saving())
        # on the host: a device's own storage tag (an XLA device's) is one torch.load cannot map back
        host = torch.utils._pytree.tree_map(
            lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, self.optimizer.state_dict()
        )
        torch.save(host, os.path.join(directory, ckpt.OPTIMIZER))
        torch.save(self.lr_scheduler.state_dict(), os.path.join(directory, ckpt.SCHEDULER))
        torch.save(ckpt.capture_rng_state(self.device), os.path.join(directory, ckpt.RNG_STATE))
        with open(os.path.join(directory, ckpt.TRAINING_ARGS), "w", encoding="utf-8") as f:
            f.write(self.args.to_json_string())
        self.state.save_to_json(os.path.join(directory, ckpt.TRAINER_STATE))

    def load_checkpoint_files(self, directory: str) -> None:
        """Restore weights, optimizer, scheduler, RNG and state from a checkpoint folder; every file is read
        through the checked readers of `state_files` (one sentence naming a damaged or foreign file)."""
        if self.distributed is not None:
            return self.distributed.load_checkpoint_files(directory)
        # everything is read and checked before anything is applied: a refusal leaves the model as it was
        state = TrainerState.load_from_json(os.path.join(directory, ckpt.TRAINER_STATE))
        expected = {n: tuple(m.shape) for n, m in zip(self.master.names, self.master.master)}
        weights = read_weights(directory, expected, names_for(getattr(self.model, "config", None)))
        files = {name: os.path.join(directory, name) for name in (ckpt.OPTIMIZER, ckpt.SCHEDULER, ckpt.RNG_STATE)}
        target = self.device if self.backend.torch_load_maps else None  # else on the host; load_state_dict moves it
        loaded = {
            name: load_torch_file(path, target if name == ckpt.OPTIMIZER else None) for name, path in files.items()
        }
        check_scheduler_state(loaded[ckpt.SCHEDULER], files[ckpt.SCHEDULER], len(self.optimizer.param_groups))
        apply_state(files[ckpt.OPTIMIZER], "optimizer", self.optimizer.load_state_dict, loaded[ckpt.OPTIMIZER])
        check_optimizer_state(self.optimizer, files[ckpt.OPTIMIZER])
        apply_state(
            files[ckpt.SCHEDULER], "learning-rate scheduler", self.lr_scheduler.load_state_dict, loaded[ckpt.SCHEDULER]
        )
        apply_state(
            files[ckpt.RNG_STATE],
            "random number generators",
            lambda rng: ckpt.restore_rng_state(rng, self.device),
            loaded[ckpt.RNG_STATE],
        )
        self.master.load(weights)
        self.state = state

    # =============================================================================================
    # training
    # =============================================================================================
    def compile_stats(self) -> dict:
        """Graphs compiled (and seconds spent) by the training and evaluation functions (for a partitioned
        model, by its compiled blocks, training and evaluation together)."""
        stats = {
            "backend": self.args.torch_compile_backend if self.args.torch_compile else None,
            "train_graphs": self.train_step.graphs,
            "eval_graphs": self.eval_step.graphs,
            "train_compile_seconds": round(self.train_step.compile_seconds, 3),
            "eval_compile_seconds": round(self.eval_step.compile_seconds, 3),
        }
        if self.distributed is not None and self.distributed.block_counters:
            counters = self.distributed.block_counters
            stats["block_graphs"] = sum(c.graphs for c in counters)
            stats["block_compile_seconds"] = round(sum(c.seconds for c in counters), 3)
        return stats

    def _plan(self, batches_per_epoch: int) -> tuple[int, int]:
        """(optimizer steps per epoch, total optimizer steps)."""
        a = self.args
        steps_per_epoch = batches_per_epoch // a.gradient_accumulation_steps
        if steps_per_epoch == 0:
            rows = self.get_train_rows().num_rows
            raise ValueError(
                f"The training data gives {rows} rows, {batches_per_epoch} batch(es) of {a.per_device_train_batch_size}"
                f"{' (dataloader_drop_last=True drops a short last one)' if a.dataloader_drop_last else ''}, fewer than "
                f"gradient_accumulation_steps={a.gradient_accumulation_steps}: add data or lower the batch size or accumulation."
            )
        if a.max_steps > 0:
            return steps_per_epoch, a.max_steps
        return steps_per_epoch, max(1, math.ceil(a.num_train_epochs * steps_per_epoch))

    def train(self, resume_from_checkpoint: Any = None, **kwargs) -> TrainOutput:
        """Train to `max_steps` (or `num_train_epochs`); `resume_from_checkpoint=True|path` continues a run."""
        if kwargs:
            raise TypeError(f"train() got argument(s) it does not know: {', '.join(sorted(kwargs))}.")
        run = self._set_up(resume_from_checkpoint)
        try:
            while self.state.global_step < run.max_steps:
                self._train_epoch(run)
            if self.args.save_strategy != "no" and run.saved_at != self.state.global_step and run.meter.total_steps > 0:
                self._save_checkpoint()  # the last step, when no strategy saved it
        finally:
            run.bar.close()
            self._restore_dtypes(run.original_dtypes)
            restore_frozen(self.model, run.frozen)
        return self._finish(run)

    # ---- train(), in the order it runs ---------------------------------------------------------------
    def _set_up(self, resume_from_checkpoint: Any) -> _Run:
        """Everything before the first step: the rows, their sampler and the step plan; the checks that
        refuse before anything touches the model; the model prepared; the optimizer and the state, resumed
        (with its data position) from a checkpoint when asked; the metrics reporter and the progress bar."""
        a = self.args
        if resume_from_checkpoint is None:
            resume_from_checkpoint = a.resume_from_checkpoint
        resume_path = ckpt.resolve_resume_path(resume_from_checkpoint, a.output_dir)
        set_seed(a.seed)
        rows = self.get_train_rows()
        sampler = self.get_train_sampler(rows)
        batches_per_epoch = len(sampler)
        steps_per_epoch, max_steps = self._plan(batches_per_epoch)
        if resume_path is not None:
            self._check_resume_rows(resume_path, rows)
        check_step_memory(
            getattr(self.model, "config", None),
            a.per_device_train_batch_size,
            a.max_length,
            self.compute_dtype(),
            a.gradient_checkpointing,
            self.device,
        )
        check_trainable(self.model)
        # the caller's tensors, kept until set-up succeeds: a refusal below gives the model back as it was
        originals = {id(p): p.detach() for p in self.model.parameters()}
        original_dtypes = {k: t.dtype for k, t in originals.items()}
        self.model.zero_grad(set_to_none=True)
        model = self.prepare_model()
        frozen = frozen_originals(self.model, originals)  # given back at the end (a frozen base cast to bf16)
        self.backend.before_training()
        resume_path = self._start_state(
            model, originals, rows, steps_per_epoch, max_steps, resume_path, auto=resume_from_checkpoint is True
        )
        del originals
        if resume_path is not None:
            self.state.max_steps = max_steps
            self.state.last_checkpoint = resume_path
            logger.info(
                "Resuming from %s at step %d (epoch %d, batch %d).",
                resume_path,
                self.state.global_step,
                self.state.epoch_index,
                self.state.batches_in_epoch,
            )
        main = self.is_world_process_zero()
        self._reporter = MetricsReporter(a.output_dir, a.report_to, a.logging_dir, is_main=main)
        stats = rows.stats()
        self._log_start(stats, max_steps)
        bar = progress_bar(max_steps, self.state.global_step, disable=a.disable_tqdm or not main)
        return _Run(
            model, rows, sampler, batches_per_epoch, max_steps, stats, main, original_dtypes, frozen, bar, StepMeter()
        )

    def _log_start(self, stats: dict, max_steps: int) -> None:
        a = self.args
        logger.info(
            "Training on %s: %d rows of %d tokens (%s), padding waste %.2f%%, tokens with loss %.2f%%, "
            "%d steps of %d x %d x %d accumulation.",
            self.device,
            stats["rows"],
            stats["max_length"],
            stats["mode"],
            100 * stats["padding_waste"],
            100 * stats["loss_token_share"],
            max_steps,
            a.per_device_train_batch_size,
            a.max_length,
            a.gradient_accumulation_steps,
        )

    def _check_resume_rows(self, resume_path: str, rows: RowTable) -> None:
        """Refuse a checkpoint trained on another number of rows (its data position would mean other data)."""
        saved = TrainerState.load_from_json(os.path.join(resume_path, ckpt.TRAINER_STATE))
        if saved.train_rows != rows.num_rows:
            raise ValueError(
                f"{resume_path} was trained on {saved.train_rows} rows of data but this dataset gives {rows.num_rows}: "
                f"resume with the same dataset, max_length and packing, or start a new run."
            )

    def _start_state(
        self,
        model: nn.Module,
        originals: dict,
        rows: RowTable,
        steps_per_epoch: int,
        max_steps: int,
        resume_path: Optional[str],
        auto: bool,
    ) -> Optional[str]:
        """Master weights, optimizer, schedule and a new `TrainerState`, then the checkpoint's when resuming;
        returns the checkpoint loaded. If any of it fails, the caller's parameters get their own tensors back."""
        a = self.args
        try:
            self.master = self.create_master_weights(model)
            self.master.adopt(originals)
            self.optimizer = self.create_optimizer(model)
            self.lr_scheduler = self.create_scheduler(max_steps)
            self.state = TrainerState(
                max_steps=max_steps,
                num_train_epochs=math.ceil(max_steps / steps_per_epoch),
                logging_steps=a.resolved_steps(a.logging_steps, max_steps),
                eval_steps=a.resolved_steps(a.eval_steps if a.eval_steps is not None else a.logging_steps, max_steps),
                save_steps=a.resolved_steps(a.save_steps, max_steps),
                train_batch_size=a.per_device_train_batch_size,
                gradient_accumulation_steps=a.gradient_accumulation_steps,
                train_rows=rows.num_rows,
            )
            if resume_path is not None:
                resume_path = self._load_resume(resume_path, auto=auto)
        except BaseException:
            with torch.no_grad():
                for p in self.model.parameters():
                    o = originals.get(id(p))
                    if o is not None and p.dtype != o.dtype and p.shape == o.shape:
                        p.data = o
            raise
        return resume_path

    def _train_epoch(self, run: _Run) -> None:
        """The optimizer steps of the current epoch, from its data position, until the epoch or `max_steps`
        ends."""
        state, ga = self.state, self.args.gradient_accumulation_steps
        run.sampler.set_epoch(state.epoch_index)
        order = list(run.sampler)
        pos = state.batches_in_epoch
        while pos + ga <= run.batches_per_epoch and state.global_step < run.max_steps:
            step_start = time.perf_counter()
            step = self._optimizer_step(run.model, [run.rows.batch(ix) for ix in order[pos : pos + ga]])
            pos += ga
            self._after_step(run, pos, step, step_start)
        if pos + ga > run.batches_per_epoch and state.batches_in_epoch != 0:  # defensive: leftover micro-batches
            state.epoch_index, state.batches_in_epoch = state.epoch_index + 1, 0

    def _optimizer_step(self, model: nn.Module, host: list) -> _Step:
        """One optimizer step over the accumulation window's micro-batches (`host`: on the host). Each one's
        forward and backward, its summed loss divided by the window's label tokens; the gradient norm,
        clipped; a NaN or inf loss or norm stops training before the optimizer step; then the optimizer
        and the schedule step and the gradients are dropped."""
        items = sum(count_label_tokens(b["labels"]) for b in host)
        tokens = sum(int((b["labels"] != -100).sum()) for b in host)
        total = int(self.reduce_sum(torch.tensor(items, dtype=torch.long, device=self.device)))
        check_batch_has_loss(
            total,
            self.state.global_step + 1,
            self._rows_without_loss,
            self._train_rows.num_rows if self._train_rows is not None else 0,
        )
        num_items = torch.tensor(total, dtype=torch.long, device=self.device)
        step_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for batch in host:
            loss = self.compute_loss(model, self.move_batch(batch), num_items)
            loss.backward()
            self.master.collect_grads()
            step_loss += loss.detach().float()
        grad_norm = self.clip_gradients()
        loss_value = float(self.reduce_sum(step_loss))
        norm_value = float(grad_norm)
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.optimizer.zero_grad(set_to_none=True)  # no NaN gradient outlives the refused step
            model.zero_grad(set_to_none=True)
            self._diverged(self.state.global_step + 1, loss_value, norm_value)
        self.optimizer.step()
        self.master.push()
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        self.backend.flush(self.device)  # a lazily traced device runs the optimizer step as a graph of its own
        return _Step(loss_value, norm_value, lr, tokens)

    def _after_step(self, run: _Run, pos: int, step: _Step, step_start: float) -> None:
        """Bookkeeping after an optimizer step that ended at micro-batch `pos`: the step count and data
        position, the meters and the progress bar; then a log record, an evaluation and a checkpoint (with
        rotation) when their strategies say so."""
        a, state = self.args, self.state
        state.global_step += 1
        if (
            pos + a.gradient_accumulation_steps > run.batches_per_epoch
        ):  # this epoch is done: a resume starts the next one
            state.epoch_index, state.batches_in_epoch = state.epoch_index + 1, 0
            state.epoch = float(state.epoch_index)
        else:
            state.batches_in_epoch = pos
            state.epoch = state.epoch_index + pos / run.batches_per_epoch
        state.seen_tokens += step.tokens
        now = time.perf_counter()
        if self.first_step_seconds is None:
            self.first_step_seconds = now - step_start
        rate = run.meter.add(step.loss, step.tokens, step_start, now)
        run.bar.update(1)
        run.bar.set_postfix(format_postfix(step.loss, step.learning_rate, rate), refresh=False)
        done = state.global_step
        epoch_end = state.batches_in_epoch == 0
        if self._log_now(done, run.max_steps, epoch_end):
            loss, tokens_per_second = run.meter.take_window(now)
            self.log(
                {
                    "loss": round(loss, 6),
                    "grad_norm": round(step.grad_norm, 6),
                    "learning_rate": step.learning_rate,
                    "tokens_per_second": round(tokens_per_second, 2),
                }
            )
        if self.eval_dataset is not None and (
            (a.eval_strategy == "steps" and done % state.eval_steps == 0) or (a.eval_strategy == "epoch" and epoch_end)
        ):
            self.evaluate()
        if (a.save_strategy == "steps" and done % state.save_steps == 0) or (a.save_strategy == "epoch" and epoch_end):
            self._save_checkpoint()
            run.saved_at = done

    def _finish(self, run: _Run) -> TrainOutput:
        """The run's metrics, logged; the loss curve drawn; the reporter closed."""
        metrics = self._train_metrics(run)
        self.log(metrics)
        if run.main:
            self.write_loss_curve()
        if self._reporter is not None:
            self._reporter.close()
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _train_metrics(self, run: _Run) -> dict:
        """transformers' `train_*` metrics of the run (runtime, samples, steps and tokens per second, the mean
        loss), with the steady-state token rate, the first step's seconds, the data's padding waste and
        loss-token share, and the compile counts."""
        a, m = self.args, run.meter
        runtime = time.perf_counter() - m.run_start
        steady_seconds = (time.perf_counter() - m.steady_start) if m.steady_start is not None else 0.0
        samples = m.total_steps * a.gradient_accumulation_steps * a.per_device_train_batch_size
        return {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
            "train_steps_per_second": round(m.total_steps / max(runtime, 1e-9), 3),
            "train_tokens_per_second": round(m.total_tokens / max(runtime, 1e-9), 2),
            "train_steady_tokens_per_second": round(m.steady_tokens / steady_seconds, 2) if m.steady_tokens else None,
            "train_first_step_seconds": round(self.first_step_seconds or 0.0, 4),
            "train_loss": m.total_loss / max(m.total_steps, 1),
            "train_padding_waste": run.stats["padding_waste"],
            "train_loss_token_share": run.stats["loss_token_share"],
            **{k: v for k, v in self.compile_stats().items() if k != "backend"},
        }

    def _load_resume(self, path: str, auto: bool) -> str:
        """Load checkpoint `path`; with resume_from_checkpoint=True a checkpoint that fails to load is
        skipped for the next older good one, with a warning saying why. Returns the one loaded."""
        while True:
            try:
                self.load_checkpoint_files(path)
                return path
            except CorruptCheckpointError as err:
                older = ckpt.previous_good_checkpoint(self.args.output_dir, path) if auto else None
                if older is None:
                    raise
                logger.warning("Checkpoint %s cannot be resumed from (%s); resuming from %s instead.", path, err, older)
                path = older

    def _log_now(self, step: int, max_steps: int, epoch_end: bool) -> bool:
        """Whether this step writes a training log record (`logging_strategy`, `logging_steps`, `logging_first_step`;
        the last step always does, so a run's loss is never lost)."""
        a = self.args
        if step == max_steps or (a.logging_first_step and step == 1):
            return True
        if a.logging_strategy == "steps":
            return step % self.state.logging_steps == 0
        return a.logging_strategy == "epoch" and epoch_end

    def _restore_dtypes(self, original: dict) -> None:
        """Give each parameter back its original dtype, holding the fp32 master value."""
        if self.master is None:
            return
        with torch.no_grad():
            for p, m in zip(self.master.params, self.master.master):
                dtype = original.get(id(p), p.dtype)
                if p.dtype != dtype:
                    p.data = m.detach().to(dtype) if m.dtype != dtype else m.detach().clone()

    def _diverged(self, step: int, loss: float, norm: float) -> None:
        what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {norm}"
        last = ckpt.last_good_checkpoint(self.args.output_dir)
        self.log({"diverged_at_step": step, "loss": loss if math.isfinite(loss) else None})
        raise TrainingDivergedError(
            f"Training stopped at step {step}: {what}; that step was not applied and no checkpoint was written after it "
            f"(the last good checkpoint is {last or 'none'}). Lower learning_rate, check the data, or use bf16=False, "
            f"then resume_from_checkpoint."
        )

    def check_weights_finite(self) -> None:
        """Before a checkpoint: every master weight finite (on every rank), else stop; never a NaN checkpoint."""
        check_finite_weights(
            self.master.by_name().items(),
            self.state.global_step,
            lambda: ckpt.last_good_checkpoint(self.args.output_dir),
            self.device,
        )

    def _save_checkpoint(self) -> str:
        if self.distributed is not None:
            return self.distributed.save_checkpoint()
        step = self.state.global_step
        path = ckpt.checkpoint_path(self.args.output_dir, step)
        self.check_weights_finite()
        if self.is_world_process_zero():
            with ckpt.atomic_checkpoint(self.args.output_dir, step) as tmp:
                self.state.last_checkpoint = path
                self.save_checkpoint_files(tmp)
                self.save_tokenizer(tmp)  # inside: the rename commits everything the checkpoint holds
            ckpt.rotate_checkpoints(self.args.output_dir, self.args.save_total_limit, keep=path)
        self.state.last_checkpoint = path
        return path

    # =============================================================================================
    # evaluation, logging, saving
    # =============================================================================================
    @torch.no_grad()
    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict:
        """Mean token loss and perplexity over the evaluation set, on fixed-shape batches."""
        rows = self.get_eval_rows(eval_dataset)
        model = self.model
        if self.master is None:  # not training: only make sure the model is on the device
            model.to(self.device)
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        count = 0
        one = torch.tensor(1, dtype=torch.long, device=self.device)
        for indices in self.get_eval_sampler(rows):
            batch = rows.batch(indices)
            count += count_label_tokens(batch["labels"])
            total += self.eval_step(model, self.move_batch(batch), one).float()
        total = self.reduce_sum(total)
        count = int(self.reduce_sum(torch.tensor(count, device=self.device)))
        if was_training:
            model.train()
        loss = float(total) / max(count, 1)
        metrics = {
            f"{metric_key_prefix}_loss": loss,
            f"{metric_key_prefix}_perplexity": math.exp(min(loss, 700.0)) if math.isfinite(loss) else float("inf"),
            f"{metric_key_prefix}_runtime": round(time.perf_counter() - start, 4),
            f"{metric_key_prefix}_tokens": count,
        }
        self.log(metrics)
        return metrics

    def log(self, logs: dict) -> None:
        """Add `epoch` and `step`, append to `state.log_history`, metrics.jsonl and TensorBoard."""
        record = dict(logs)
        record["epoch"] = round(self.state.epoch, 4)
        record["step"] = self.state.global_step
        if self._reporter is None:
            self._reporter = MetricsReporter(
                self.args.output_dir, self.args.report_to, self.args.logging_dir, is_main=self.is_world_process_zero()
            )
        self._reporter.log(self.state.log_history, record)

    def write_loss_curve(self, path: Optional[str] = None) -> Optional[str]:
        """Draw the loss curve of `state.log_history` as a PNG (default `output_dir/loss_curve.png`); None
        when matplotlib (the `plot` extra) is not installed, which is said once."""
        path = path or os.path.join(self.args.output_dir, LOSS_CURVE)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return write_loss_curve(path, self.state.log_history, title=self.args.run_name or "Training")

    def save_tokenizer(self, directory: str) -> None:
        tok = self.processing_class
        if tok is None or not self.is_world_process_zero():
            return
        if hasattr(tok, "save_pretrained"):
            tok.save_pretrained(directory)
        elif hasattr(tok, "save") and hasattr(tok, "encode_batch"):  # a tokenizers.Tokenizer
            os.makedirs(directory, exist_ok=True)
            tok.save(os.path.join(directory, "tokenizer.json"))

    def save_model(self, output_dir: Optional[str] = None) -> str:
        """The model (and tokenizer) in Hugging Face format, which transformers loads."""
        if self.distributed is not None:
            return self.distributed.save_model(output_dir)
        from ..models.pretrained import save_pretrained

        output_dir = output_dir or self.args.output_dir
        if self.is_world_process_zero():
            if has_adapters(self.model):
                save_adapter(self.model, output_dir, trainable_adapter(self.model))
            elif hasattr(self.model, "save_pretrained"):
                save_pretrained(self.model, output_dir)
            else:
                raise ValueError(
                    f"{type(self.model).__name__} has no save_pretrained: save_model needs a staticformers CausalLM."
                )
            self.save_tokenizer(output_dir)
        return output_dir


__all__ = ["Trainer", "TrainingArguments", "TrainingDivergedError", "set_seed", "TrainOutput", "TrainerState"]
