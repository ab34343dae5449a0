"""`TrainingArguments`: transformers' names and meanings, plus TRL's `max_length`, `packing`,
`assistant_only_loss`, `completion_only_loss` and `chat_template_path` (SFTConfig's meanings and defaults).

What differs from transformers, on purpose:
- The device is found by `staticformers.backends.devices.resolve_device("auto")`: Neuron first, then CUDA,
  XPU, MPS and the CPU (`use_cpu=True` forces the CPU). `torch_compile_backend` defaults to the
  device's backend: `"neuron"` on Neuron, `"inductor"` elsewhere.
- Shapes are static: every training batch is `[per_device_train_batch_size, max_length]`, padded or
  packed. `dataloader_drop_last` defaults to **True** (transformers: False) so that no ragged last
  batch ever reaches the compiled graph; with False the last batch is filled up with empty rows
  (labels all -100) instead of being shorter, so the shape still never changes.
- `bf16=True` trains with bf16 weights and activations and fp32 master weights and optimizer
  state (see `training/optim.py`).
- transformers' other everyday names (`fp16`, `tf32`, `optim`, `lr_scheduler_kwargs`,
  `dataloader_num_workers`, `push_to_hub`, ...) are accepted: applied where they mean something here,
  refused with a sentence where they do not (`training/transformers_names.py` lists which).

Contradictory or invalid values are refused with one sentence saying what to change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..utils.seeds import check_seed
from .transformers_names import apply_tf32, check_transformers_names, report_to_refusal

logger = logging.getLogger("staticformers")

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
STRATEGIES = ("no", "steps", "epoch")
REPORTERS = ("tensorboard",)
PACKING_STRATEGIES = ("bfd", "wrapped")
LONG_DOCUMENTS = ("split", "truncate")


MAX_LEARNING_RATE = 1.0  # above this no AdamW run trains; 1e30 was accepted and wrote NaN checkpoints
_BOOLEANS = (
    "logging_first_step",
    "bf16",
    "torch_compile",
    "dataloader_drop_last",
    "use_cpu",
    "gradient_checkpointing",
    "packing",
)
_OPTIONAL_BOOLEANS = ("disable_tqdm",)  # None: transformers' default behaviour
_NUMBERS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "num_train_epochs",
    "warmup_ratio",
    "logging_steps",
    "save_steps",
)


def _integer(name: str, value, minimum: int, what: str = "a positive integer") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        if name == "max_steps":
            what = "a positive number of optimizer steps, or -1 to train num_train_epochs"
        raise ValueError(f"{name}={value!r} must be {what}.")


def _finite(name: str, value, none_hint: bool = False) -> None:
    """A real number (int or float, not a bool or a string) that is neither NaN nor infinite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (not a string: drop the quotes)" if isinstance(value, str) else ""
        raise ValueError(f"{name}={value!r} must be a number{hint}.")
    if not math.isfinite(value):
        hint = "; pass 0 or None for no clipping" if none_hint else ""
        raise ValueError(f"{name}={value!r} must be a finite number{hint}.")


@dataclass
class TrainingArguments:
    """Arguments of `Trainer`, with transformers' names and defaults unless the module docstring says otherwise."""

    output_dir: str = "trainer_output"
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0  # below 1: a fraction of the run (transformers 5)
    warmup_ratio: float = 0.0
    logging_steps: float = 500
    logging_first_step: bool = False
    eval_strategy: str = "no"
    eval_steps: Optional[float] = None
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: Optional[int] = None
    seed: int = 42
    bf16: bool = False
    torch_compile: bool = False
    torch_compile_backend: Optional[str] = None
    dataloader_drop_last: bool = True  # True here (transformers: False): no ragged batch, no new shape
    use_cpu: bool = False
    report_to: Union[str, list, None] = "none"
    logging_dir: Optional[str] = None
    gradient_checkpointing: bool = False
    disable_tqdm: Optional[bool] = None  # None: the bar shows (transformers: unless the log level hides it)
    resume_from_checkpoint: Optional[str] = None
    # transformers' everyday names: applied, or refused with a sentence (training/transformers_names.py)
    run_name: Optional[str] = None
    logging_strategy: str = "steps"
    evaluation_strategy: Optional[str] = None  # transformers 4's name of eval_strategy
    optim: str = "adamw_torch_fused"
    optim_args: Optional[str] = None
    lr_scheduler_kwargs: Optional[dict] = None
    fp16: bool = False
    fp16_full_eval: bool = False
    tf32: Optional[bool] = None
    gradient_checkpointing_kwargs: Optional[dict] = None
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: Optional[int] = None
    remove_unused_columns: bool = True
    label_names: Optional[list] = None
    label_smoothing_factor: float = 0.0
    auto_find_batch_size: bool = False
    load_best_model_at_end: bool = False
    metric_for_best_model: Optional[str] = None
    greater_is_better: Optional[bool] = None
    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    hub_token: Optional[str] = None
    ddp_backend: Optional[str] = None
    ddp_timeout: int = 1800
    ddp_find_unused_parameters: Optional[bool] = None
    ddp_bucket_cap_mb: Optional[int] = None
    ddp_broadcast_buffers: Optional[bool] = None
    ddp_static_graph: Optional[bool] = None
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    local_rank: int = -1  # torchrun's LOCAL_RANK decides; kept for scripts that pass it
    # as in TRL's SFTConfig
    max_length: int = 1024
    packing: bool = False
    packing_strategy: str = "bfd"  # best-fit decreasing (documents kept whole) or "wrapped" (split at row ends)
    assistant_only_loss: bool = False  # loss only on the tokens the chat template's {% generation %} blocks mark
    completion_only_loss: Optional[bool] = None  # None: loss on the completion only for prompt-completion data
    chat_template_path: Optional[str] = (
        None  # a .jinja file or a tokenizer folder whose chat template replaces the tokenizer's
    )
    # staticformers: what padding mode does with a document longer than max_length
    long_documents: str = "split"  # "split" into max_length pieces, or "truncate" (keep the start)

    def __post_init__(self) -> None:
        self._device: Optional[torch.device] = None
        self._check()
        apply_tf32(self.device, self.tf32)
        if self.torch_compile_backend is None:
            from ..backends.devices import default_backend

            self.torch_compile_backend = default_backend(
                self.device
            )  # $STATICFORMERS_COMPILE_BACKEND, else the device's
        if self.bf16:
            from ..backends.devices import supports_bf16

            if not supports_bf16(self.device):
                raise ValueError(
                    f"bf16=True but {self.device} does not support bfloat16: pass bf16=False (or use_cpu=True)."
                )
        if self.logging_dir is None:
            self.logging_dir = os.path.join(self.output_dir, "runs")

    # ---- validation --------------------------------------------------------------------------
    def _check(self) -> None:
        """transformers' names first, then types (a string, a bool or NaN where a number belongs), then ranges
        and combinations."""
        check_transformers_names(self)
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "max_length",
        ):
            _integer(name, getattr(self, name), minimum=1)
        _integer("max_steps", self.max_steps, minimum=-1)
        _finite("warmup_steps", self.warmup_steps)
        if self.warmup_steps < 0 or (self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps)):
            raise ValueError(
                f"warmup_steps={self.warmup_steps!r} must be a whole number of steps, or below 1 for a "
                f"fraction of the run (transformers 5)."
            )
        check_seed(self.seed)
        if self.save_total_limit is not None:
            _integer(
                "save_total_limit",
                self.save_total_limit,
                minimum=1,
                what="an integer of at least 1, or None to keep every checkpoint",
            )
        for name in _BOOLEANS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")
        for name in _OPTIONAL_BOOLEANS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True, False or None.")
        for name in _NUMBERS:
            _finite(name, getattr(self, name))
        for name in ("max_grad_norm", "eval_steps"):
            if getattr(self, name) is not None:
                _finite(name, getattr(self, name), none_hint=name == "max_grad_norm")
        if not isinstance(self.output_dir, (str, os.PathLike)) or not os.fspath(self.output_dir):
            raise ValueError("output_dir is empty: pass the folder where checkpoints and metrics go.")
        if self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} leaves nothing to predict: use at least 2.")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate={self.learning_rate!r} must be a finite number >= 0.")
        if self.learning_rate > MAX_LEARNING_RATE:
            raise ValueError(
                f"learning_rate={self.learning_rate!r} is far above any AdamW learning rate (typically "
                f"1e-5 to 1e-3): use at most {MAX_LEARNING_RATE:g}."
            )
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} is negative: use 0 or more.")
        if self.learning_rate * self.weight_decay >= 1:
            raise ValueError(
                f"learning_rate x weight_decay = {self.learning_rate * self.weight_decay:g}: AdamW multiplies "
                f"the weights by 1 - that each step, which zeroes or flips them; use a weight_decay below "
                f"{1 / self.learning_rate:g} (typically 0 to 0.1)."
            )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1).")
        if self.adam_epsilon <= 0:
            raise ValueError(f"adam_epsilon={self.adam_epsilon} must be positive.")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(
                f"max_grad_norm={self.max_grad_norm} is negative: use a positive norm, or 0/None for no clipping."
            )
        if self.max_steps == 0 or (self.max_steps < 0 and self.max_steps != -1):
            raise ValueError(
                f"max_steps={self.max_steps}: use a positive number of optimizer steps, or -1 to train num_train_epochs."
            )
        if self.max_steps < 0 and not self.num_train_epochs > 0:
            raise ValueError(
                f"num_train_epochs={self.num_train_epochs} with max_steps=-1 trains nothing: set one of them."
            )
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ValueError(
                f"lr_scheduler_type={self.lr_scheduler_type!r} is not supported: use one of {', '.join(SCHEDULERS)}."
            )
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1].")
        if self.warmup_steps > 0 and self.warmup_ratio > 0:
            raise ValueError("Pass warmup_steps or warmup_ratio, not both.")
        if self.lr_scheduler_type == "constant" and (self.warmup_steps or self.warmup_ratio):
            raise ValueError(
                'lr_scheduler_type="constant" has no warmup: use "constant_with_warmup" or drop the warmup.'
            )
        for name in ("eval_strategy", "save_strategy"):
            value = getattr(self, name)
            if value not in STRATEGIES:
                raise ValueError(f"{name}={value!r} is not supported: use one of {', '.join(STRATEGIES)}.")
        if self.logging_steps <= 0:
            raise ValueError(f"logging_steps={self.logging_steps} must be positive.")
        if self.save_strategy == "steps" and not self.save_steps > 0:
            raise ValueError(f'save_strategy="steps" needs save_steps > 0 (got {self.save_steps}).')
        if self.eval_steps is not None and not self.eval_steps > 0:
            raise ValueError(f"eval_steps={self.eval_steps} must be positive.")
        if self.packing_strategy not in PACKING_STRATEGIES:
            raise ValueError(
                f"packing_strategy={self.packing_strategy!r} is not supported: use one of {', '.join(PACKING_STRATEGIES)}."
            )
        if not isinstance(self.assistant_only_loss, bool):
            raise ValueError(f"assistant_only_loss={self.assistant_only_loss!r} must be True or False.")
        if self.completion_only_loss is not None and not isinstance(self.completion_only_loss, bool):
            raise ValueError(
                f"completion_only_loss={self.completion_only_loss!r} must be True, False or None "
                "(None: the completion only, for prompt-completion data)."
            )
        if self.chat_template_path is not None and not os.path.exists(self.chat_template_path):
            raise ValueError(
                f"chat_template_path={self.chat_template_path!r} does not exist: give a .jinja file or a "
                "local tokenizer folder with a chat template."
            )
        if self.long_documents not in LONG_DOCUMENTS:
            raise ValueError(f'long_documents={self.long_documents!r} is not supported: use "split" or "truncate".')
        if self.torch_compile_backend is not None and not isinstance(self.torch_compile_backend, str):
            raise ValueError('torch_compile_backend must be a backend name such as "inductor" or "neuron".')
        if self.torch_compile_backend is not None and not self.torch_compile:
            # transformers turns compile on when a backend is given; so do we, and say so
            logger.info("torch_compile_backend=%r given: torch_compile turned on.", self.torch_compile_backend)
            self.torch_compile = True
        self.report_to = self._parse_report_to(self.report_to)

    @staticmethod
    def _parse_report_to(value) -> list:
        if value is None or value == "none" or value == ["none"]:
            return []
        items = [value] if isinstance(value, str) else list(value)
        out = []
        for item in items:
            if item == "all":
                out.extend(REPORTERS)
            elif item in REPORTERS:
                out.append(item)
            elif item != "none":
                raise report_to_refusal(item)
        return list(dict.fromkeys(out))

    # ---- device ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The training device: the CPU with use_cpu=True, else what `device_map="auto"` picks (Neuron first)."""
        if self._device is None:
            from ..backends.devices import resolve_device

            self._device = torch.device("cpu") if self.use_cpu else resolve_device("auto")
        return self._device

    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """warmup_steps; a warmup_steps below 1 (transformers 5) or warmup_ratio is a fraction of the run,
        rounded up (transformers' rule)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * (self.warmup_steps or self.warmup_ratio))

    def resolved_steps(self, value: float, max_steps: int) -> int:
        """A `*_steps` value below 1 is a fraction of the run (transformers' rule)."""
        return max(1, math.ceil(value * max_steps)) if value < 1 else int(value)

    def to_dict(self) -> dict:
        """The fields, as transformers writes them (a Hub token is masked, never written to training_args.json)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out.get("hub_token"):
            out["hub_token"] = "<HUB_TOKEN>"
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)


__all__ = ["TrainingArguments"]
