"""Where training metrics go: `state.log_history`, `output_dir/metrics.jsonl`, TensorBoard, the progress bar.

Every log record (a dict like transformers': `loss`, `grad_norm`, `learning_rate`, `epoch`,
`step`, `tokens_per_second`; or `eval_loss`, `eval_perplexity`; or the final `train_runtime` ...)
is appended to the log history, written as one JSON line, and sent to TensorBoard when
`report_to` asks for it and `torch.utils.tensorboard` (the `tensorboard` package) is installed.
Only the main process writes (the distributed layer says which one is main). `StepMeter` keeps the
running numbers those records are made of.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Optional

logger = logging.getLogger("staticformers")

METRICS_FILE = "metrics.jsonl"


def _tensorboard_writer(logging_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # ImportError, or tensorboard missing underneath
        logger.warning(
            "report_to asks for TensorBoard but the tensorboard package is not installed: "
            "pip install tensorboard (metrics still go to metrics.jsonl)."
        )
        return None
    return SummaryWriter(log_dir=logging_dir)


class MetricsReporter:
    """Appends log records to the history, the JSONL file and TensorBoard."""

    def __init__(self, output_dir: str, report_to: list, logging_dir: str, is_main: bool = True):
        self.is_main = is_main
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.tensorboard = None
        if is_main:
            os.makedirs(output_dir, exist_ok=True)
            if "tensorboard" in report_to:
                self.tensorboard = _tensorboard_writer(logging_dir)

    def log(self, history: list, record: dict) -> None:
        history.append(record)
        if not self.is_main:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(
                json.dumps(
                    {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
                )
                + "\n"
            )
        if self.tensorboard is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)):
                    prefix = "eval/" if key.startswith("eval_") else "train/"
                    self.tensorboard.add_scalar(prefix + key.removeprefix("eval_"), value, step)
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


class StepMeter:
    """The running numbers of one `train()` call: the window since the last log record (its mean loss and
    token rate), the totals of the final metrics, and the steady-state token rate, which leaves out the
    first step (the one that compiles)."""

    def __init__(self):
        self.run_start = time.perf_counter()
        self.window_loss, self.window_steps, self.window_tokens, self.window_start = 0.0, 0, 0, time.perf_counter()
        self.total_loss, self.total_steps, self.total_tokens = 0.0, 0, 0
        self.steady_tokens, self.steady_start = 0, None

    def add(self, loss: float, tokens: int, step_start: float, now: float) -> float:
        """Count one optimizer step that began at `step_start` and ended at `now`; returns the token rate
        to show (steady-state once there is one, else this step's)."""
        if self.steady_start is None:
            self.steady_start = now
        else:
            self.steady_tokens += tokens
        self.window_loss += loss
        self.window_steps += 1
        self.window_tokens += tokens
        self.total_loss += loss
        self.total_steps += 1
        self.total_tokens += tokens
        if self.steady_tokens:
            return self.steady_tokens / (now - self.steady_start)
        return tokens / max(now - step_start, 1e-9)

    def take_window(self, now: float) -> tuple[float, float]:
        """(mean loss, tokens per second) of the steps since the last call, and a new window from here."""
        out = self.window_loss / self.window_steps, self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_loss, self.window_steps, self.window_tokens, self.window_start = 0.0, 0, 0, time.perf_counter()
        return out


def progress_bar(total: int, initial: int, disable: bool):
    """A tqdm bar over optimizer steps."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=disable, desc="train", unit="step", dynamic_ncols=True)


def format_postfix(loss: Optional[float], lr: float, tokens_per_second: float) -> dict:
    out = {}
    if loss is not None:
        out["loss"] = f"{loss:.4f}"
    out["lr"] = f"{lr:.2e}"
    out["tok/s"] = f"{tokens_per_second:,.0f}"
    return out


__all__ = ["MetricsReporter", "StepMeter", "progress_bar", "format_postfix", "METRICS_FILE"]
