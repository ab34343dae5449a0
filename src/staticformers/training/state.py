"""`TrainerState` (transformers' `trainer_state.json`, plus the data position) and `TrainOutput`."""

from __future__ import annotations

import dataclasses
import json
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
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class TrainOutput(NamedTuple):
    """What `Trainer.train()` returns, as in transformers."""

    global_step: int
    training_loss: float
    metrics: dict


__all__ = ["TrainerState", "TrainOutput"]
