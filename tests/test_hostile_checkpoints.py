"""Checkpoints that would load into a broken model are refused with one sentence: a base weight holding
NaN or an infinity (generate would repeat token 0), and a config.json nested too deeply for the JSON
reader (a RecursionError before)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from staticformers import AutoModelForCausalLM
from staticformers.checkpoints.safetensors_io import SafetensorsFormatError
from staticformers.models.config_checks import ConfigError


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_base_weight_holding_nan_or_inf_is_refused_naming_it(tiny_checkpoints, tmp_path, bad):
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(tiny_checkpoints("qwen3"), tmp_path / "m"))
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = bad
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        SafetensorsFormatError,
        match=rf"model.safetensors: tensor '{name}' holds NaN or infinite "
        rf"values, so the model would compute nothing useful",
    ):
        AutoModelForCausalLM.from_pretrained(str(folder))


def test_a_config_nested_too_deeply_is_refused(tiny_checkpoints, tmp_path):
    folder = Path(shutil.copytree(tiny_checkpoints("qwen3"), tmp_path / "m"))
    depth = 100_000
    (folder / "config.json").write_text('{"a": ' * depth + "1" + "}" * depth)
    with pytest.raises(ConfigError, match=r"config.json nests JSON too deeply to be read: restore the file"):
        AutoModelForCausalLM.from_pretrained(str(folder))
