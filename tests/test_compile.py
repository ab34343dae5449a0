"""compile.py: the persistent cache location, fresh code objects per shape, strict violations."""

import os

import pytest
import torch

import staticformers.compile as sc


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("STATICFORMERS_CACHE", str(tmp_path / "c"))
    assert sc.cache_root() == str(tmp_path / "c")
    monkeypatch.delenv("STATICFORMERS_CACHE")
    assert sc.cache_root().endswith(os.path.join(".cache", "staticformers"))


def test_enable_persistent_cache_points_inductor_there(monkeypatch, tmp_path):
    monkeypatch.setenv("STATICFORMERS_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    monkeypatch.setattr(sc, "_ENABLED_FOR", None)
    assert sc.enable_persistent_cache() == str(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "neuron")


def test_user_choice_of_inductor_dir_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(sc, "_ENABLED_FOR", None)
    sc.enable_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_inductors_own_default_is_not_a_user_choice(monkeypatch, tmp_path):
    """Inductor writes its default directory into the variable the first time it looks up its cache
    (any earlier torch.compile in the process): that must not stop us from using our root."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("STATICFORMERS_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setattr(sc, "_ENABLED_FOR", None)
    sc.enable_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_one_graph_per_function_and_second_shape_is_a_violation(monkeypatch):
    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")

    def step(x):
        return x * 2 + 1

    a = sc.compile_function(step, "step_a", (2,), "eager")
    b = sc.compile_function(step, "step_b", (3,), "eager")
    assert a.compiled is not b.compiled
    assert torch.equal(a(torch.ones(2)), torch.full((2,), 3.0)) and b(torch.ones(3)).shape == (3,)
    assert a.graphs == 1 and b.graphs == 1  # separate code objects: separate caches and limits
    with pytest.raises(Exception, match="second graph"):
        a(torch.ones(5))


def test_backend_env_override(monkeypatch):
    monkeypatch.setenv("STATICFORMERS_COMPILE_BACKEND", "aot_eager")
    assert sc.default_backend(torch.device("cpu")) == "aot_eager"
    monkeypatch.delenv("STATICFORMERS_COMPILE_BACKEND")
    assert sc.default_backend(torch.device("cpu")) == "inductor"


def test_neuron_backend_is_neuron(fake_neuron):
    assert sc.default_backend("neuron") == "neuron"


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
    f = sc.compile_function(lambda x: x * 2 + 1, "step_guards", (3,), "eager")
    x = torch.arange(3.0)
    assert torch.equal(f(x, checked=True), x * 2 + 1) and stances == []  # the first call compiles, guarded
    assert torch.equal(f(x + 1, checked=True), (x + 1) * 2 + 1) and stances == [True]
    assert torch.equal(f(x, checked=False), x * 2 + 1) and stances == [True]
    with pytest.warns(RuntimeWarning, match="second graph"):
        assert f(torch.ones(5)).shape == (5,)  # unchecked: the guards catch the new shape
    assert f.graphs == 2 and torch.equal(f(torch.ones(5), checked=True), torch.full((5,), 3.0))
    assert stances == [True]  # two graphs now: the guards choose between them again


def test_guard_skipping_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(sc, "SKIP_GUARDS", False)
    calls = []
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: calls.append(k))
    f = sc.compile_function(lambda x: x - 1, "step_no_skip", (2,), "eager")
    f(torch.ones(2), checked=True)
    f(torch.ones(2), checked=True)
    assert calls == [] and f.calls == 2
