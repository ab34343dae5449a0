"""Checks the Trainer makes before it allocates, trains or saves, each refusal one sentence.

- `check_max_length`: rows longer than the model's positions are refused (they would train
  positions the model never had, and waste the padding; issue: a 512-position model at 1024).
- `check_step_memory`: a lower bound of one training step's memory (`memory_check`) against what
  the device has, before the first step allocates it.
- `check_token_ids`: every id in the rows (the pad id included) inside the model's vocabulary,
  instead of an IndexError from the embedding.
- `check_labels`: every label -100 or inside the vocabulary, instead of cross-entropy's IndexError.
- `check_loss_tokens` / `check_batch_has_loss`: data in which no row carries loss (labels all -100,
  rows of EOS alone) is refused before training, and so is an optimizer step whose whole batch has
  none: either would log a loss of 0 and learn nothing.
- `check_finite_weights`: before a checkpoint is written, every weight finite; a non-finite one
  stops training (`TrainingDivergedError`) so a checkpoint with NaN or inf is never written, and
  never named "the last good checkpoint".
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from ..backends.memory_check import check_fits, training_step_bytes
from .documents import IGNORE_INDEX as IGNORE
from .state_files import nonfinite


class TrainingDivergedError(RuntimeError):
    """The loss, the gradient norm or the weights stopped being finite."""


def check_max_length(max_length: int, config) -> None:
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and max_length > positions:
        raise ValueError(
            f"max_length={max_length} is more than the {positions} positions this model has "
            f"(max_position_embeddings): pass max_length={positions} or less."
        )


def check_step_memory(
    config, batch: int, length: int, dtype: torch.dtype, gradient_checkpointing: bool, device: torch.device
) -> None:
    if config is None or not hasattr(config, "num_parameters"):
        return
    need = training_step_bytes(config, batch, length, dtype, gradient_checkpointing)
    check_fits(
        need,
        device,
        f"One training step of {batch} x {length} tokens (logits, activations, optimizer state)",
        "lower per_device_train_batch_size or max_length (gradient_checkpointing=True saves activations)",
    )


def check_token_ids(rows, vocab_size: int, what: str) -> None:
    """Every id of `rows.input_ids` in [0, vocab_size)."""
    ids = rows.input_ids
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < vocab_size:
        return
    bad = high if high >= vocab_size else low
    row = int(((ids == bad).any(dim=1)).nonzero()[0])
    source = "the pad token id" if bad == rows.pad_token_id else "a token id"
    raise ValueError(
        f"The {what} hold {source} {bad} (row {row}), outside this model's vocabulary of {vocab_size} ids: "
        f"tokenize with the model's own tokenizer, or fix the input_ids."
    )


def check_labels(rows, vocab_size: int, what: str) -> None:
    """Every label of `rows.labels` either -100 (no loss) or a token id in [0, vocab_size), instead of
    cross-entropy's IndexError ("Target 600 is out of bounds") at the first step."""
    labels = rows.labels
    bad = (labels != IGNORE) & ((labels < 0) | (labels >= vocab_size))
    if not bool(bad.any()):
        return
    row, col = (int(i) for i in bad.nonzero()[0])
    raise ValueError(
        f"The {what} hold a label {int(labels[row, col])} (row {row}), neither -100 (no loss) nor a token "
        f"id of this model's vocabulary of {vocab_size} ids: give labels that are input_ids or -100."
    )


def rows_without_loss(labels: torch.Tensor) -> int:
    """Rows of `labels` with no token that carries loss (every label -100 after the causal shift)."""
    return int(((labels[:, 1:] != IGNORE).sum(dim=1) == 0).sum()) if labels.numel() else 0


def check_loss_tokens(rows, what: str) -> None:
    """Refuse data in which no row has a token that carries loss: every optimizer step would log a loss of
    0 and learn nothing."""
    if rows.num_rows and rows.loss_tokens == 0:
        raise ValueError(
            f"None of the {rows.num_rows} rows of the {what} has a token that carries loss (every label "
            f"is -100 after the shift to the next token: labels all masked, or rows of one token such as "
            f"EOS alone), so nothing would be learned: give labels that are not -100, or longer rows."
        )


def check_batch_has_loss(items: int, step: int, rows_without: int, rows: int) -> None:
    """Refuse an optimizer step whose whole batch (every micro-batch of the window, every rank) has no token
    that carries loss: it would log a loss of 0 and move nothing but the optimizer's state."""
    if items == 0:
        raise ValueError(
            f"Optimizer step {step} has no token that carries loss in its whole batch ({rows_without} of "
            f"the {rows} training rows have none: labels all -100 or a single token): drop those rows "
            f"from the data, or give them labels."
        )


def check_finite_weights(
    named: Iterable[tuple[str, torch.Tensor]], step: int, last_good: Callable[[], Optional[str]], device: torch.device
) -> None:
    """Raise `TrainingDivergedError` when a weight is NaN or infinite; `last_good()` is asked only then."""
    bad = nonfinite(named)
    if _any_rank(bool(bad), device):
        where = f" ({', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''})" if bad else " (on another rank)"
        raise TrainingDivergedError(
            f"Training stopped at step {step}: the weights hold NaN or infinite values{where}, so no checkpoint was "
            f"written for it (the last good checkpoint is {last_good() or 'none'}). Lower learning_rate or max_grad_norm, "
            f"check the data, then resume_from_checkpoint."
        )


def _any_rank(flag: bool, device: torch.device) -> bool:
    """`flag` or-ed over every process of an initialised process group (a checkpoint is all ranks' or none)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value)
    return bool(value.item())


__all__ = ["TrainingDivergedError", "check_max_length", "check_step_memory", "check_token_ids", "check_finite_weights"]
