"""loss_curve.png: drawn with matplotlib (labelled axes, eval loss, learning rate on a second axis); without
matplotlib one warning and metrics.jsonl is still written."""

import json
import logging
import sys

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from staticformers.training import plot

HISTORY = [
    {"loss": 4.1, "grad_norm": 1.0, "learning_rate": 1e-3, "step": 1, "epoch": 0.1},
    {"loss": 3.0, "grad_norm": 1.0, "learning_rate": 8e-4, "step": 2, "epoch": 0.2},
    {"eval_loss": 3.2, "eval_perplexity": 24.5, "step": 2, "epoch": 0.2},
    {"loss": 2.5, "grad_norm": 1.0, "learning_rate": 4e-4, "step": 3, "epoch": 0.3},
    {"loss": float("nan"), "learning_rate": 2e-4, "step": 4, "epoch": 0.4},  # never drawn
    {"eval_loss": 2.7, "eval_perplexity": 14.9, "step": 4, "epoch": 0.4},
    {"train_runtime": 1.0, "train_loss": 3.2, "step": 4, "epoch": 0.4},
]


def test_the_figure_has_labelled_axes_and_every_series():
    pytest.importorskip("matplotlib")
    fig = plot.loss_curve_figure(HISTORY, title="demo run")
    ax, lr_ax = fig.axes
    assert ax.get_xlabel() == "optimizer step" and "loss" in ax.get_ylabel() and lr_ax.get_ylabel() == "learning rate"
    assert ax.get_title() == "demo run"
    lines = {line.get_label(): line for line in ax.get_lines() + lr_ax.get_lines()}
    assert list(lines["training loss"].get_xdata()) == [1, 2, 3]  # the NaN step is left out
    assert list(lines["training loss"].get_ydata()) == [4.1, 3.0, 2.5]
    assert list(lines["evaluation loss"].get_ydata()) == [3.2, 2.7]
    assert list(lines["learning rate"].get_ydata()) == [1e-3, 8e-4, 4e-4, 2e-4]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"training loss", "evaluation loss", "learning rate"}


def test_the_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = plot.write_loss_curve(str(tmp_path / "curve.png"), HISTORY)
    assert path == str(tmp_path / "curve.png")
    pixels = imread(path)
    assert pixels.shape[:2] == (500, 800)  # 8 x 5 inches at 100 dpi
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97].tolist()}) > 10  # not blank


def test_an_empty_history_still_draws(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot.write_loss_curve(str(tmp_path / "empty.png"), []) is not None


def test_without_matplotlib_one_warning_and_metrics_stay(tmp_path, monkeypatch, caplog):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(plot, "_warned_missing", False)
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    ds = [{"input_ids": [(s + i) % 31 + 1 for i in range(10)]} for s in range(16)]
    with caplog.at_level(logging.WARNING, logger="staticformers"):
        for run in ("a", "b"):
            out = tmp_path / run
            args = TrainingArguments(
                output_dir=str(out),
                max_length=16,
                per_device_train_batch_size=4,
                max_steps=2,
                logging_steps=1,
                save_strategy="no",
                disable_tqdm=True,
            )
            trainer = Trainer(model=AutoModelForCausalLM.from_config(cfg, seed=0), args=args, train_dataset=ds)
            trainer.train()
            assert not (out / "loss_curve.png").exists()
            assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")][:2] == [1, 2]
            assert trainer.write_loss_curve() is None
    warnings = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert len(warnings) == 1 and "pip install -e '.[plot]'" in warnings[0] and "metrics.jsonl" in warnings[0]
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))
