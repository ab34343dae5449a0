"""`TrainerState` (transformers' `trainer_state.json`, plus the data position) and `TrainOutput`."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional


@dataclass
class TrainerState:
    """What a checkpoint needs to continue: counters, the data position, the log history.

    `epoch_index` is the epoch being trained and `batches_in_epoch` how many of its micro-batches
    were consumed (the data position a resumed run skips to); `epoch` is the fractional epoch that
    transformers reports.
    """

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int = 0
    gradient_accumulation_steps: int = 1
    epoch_index: int = 0
    batches_in_epoch: int = 0
    train_rows: int = 0
    seen_tokens: int = 0
    log_history: list = field(default_factory=list)
    last_checkpoint: Optional[str] = None

    def to_json_string(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True, default=str) + "\n"

    def save_to_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def load_from_json(cls, path: str) -> "TrainerState":
        """The state in `path`, every value checked: one sentence naming the file and the key when wrong."""
        import os

        from ..checkpoints.json_files import read_json_object
        from .state_files import RESUME_ADVICE, CorruptCheckpointError

        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing, so the checkpoint is incomplete: {RESUME_ADVICE}.")
        data = read_json_object(path, RESUME_ADVICE, CorruptCheckpointError)
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key, value in values.items():
            why = _invalid(key, value)
            if why:
                raise CorruptCheckpointError(f"{path}: {key}={value!r} {why}; the file is damaged: {RESUME_ADVICE}.")
        return cls(**values)


_COUNTS = (
    "global_step",
    "max_steps",
    "num_train_epochs",
    "train_batch_size",
    "epoch_index",
    "batches_in_epoch",
    "train_rows",
    "seen_tokens",
)
_PERIODS = ("logging_steps", "eval_steps", "save_steps", "gradient_accumulation_steps")


def _invalid(key: str, value) -> Optional[str]:
    """Why `value` cannot be the state's `key`, or None."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key in _COUNTS and not (is_int and value >= 0):
        return "must be an integer of 0 or more"
    if key in _PERIODS and not (is_int and value >= 1):
        return "must be a positive integer"
    if key == "epoch" and not (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    ):
        return "must be a finite number of 0 or more"
    if key == "log_history" and not (isinstance(value, list) and all(isinstance(r, dict) for r in value)):
        return "must be a list of objects"
    if key == "last_checkpoint" and value is not None and not isinstance(value, str):
        return "must be a path or null"
    return None


class TrainOutput(NamedTuple):
    """What `Trainer.train()` returns, as in transformers."""

    global_step: int
    training_loss: float
    metrics: dict


__all__ = ["TrainerState", "TrainOutput"]
