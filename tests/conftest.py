"""Shared fixtures: tiny checkpoints (cached per session), a stand-in Neuron device, and `device`
(each test that takes it runs once per device kind: "cpu" always, "cuda" marked `cuda` and skipped
where no NVIDIA GPU is visible).

Under pytest-xdist (`make test`: two workers, a file each at a time) each worker computes with one
thread, as do the processes its tests start: two workers already fill a 2-core machine, and a second
thread per process only spins against the other worker. Files holding a long test (marked `slow`,
`inductor` or `distributed`) are handed out first (most long tests first), so that the short ones fill in around them
instead of one long file running alone at the end."""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest
import torch

from tiny import save_tiny

# the devices a `device` test runs on; `pytest -m cuda` selects the GPU variants alone
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
NO_GPU = "needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine"


if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

LONG = ("slow", "inductor", "distributed")


def _long_files_first(items) -> None:
    """Reorder `items` in place: the files holding long tests first, the one with most long tests first (the
    docs test's blocks, the distributed runs), each file's order kept."""
    long_tests: dict = {}
    for item in items:
        if any(item.get_closest_marker(m) for m in LONG):
            long_tests[item.path] = long_tests.get(item.path, 0) + 1
    items.sort(key=lambda item: -long_tests.get(item.path, 0))  # a stable sort


def pytest_collection_modifyitems(config, items):
    """Long files first (the module docstring); skip every test marked `cuda` (a `device` variant or a
    whole test) where no GPU is visible."""
    _long_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """The device under test: the CPU, or the first CUDA GPU."""
    return torch.device("cuda", 0) if request.param == "cuda" else torch.device("cpu")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> folder of a tiny random fp32 checkpoint, built once per test session."""
    cache = {}

    def get(family: str, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(family.replace("-", "_"))
            cache[key] = save_tiny(family, str(path), **overrides)
        return cache[key]

    return get


@pytest.fixture
def fake_neuron(monkeypatch):
    """Install a stand-in `torch.neuron` (and `torch_neuronx`) reporting 4 devices.

    Returns the module so a test can flip `available` or change `count`.
    """
    try:
        torch.device("neuron")
    except RuntimeError:  # what torch-neuronx does on import: name the PrivateUse1 device "neuron" (once per process)
        torch.utils.rename_privateuse1_backend("neuron")
    mod = types.SimpleNamespace(available=True, count=4)
    mod.is_available = lambda: mod.available
    mod.device_count = lambda: mod.count
    monkeypatch.setattr(torch, "neuron", mod, raising=False)
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.SimpleNamespace(__version__="0.0-standin"))
    return mod


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core machine: more threads only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.INFO, logger="staticformers")
    yield


@pytest.fixture(autouse=True)
def _neuron_name_stays_consistent():
    """After `fake_neuron` renamed PrivateUse1 to "neuron" (once per process) and its monkeypatch removed
    `torch.neuron`, torch.accelerator would find a "neuron" device with no module, and every
    `optimizer.step()` later in the session would raise. Leave an *unavailable* stand-in instead
    (what torch-neuronx looks like on a machine without Neuron devices)."""
    yield
    try:
        torch.device("neuron")
    except RuntimeError:
        return  # PrivateUse1 was never renamed: nothing to keep consistent
    if getattr(torch, "neuron", None) is None:
        torch.neuron = types.SimpleNamespace(
            is_available=lambda: False,
            device_count=lambda: 0,
            manual_seed=lambda seed: None,
            manual_seed_all=lambda seed: None,
            _is_in_bad_fork=lambda: False,
        )
