"""The CPU backend's saved regions (backends/cpu/precompiled.py, compiled.py): a compiled function saved whole
and loaded by a later "process" (a new CPUCompiledFunction) without tracing; stale, corrupt or refused
artifacts compile; and its unguarded calls."""

import logging
import os
import time

import pytest
import torch

import staticformers.compilation.compiler as sc
from staticformers.backends.cpu import compiled as cpu_compiled
from staticformers.backends.cpu import precompiled
from staticformers.backends.cpu.compiled import CPUCompiledFunction, compile_region
from staticformers.models.kv_cache import PrefillKV


def test_signatures_follow_what_a_graph_depends_on():
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    sig = precompiled.signature
    assert sig((a, torch.zeros(2, 4))) == sig((b, torch.ones(2, 4)))  # values do not matter
    assert sig((a, torch.zeros(2, 4))) != sig((a, torch.zeros(3, 4)))  # shapes do
    assert sig(torch.zeros(2, 4)) != sig(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert sig(torch.zeros(4, 2).t()) != sig(torch.zeros(2, 4))  # strides too
    assert sig(torch.nn.Linear(4, 3)) != sig(torch.nn.Linear(4, 3, bias=False))
    norm = torch.nn.LayerNorm(4)
    other = torch.nn.LayerNorm(4, eps=1e-3)
    assert sig(norm) != sig(other)  # a plain attribute baked into the graph
    assert sig(PrefillKV(8)) != sig(PrefillKV(16))


def test_artifact_names_change_with_settings_and_arguments(tmp_path):
    x = torch.zeros(2, 4)
    path = precompiled.artifact_path(str(tmp_path), "f", [("a", 1)], (x,))
    assert path.startswith(str(tmp_path / precompiled.FOLDER))
    assert path == precompiled.artifact_path(str(tmp_path), "f", [("a", 1)], (torch.ones(2, 4),))
    assert path != precompiled.artifact_path(str(tmp_path), "f", [("a", 2)], (x,))
    assert path != precompiled.artifact_path(str(tmp_path), "g", [("a", 1)], (x,))
    assert path != precompiled.artifact_path(str(tmp_path), "f", [("a", 1)], (torch.zeros(3, 4),))


def test_a_corrupt_artifact_is_discarded(tmp_path):
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"not an artifact")
    assert precompiled.load(str(bad)) is None and not bad.exists()
    assert precompiled.load(str(tmp_path / "absent.bin")) is None


def test_prune_deletes_unused_artifacts_and_abandoned_writes(tmp_path, monkeypatch, caplog):
    now = time.time()
    ages = {"unused-1.bin": 31 * 86400, "recent-2.bin": 86400, "tmpab12": 7200, "tmpcd34": 60, "notes.txt": 90 * 86400}
    for name, age in ages.items():
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (now - age, now - age))
    monkeypatch.delenv(precompiled.MAX_AGE_ENV, raising=False)
    assert sorted(precompiled.prune(str(tmp_path), now)) == ["tmpab12", "unused-1.bin"]
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "recent-2.bin", "tmpcd34"]  # not ours: kept
    monkeypatch.setenv(precompiled.MAX_AGE_ENV, "0.5")
    assert precompiled.prune(str(tmp_path), now) == ["recent-2.bin"]
    monkeypatch.setenv(precompiled.MAX_AGE_ENV, "0")  # forever
    (tmp_path / "ancient-3.bin").write_bytes(b"x")
    os.utime(tmp_path / "ancient-3.bin", (now - 10**8, now - 10**8))
    assert precompiled.prune(str(tmp_path), now) == []
    assert precompiled.prune(str(tmp_path / "absent"), now) == []


@pytest.mark.parametrize("raw", ["soon", "-3", "nan"])
def test_a_bad_max_age_says_so_and_keeps_the_default(monkeypatch, caplog, raw):
    monkeypatch.setenv(precompiled.MAX_AGE_ENV, raw)
    precompiled.cache_safety.warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="staticformers"):
        assert precompiled.max_age_days() == precompiled.DEFAULT_MAX_AGE_DAYS
        assert precompiled.max_age_days() == precompiled.DEFAULT_MAX_AGE_DAYS
    said = [r.getMessage() for r in caplog.records if precompiled.MAX_AGE_ENV in r.getMessage()]
    assert len(said) == 1 and repr(raw) in said[0]  # once, naming the value


def step(x, w):
    return torch.relu(x @ w) * 2


@pytest.mark.inductor
def test_a_later_function_loads_the_artifact_instead_of_tracing(monkeypatch, tmp_path):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")
    monkeypatch.setenv("STATICFORMERS_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(sc, "_ENABLED_FOR", None)
    x, w = torch.randn(3, 8), torch.randn(8, 5)
    want = step(x, w)
    folder = tmp_path / precompiled.FOLDER
    folder.mkdir()
    unused = folder / "old_step-0123.bin"  # an earlier version's artifact, unused for 60 days
    unused.write_bytes(b"x")
    os.utime(unused, (time.time() - 60 * 86400,) * 2)

    first = compile_region(step, "pc_step", (3, 8))
    torch.testing.assert_close(first(x, w), want)
    assert first.aot is not None and first.graphs == 1 and not first.records[0].loaded
    (saved,) = os.listdir(folder)  # saving pruned the unused one

    traced = counters["stats"]["unique_graphs"]
    os.utime(folder / saved, (time.time() - 10 * 86400,) * 2)
    later = compile_region(step, "pc_step", (3, 8))  # as a new process would
    torch.testing.assert_close(later(x, w), want)
    assert later.records[0].loaded and counters["stats"]["unique_graphs"] == traced  # nothing traced
    assert time.time() - os.path.getmtime(folder / saved) < 3600  # a load marks it used
    torch.testing.assert_close(later(x * 2, w, checked=True), step(x * 2, w))  # guards skipped when checked
    assert later.raw is later.aot.fn

    # an artifact whose guards refuse the call (forced onto another shape's name) is discarded, and the
    # function compiles the usual way
    path = str(tmp_path / precompiled.FOLDER / saved)
    monkeypatch.setattr(precompiled, "artifact_path", lambda *a: path)
    other = compile_region(step, "pc_step", (4, 8))
    y = torch.randn(4, 8)
    torch.testing.assert_close(other(y, w), step(y, w))
    assert not other.records[0].loaded


@pytest.mark.inductor
def test_off_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("STATICFORMERS_CACHE", str(tmp_path))
    monkeypatch.setenv("STATICFORMERS_PRECOMPILE", "0")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(sc, "_ENABLED_FOR", None)
    f = compile_region(step, "pc_off", (3, 8))
    f(torch.randn(3, 8), torch.randn(8, 5))
    assert f.aot is None and not (tmp_path / precompiled.FOLDER).exists()


def test_hooks_and_closures_keep_a_call_off_artifacts():
    """Dynamo does not guard a hook's absence and bakes closure values in: such calls trace as usual."""
    layer = torch.nn.Linear(4, 4)
    assert precompiled.usable(step, (layer, torch.zeros(1, 4)))
    handle = layer.register_forward_hook(lambda m, i, o: o + 1)
    assert not precompiled.usable(step, (layer, torch.zeros(1, 4)))
    handle.remove()
    pre = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    try:
        assert not precompiled.usable(step, (layer,))
    finally:
        pre.remove()
    k = 3
    assert not precompiled.usable(lambda x: x * k, (torch.zeros(2),))


@pytest.mark.inductor
def test_a_loaded_artifact_that_fails_is_discarded_and_the_function_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("STATICFORMERS_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(sc, "_ENABLED_FOR", None)
    x, w = torch.randn(3, 8), torch.randn(8, 5)
    path = tmp_path / "bad.bin"
    path.write_bytes(b"stand-in")

    class Broken:
        def guard_check(self, *args):
            return True

        def fn(self, *args):
            raise RuntimeError("a kernel failed")

    monkeypatch.setattr(precompiled, "artifact_path", lambda *a: str(path))
    monkeypatch.setattr(precompiled, "load", lambda p: Broken())
    f = compile_region(step, "pc_broken", (3, 8))
    torch.testing.assert_close(f(x, w), step(x, w))
    assert f.graphs == 1 and not f.records[0].loaded and f.aot is not None and path.exists()  # rewritten


def test_guards_are_skipped_only_for_checked_calls_of_a_single_graph(monkeypatch):
    """`checked=True` (the engine verified the declared shape) skips Dynamo's guard evaluation once the
    one graph exists; an unchecked call keeps the guards, so a wrong shape recompiles (and is reported)
    instead of running a graph built for another shape."""
    stances = []
    real = torch.compiler.set_stance

    def spy(*args, **kwargs):
        stances.append(kwargs.get("skip_guard_eval_unsafe", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    monkeypatch.delenv("STATICFORMERS_STRICT_SHAPES", raising=False)
    f = sc.compile_function(lambda x: x * 2 + 1, "step_guards", (3,), "eager", function_class=CPUCompiledFunction)
    x = torch.arange(3.0)
    assert torch.equal(f(x, checked=True), x * 2 + 1) and stances == []  # the first call compiles, guarded
    assert torch.equal(f(x + 1, checked=True), (x + 1) * 2 + 1) and stances == [True]
    assert torch.equal(f(x, checked=False), x * 2 + 1) and stances == [True]
    with pytest.warns(RuntimeWarning, match="compile graph 2"):
        assert f(torch.ones(5)).shape == (5,)  # unchecked: the guards catch the new shape
    assert f.graphs == 2 and torch.equal(f(torch.ones(5), checked=True), torch.full((5,), 3.0))
    assert stances == [True]  # two graphs now: the guards choose between them again


def test_guard_skipping_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(cpu_compiled, "SKIP_GUARDS", False)
    calls = []
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: calls.append(k))
    f = sc.compile_function(lambda x: x - 1, "step_no_skip", (2,), "eager", function_class=CPUCompiledFunction)
    f(torch.ones(2), checked=True)
    f(torch.ones(2), checked=True)
    assert calls == [] and f.calls == 2
