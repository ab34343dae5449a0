"""The `xla` device kind where torch_xla is installed: resolution, "auto" leaving the CPU plugin alone,
`doctor` reporting torch_xla, the PJRT device and its count, and the backend a model on it gets."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed here: `make test-xla` runs these in its own venv")

import torch  # noqa: E402

from staticformers.backends import for_device  # noqa: E402
from staticformers.backends.devices import DeviceUnavailableError, describe, resolve_device  # noqa: E402


def test_xla_resolves_and_auto_leaves_the_cpu_plugin_alone(caplog):
    assert resolve_device("xla") == torch.device("xla", 0)
    assert resolve_device(torch.device("xla")) == torch.device("xla", 0)
    with pytest.raises(DeviceUnavailableError, match=r"'xla:1' is not here: this machine has 1 xla device"):
        resolve_device("xla:1")
    with caplog.at_level(logging.INFO, logger="staticformers"):
        assert resolve_device("auto") == torch.device("cpu")  # XLA's CPU device is an emulation: asked for by name
    assert "xla" in caplog.text
    assert for_device("xla:0").kind == "xla"


def test_doctor_reports_torch_xla_and_the_pjrt_device(capsys):
    import torch_xla

    info = describe()
    assert info["torch_xla"] == torch_xla.__version__ and info["pjrt_device"] == "CPU"
    assert info["devices"]["xla"] == {
        "available": True,
        "count": 1,
        "compile_backend": "openxla",
        "dist_backend": "xla",
        "bf16": True,
    }
    from staticformers.commands.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch_xla {torch_xla.__version__} (PJRT device CPU, 1 device(s))" in out


def test_dynamic_shapes_are_refused(xla_models):
    from staticformers import CompileConfig

    model, _, _ = xla_models("qwen3")
    with pytest.raises(ValueError, match=r"XLA compiles one graph per shape: drop CompileConfig\(dynamic=True\)"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=2, compile_config=CompileConfig(dynamic=True))


def test_pipeline_on_xla_gives_the_cpus_greedy_text(tmp_path):
    from staticformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    from tiny import build_hf_model
    from tokenizer_fixtures import build_qwen

    build_qwen(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    build_hf_model("qwen3", vocab_size=len(tok), max_position_embeddings=64).save_pretrained(str(tmp_path))
    pipe = pipeline("text-generation", model=str(tmp_path), device="xla")
    assert pipe.model.device.type == "xla"
    text = pipe("for x in", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    cpu = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ids = tok("for x in")["input_ids"]
    out = cpu.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, disable_compile=True)
    assert text == tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_the_xla_generator_state_round_trips_whatever_its_size():
    import torch_xla.core.xla_model as xm

    backend, device = for_device("xla"), torch.device("xla", 0)
    for seed in (3, 2**63 + 12345, 2**64 - 1):  # XLA's seed is an unsigned 64-bit value
        xm.set_rng_state(seed, device)
        state = backend.rng_state(device)
        xm.set_rng_state(0, device)
        backend.set_rng_state(device, state)
        assert int(xm.get_rng_state(device)) == seed
