"""Device resolution: "auto" finds Neuron first, every kind knows its backends, refusals name the device."""

from __future__ import annotations

import logging

import pytest
import torch

from staticformers.backends.devices import (
    DeviceUnavailableError,
    compile_backend_for,
    describe,
    dist_backend_for,
    kind_of,
    resolve_device,
    supports_bf16,
)


def test_auto_is_cpu_here_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="staticformers"):
        assert resolve_device("auto") == torch.device("cpu")
        assert resolve_device(None) == torch.device("cpu")
    assert "chose cpu" in caplog.text and "neuron, xla, cuda" in caplog.text


def test_auto_finds_neuron_first(fake_neuron, caplog):
    with caplog.at_level(logging.INFO, logger="staticformers"):
        device = resolve_device("auto")
    assert str(device) == "neuron:0"
    assert "chose neuron" in caplog.text
    assert compile_backend_for(device) == "neuron" and dist_backend_for(device) == "neuron"
    assert supports_bf16(device)


def test_neuron_indices(fake_neuron):
    assert str(resolve_device("neuron:3")) == "neuron:3"
    assert str(resolve_device(2)) == "neuron:2"
    with pytest.raises(DeviceUnavailableError, match=r"'neuron:4' is not here: this machine has 4 neuron device"):
        resolve_device("neuron:4")


def test_neuron_installed_but_no_device(fake_neuron):
    fake_neuron.available = False
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match="install torch-neuronx on a Trainium/Inferentia instance"):
        resolve_device("neuron")


def test_unavailable_devices_are_refused_with_what_to_do():
    with pytest.raises(
        DeviceUnavailableError, match=r"'neuron' is not available here: install torch-neuronx.*device_map=\"auto\""
    ):
        resolve_device("neuron")
    with pytest.raises(DeviceUnavailableError, match=r"'cuda:1' is not available here: install a CUDA build"):
        resolve_device("cuda:1")
    with pytest.raises(DeviceUnavailableError, match=r"'cuda' is not available"):
        resolve_device(torch.device("cuda"))
    with pytest.raises(DeviceUnavailableError, match="asks for an accelerator, and none is available"):
        resolve_device(0)


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("torch_xla") is not None, reason="torch_xla is here")
def test_xla_without_torch_xla_is_refused_with_what_to_install():
    with pytest.raises(
        DeviceUnavailableError,
        match=r"'xla' is not available here: install torch-xla with the torch it "
        r"pins \(the `xla` extra\) and set PJRT_DEVICE",
    ):
        resolve_device("xla")
    assert kind_of("xla").compile_backend == "openxla" and kind_of("xla:1").dist_backend == "xla"
    info = describe()
    assert info["torch_xla"] is None and info["pjrt_device"] is None
    assert info["devices"]["xla"]["available"] is False


def test_bad_device_values():
    with pytest.raises(ValueError, match=r"Unknown device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="negative"):
        resolve_device(-1)
    with pytest.raises(ValueError, match="dict of module placements is not supported"):
        resolve_device({"": "cpu"})
    with pytest.raises(ValueError, match="is not a device"):
        resolve_device(True)


def test_cpu_forms():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")


def test_backends_per_kind():
    assert [kind_of(n).compile_backend for n in ("neuron", "cuda:1", "xpu", "cpu")] == [
        "neuron",
        "inductor",
        "inductor",
        "inductor",
    ]
    assert [kind_of(n).dist_backend for n in ("neuron", "cuda", "xpu", "cpu")] == ["neuron", "nccl", "xccl", "gloo"]
    assert supports_bf16("cpu") and not supports_bf16("cuda")


def test_describe_reports_the_seed_check(fake_neuron):
    info = describe()
    assert info["devices"]["neuron"] == {
        "available": True,
        "count": 4,
        "compile_backend": "neuron",
        "dist_backend": "neuron",
        "bf16": True,
    }
    assert info["auto"] == "neuron:0" and info["torch"] == torch.__version__


def test_doctor_cli_prints_true_4(fake_neuron, capsys):
    from staticformers.commands.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch.neuron.is_available(), torch.neuron.device_count(): True 4" in out
    assert 'device_map="auto" -> neuron:0 (compile backend neuron' in out


def test_doctor_console_script_runs():
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "staticformers.commands.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    info = json.loads(out)
    assert info["auto"] == "cpu" and info["devices"]["cpu"]["available"] is True
