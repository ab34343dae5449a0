"""`output_dir/loss_curve.png`: the training loss, the evaluation loss and the learning rate, drawn with
matplotlib (the optional `plot` extra: `pip install -e '.[plot]'` in the checkout).

The figure is built on matplotlib's object API (`Figure` + the Agg canvas), never through `pyplot`,
so a trainer in a notebook or a GUI program does not change the caller's backend or open windows.
Without matplotlib nothing is drawn: one warning per process says how to get the picture, and the
numbers stay in `metrics.jsonl` and `trainer_state.json`.
"""

from __future__ import annotations

import logging
import math
import textwrap
from typing import Optional, Sequence

logger = logging.getLogger("staticformers")

_warned_missing = False


def _series(log_history: Sequence[dict], key: str) -> list[tuple[float, float]]:
    return [
        (e["step"], float(e[key]))
        for e in log_history
        if key in e and "step" in e and e[key] is not None and math.isfinite(float(e[key]))
    ]


def loss_curve_figure(log_history: Sequence[dict], title: str = "Training"):
    """A matplotlib `Figure` of `loss` (line), `eval_loss` (squares) and `learning_rate` (second axis)
    against the optimizer step. Raises ImportError when matplotlib is not installed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train, evals = _series(log_history, "loss"), _series(log_history, "eval_loss")
    rates = _series(log_history, "learning_rate")
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    handles = []
    if train:
        handles += ax.plot(
            *zip(*train), color="tab:blue", linewidth=2, marker="o" if len(train) < 3 else None, label="training loss"
        )
    if evals:
        handles += ax.plot(
            *zip(*evals), color="tab:red", linestyle="none", marker="s", markersize=7, label="evaluation loss"
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean cross-entropy per token)")
    ax.grid(True, alpha=0.3)
    if rates:
        lr_ax = ax.twinx()
        handles += lr_ax.plot(*zip(*rates), color="tab:green", linestyle="--", linewidth=1.2, label="learning rate")
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        lr_ax.set_ylim(bottom=0)
    if not handles:
        ax.text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes)
    else:  # below the axes, where it hides no point
        ax.legend(
            handles=handles,
            labels=[h.get_label() for h in handles],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.12),
            ncol=len(handles),
            frameon=False,
        )
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=11)
    fig.tight_layout()
    return fig


def write_loss_curve(path: str, log_history: Sequence[dict], title: str = "Training") -> Optional[str]:
    """Draw `log_history` into the PNG `path` and return the path; None (after one warning per process)
    when matplotlib is not installed."""
    global _warned_missing
    try:
        fig = loss_curve_figure(log_history, title)
    except ImportError:
        if not _warned_missing:
            _warned_missing = True
            logger.warning(
                "loss_curve.png is not drawn because matplotlib is not installed: "
                "pip install -e '.[plot]' in the staticformers checkout (the numbers are in metrics.jsonl)."
            )
        return None
    fig.savefig(path, format="png")
    return path


__all__ = ["loss_curve_figure", "write_loss_curve"]
