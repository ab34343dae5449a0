"""The device-neutral core: no device checks or strategy strings in the model, the CPU's tuning reached only
through its backend, and never imported for another device kind; no import cycles."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import staticformers

SRC = os.path.dirname(os.path.abspath(staticformers.__file__))


def test_the_model_holds_no_device_checks_and_no_kernel_choices():
    text = open(os.path.join(SRC, "models", "decoder.py"), encoding="utf-8").read()
    assert "device.type" not in text and ".is_cuda" not in text
    for word in ('"reduce"', '"onednn"', '"matmul"', "how=", "import backends", "from .backends"):
        assert word not in text, word
    assert not re.search(r"getattr\(kv_cache", text)  # no cache attributes that choose kernels


def test_no_module_outside_the_backends_imports_the_cpu_package():
    offenders = []
    for folder, _, files in os.walk(SRC):
        if os.path.join("backends", "cpu") in folder or folder.endswith("backends"):
            continue
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name), encoding="utf-8").read()
                if re.search(r"backends\.cpu|from \.cpu|backends import cpu", text):
                    offenders.append(os.path.relpath(os.path.join(folder, name), SRC))
    assert offenders == []


CHILD = r"""
import sys, torch
from staticformers import AutoConfig, AutoModelForCausalLM
from staticformers.backends import for_device
from staticformers.generation.engine import CompileSettings, Engine
cfg = AutoConfig.for_model("qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16)
model = AutoModelForCausalLM.from_config(cfg, seed=0).to("meta")  # a stand-in device kind: not the CPU
engine = Engine(model)
assert type(engine.backend).__name__ == "Backend", engine.backend  # meta: the generic answers
step = engine.step("decode", 1, 256, CompileSettings(enabled=False))
argmax, logits = step.step(torch.zeros(1, 1, dtype=torch.long, device="meta"),
                           torch.zeros(1, 1, dtype=torch.long, device="meta"))
assert logits.shape == (1, 64) and logits.device.type == "meta"
assert for_device("cuda").name == "cuda" and for_device("neuron").name == "neuron"
print("cpu package imported:", any(m.startswith("staticformers.backends.cpu") for m in sys.modules))
"""


def test_the_cpu_package_is_not_imported_for_another_device():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "cpu package imported: False" in out.stdout
