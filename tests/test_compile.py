"""compile.py: the persistent cache location, fresh code objects per shape, strict violations."""

import os

import pytest
import torch

import staticformers.compilation.compiler as sc
import staticformers.backends.devices as devices


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
    with pytest.raises(Exception, match="compile graph 2"):
        a(torch.ones(5))


def test_backend_env_override(monkeypatch):
    monkeypatch.setenv("STATICFORMERS_COMPILE_BACKEND", "aot_eager")
    assert devices.default_backend(torch.device("cpu")) == "aot_eager"
    monkeypatch.delenv("STATICFORMERS_COMPILE_BACKEND")
    assert devices.default_backend(torch.device("cpu")) == "inductor"


def test_neuron_backend_is_neuron(fake_neuron):
    assert devices.default_backend("neuron") == "neuron"


def test_module_calls_compile_each_under_its_own_code_and_counter():
    """`compile_module_calls` (FSDP2's per-block compile) counts each module's graphs and keeps them apart:
    modules of one class do not share one code object (nor its recompile limit)."""
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    counters = sc.compile_module_calls(layers, "blk", "eager")
    x = torch.randn(2, 4)
    for layer in layers:
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert [c.graphs for c in counters] == [1, 1, 1]
    with torch.no_grad():
        layers[0](x)  # another grad mode: one more graph, counted
    assert [c.graphs for c in counters] == [2, 1, 1]
