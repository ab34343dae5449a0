"""transformers' everyday `TrainingArguments` names: what each one does here, or why it is refused.

Scripts written for transformers pass these names every day. `TrainingArguments` declares them all
(so no script fails with "unexpected keyword argument"), and `check_transformers_names` is called
from its `__post_init__`:

- **applied**: `evaluation_strategy` (transformers 4's name of `eval_strategy`), `logging_strategy`,
  `lr_scheduler_kwargs` (cosine's `num_cycles`), `optim` (the AdamW variants), `tf32` (CUDA matmuls
  and cuDNN), `dataloader_pin_memory` (batches pinned before a CUDA copy), `gradient_checkpointing_kwargs`
  (`use_reentrant=False`, the one variant used), `run_name` (the loss curve's title), `label_names`
  (`["labels"]`), `remove_unused_columns=True` (only `input_ids`, `labels` or `text` are read),
  `ddp_backend` (when it is the device's), `do_train`/`do_eval`/`do_predict` (kept for the caller's
  script, which is all transformers does with them);
- **refused with one sentence saying why** (the non-default values): `fp16`, `fp16_full_eval` (use bf16),
  `push_to_hub`, `dataloader_num_workers`/`_persistent_workers`/`_prefetch_factor` (no DataLoader:
  the rows are a table built before training), `remove_unused_columns=False`, `auto_find_batch_size`
  (the batch size is part of every compiled shape), `load_best_model_at_end`/`metric_for_best_model`/
  `save_strategy="best"`, `label_smoothing_factor`, `optim_args`, and the `ddp_*` options of
  `DistributedDataParallel`, which is not used (data parallelism is FSDP2 through `DistributedConfig`).
"""

from __future__ import annotations

from typing import Any

from ..backends import for_device

OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
LOGGING_STRATEGIES = ("no", "steps", "epoch")
SCHEDULER_KWARGS = {"cosine": ("num_cycles",)}  # the keyword arguments each schedule takes (transformers' names)
# what transformers' report_to accepts besides tensorboard: named so the refusal can say what to do instead
INTEGRATIONS = (
    "azure_ml",
    "clearml",
    "codecarbon",
    "comet_ml",
    "dagshub",
    "dvclive",
    "flyte",
    "mlflow",
    "neptune",
    "swanlab",
    "trackio",
    "wandb",
)
DDP_ONLY = ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph")


def _refuse(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not supported: {why}.")


def check_transformers_names(args) -> None:
    """Validate (and, for the aliases, resolve) transformers' names on a `TrainingArguments`."""
    if args.evaluation_strategy is not None:
        if args.eval_strategy not in ("no", args.evaluation_strategy):
            raise ValueError(
                f"evaluation_strategy={args.evaluation_strategy!r} and eval_strategy={args.eval_strategy!r} "
                f"disagree: pass only eval_strategy (evaluation_strategy is its old name)."
            )
        args.eval_strategy = args.evaluation_strategy
    if args.fp16 or args.fp16_full_eval:
        name = "fp16" if args.fp16 else "fp16_full_eval"
        raise _refuse(
            name,
            True,
            "train with bf16=True instead (every Trainium generation, recent CPUs and CUDA GPUs "
            "have bfloat16, which keeps fp32's exponent range and needs no loss scaling)",
        )
    if args.optim not in OPTIMIZERS:
        raise _refuse(
            "optim",
            args.optim,
            'the Trainer uses torch\'s AdamW ("adamw_torch_fused" or "adamw_torch"); '
            "pass another optimizer yourself with Trainer(optimizers=(optimizer, scheduler))",
        )
    if args.optim_args:
        raise _refuse(
            "optim_args",
            args.optim_args,
            "it configures optimizers other than AdamW; set adam_beta1, adam_beta2 and adam_epsilon instead",
        )
    if args.logging_strategy not in LOGGING_STRATEGIES:
        raise _refuse("logging_strategy", args.logging_strategy, f"use one of {', '.join(LOGGING_STRATEGIES)}")
    _check_scheduler_kwargs(args)
    if args.tf32:
        if not for_device(args.device).tf32:
            raise _refuse(
                "tf32",
                True,
                f"TF32 is a CUDA matmul mode and training runs on {args.device}; drop tf32 "
                f"(or use bf16=True for fast matmuls)",
            )
    if args.gradient_checkpointing_kwargs:
        unknown = sorted(set(args.gradient_checkpointing_kwargs) - {"use_reentrant"})
        if unknown or args.gradient_checkpointing_kwargs.get("use_reentrant", False):
            raise _refuse(
                "gradient_checkpointing_kwargs",
                args.gradient_checkpointing_kwargs,
                "layers are checkpointed with use_reentrant=False, the variant PyTorch recommends; "
                'pass {"use_reentrant": False} or nothing',
            )
    if args.dataloader_num_workers:
        raise _refuse(
            "dataloader_num_workers",
            args.dataloader_num_workers,
            "there is no DataLoader to parallelise: the data becomes a table of fixed-shape rows before "
            "training and each batch is a slice of it; drop it (0 is accepted)",
        )
    for name, default in (("dataloader_persistent_workers", False), ("dataloader_prefetch_factor", None)):
        if getattr(args, name) != default:
            raise _refuse(
                name,
                getattr(args, name),
                "there are no data-loading workers: each batch is a slice of a "
                "table of rows built before training; drop it",
            )
    if not args.remove_unused_columns:
        raise _refuse(
            "remove_unused_columns",
            False,
            "no data_collator sees the dataset's columns: rows are built "
            "from input_ids (+ labels) or text alone; drop it",
        )
    if args.label_names not in (None, ["labels"], ("labels",)):
        raise _refuse(
            "label_names",
            args.label_names,
            'labels come from a "labels" column (or are the input_ids '
            "shifted when there is none); rename the column to labels",
        )
    if args.push_to_hub:
        raise _refuse(
            "push_to_hub",
            True,
            "staticformers does not upload; after training, upload output_dir with "
            "huggingface_hub (HfApi().upload_folder or `hf upload`)",
        )
    if args.auto_find_batch_size:
        raise _refuse(
            "auto_find_batch_size",
            True,
            "the batch size is part of every compiled shape; set "
            "per_device_train_batch_size (and gradient_accumulation_steps) yourself",
        )
    for name, value in (
        ("load_best_model_at_end", args.load_best_model_at_end),
        ("metric_for_best_model", args.metric_for_best_model),
        ("greater_is_better", args.greater_is_better),
        ("save_strategy", "best" if args.save_strategy == "best" else None),
    ):
        if value:
            raise _refuse(
                name,
                value,
                "the Trainer keeps the last checkpoints, not the best; pick one by eval_loss in "
                "each checkpoint's trainer_state.json (log_history) and load that folder",
            )
    if args.label_smoothing_factor:
        raise _refuse(
            "label_smoothing_factor",
            args.label_smoothing_factor,
            "the compiled loss is the plain token cross-entropy; drop it (0 is accepted)",
        )
    for name in DDP_ONLY:
        if getattr(args, name) is not None:
            raise _refuse(
                name,
                getattr(args, name),
                "DistributedDataParallel is not used (data parallelism is FSDP2 "
                "through DistributedConfig under torchrun); drop it",
            )
    if args.ddp_backend is not None:
        from ..backends.devices import dist_backend_for

        wanted = dist_backend_for(args.device)
        if args.ddp_backend != wanted:
            raise _refuse(
                "ddp_backend",
                args.ddp_backend,
                f"the process group starts with {args.device}'s backend "
                f"{wanted!r}; drop it, or start torch.distributed yourself "
                f"before loading the model",
            )
    if args.ddp_timeout != 1800:
        raise _refuse(
            "ddp_timeout",
            args.ddp_timeout,
            "the process group is started when the model loads "
            "(from_pretrained(distributed_config=...)); call "
            "torch.distributed.init_process_group(timeout=...) before that",
        )


def _check_scheduler_kwargs(args) -> None:
    kwargs = args.lr_scheduler_kwargs
    if not kwargs:
        return
    if not isinstance(kwargs, dict):
        raise _refuse("lr_scheduler_kwargs", kwargs, 'pass a dict such as {"num_cycles": 0.5}')
    known = SCHEDULER_KWARGS.get(args.lr_scheduler_type, ())
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        takes = f"takes {', '.join(known)}" if known else "takes none"
        raise _refuse("lr_scheduler_kwargs", kwargs, f"lr_scheduler_type={args.lr_scheduler_type!r} {takes}")


def apply_tf32(device, tf32) -> None:
    """transformers' rule: tf32=True/False sets CUDA's matmul and cuDNN TF32 flags (process-wide); None leaves them."""
    if tf32 is None or not for_device(device).tf32:
        return
    for_device(device).set_tf32(bool(tf32))


def report_to_refusal(item: str) -> ValueError:
    if item in INTEGRATIONS:
        return _refuse(
            "report_to",
            item,
            "metrics go to output_dir/metrics.jsonl (one JSON line per log) and to "
            'TensorBoard with report_to="tensorboard"; send them on from there',
        )
    return _refuse("report_to", item, 'use "none", "tensorboard" or "all"')


__all__ = ["check_transformers_names", "apply_tf32", "report_to_refusal", "OPTIMIZERS", "LOGGING_STRATEGIES"]
