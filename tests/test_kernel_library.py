"""kernel_library.py and operators.py's `NativeLibrary`: the CPU backend's C++ files built as one library, once.

Checked: a build started ahead in a thread and a first use that waits for it build once; a file that does not
compile leaves every kernel set of the library unloaded, each with one warning naming its file and what runs
instead, and loses nothing else; a library not worth building here is not built, without a warning; the CPU
backend's first generation step under inductor starts the build, an eager one does not."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from staticformers.backends.cpu import kernel_library, operators


def counting_library(monkeypatch, sources=("a.cpp", "b.cpp"), ready=lambda: True, fail: bool = False):
    """A `NativeLibrary` whose build is recorded (the sources it got) instead of compiled; `fail` raises."""
    built: list = []
    gate = threading.Event()

    def build(paths):
        gate.wait(30)  # held until the test lets it finish: a waiting caller must not build again
        built.append(tuple(paths))
        if fail:
            raise RuntimeError("g++: error: broken.cpp: no such file")

    monkeypatch.setattr(operators, "build_library", build)
    return operators.NativeLibrary(sources, ready), built, gate


def test_a_build_started_ahead_is_the_one_a_first_use_waits_for(monkeypatch):
    library, built, gate = counting_library(monkeypatch)
    library.start()
    library.start()  # a second start while the first builds neither blocks nor builds again
    assert library.thread is not None and library.thread.is_alive()
    waited: list = []
    waiter = threading.Thread(target=lambda: waited.append(library.built()))
    waiter.start()
    gate.set()
    waiter.join(30)
    assert waited == [None] and library.built() is None
    assert built == [("a.cpp", "b.cpp")]
    library.start()  # built already: nothing starts
    assert built == [("a.cpp", "b.cpp")]


def test_a_failed_build_leaves_each_kernel_set_unloaded_with_one_warning(monkeypatch):
    library, built, gate = counting_library(monkeypatch, fail=True)
    gate.set()
    kernels = [
        operators.NativeKernels(name, library, lambda: True, lambda: True, f"{name}'s fallback runs instead.")
        for name in ("/x/a.cpp", "/x/b.cpp")
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [k.loaded() for k in kernels] == [False, False]
        assert [k.loaded() for k in kernels] == [False, False]  # decided once
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and len(built) == 1
    for name, message in zip(("a.cpp", "b.cpp"), messages):
        assert f"the CPU kernels of {name} could not be built" in message
        assert "no such file" in message and f"/x/{name}'s fallback runs instead." in message


def test_a_library_not_worth_building_here_is_not_built_and_says_nothing(monkeypatch):
    library, built, gate = counting_library(monkeypatch, ready=lambda: False)
    gate.set()
    kernels = operators.NativeKernels("a.cpp", library, lambda: False, lambda: True, "the fallback runs.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernels.loaded()
    assert library.built() is not None and built == []


def test_a_real_file_that_does_not_compile_is_refused_by_the_compiler(tmp_path, monkeypatch):
    """The real toolchain on a file that stops at its first line: the error comes back, no library loads."""
    if not kernel_library.has_vector_isa():
        pytest.skip("inductor builds for no x86 vector instruction set here")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this file is broken on purpose\n")
    library = operators.NativeLibrary((str(broken),), kernel_library.has_vector_isa)
    error = library.built()
    assert error is not None and "broken on purpose" in str(error)


def test_a_generation_step_under_inductor_starts_the_kernels_build_and_an_eager_one_does_not(
    monkeypatch, tiny_checkpoints
):
    """Making a generation step that inductor will compile starts the build; Dynamo's eager backends (and runs
    without a compile, which never import Dynamo) leave it to the first use, and so does training, whose steps do
    not call the kernels."""
    from staticformers import AutoModelForCausalLM, CompileConfig
    from staticformers.generation.engines import compile_settings, engine_for
    from staticformers.generation.generation_config import GenerationConfig

    if not kernel_library.has_vector_isa():
        pytest.skip("inductor builds for no x86 vector instruction set here")
    started: list = []
    monkeypatch.setattr(kernel_library.LIBRARY, "start", lambda: started.append(True))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"), dtype=torch.bfloat16)
    engine = engine_for(model)
    for backend in ("eager", "aot_eager"):
        settings = compile_settings(model, GenerationConfig(), CompileConfig(backend=backend))
        engine.steps.build("prefill", 1, 16, settings, None)
    assert not started
    settings = compile_settings(model, GenerationConfig(), CompileConfig(backend="inductor"))
    engine.steps.build("prefill", 1, 16, settings, None)  # made, not yet called: nothing is compiled
    assert started


def test_the_vector_instruction_set_is_picked_before_the_build_thread_starts(monkeypatch):
    """Inductor probes each instruction set by building and loading a small library; the build thread and the
    first compile probing at once picked different sets, and the next process compiled everything again."""
    from torch._inductor import cpu_vec_isa

    if not kernel_library.has_vector_isa():
        pytest.skip("inductor builds for no x86 vector instruction set here")
    order: list = []
    monkeypatch.setattr(kernel_library, "probe_side_by_side", lambda: order.append("probe"))
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: order.append("pick"))
    monkeypatch.setattr(kernel_library.LIBRARY, "start", lambda: order.append("start"))
    kernel_library.build_ahead()
    assert order == ["probe", "pick", "start"]


def test_each_advertised_instruction_set_is_probed_once_in_a_thread_of_its_own(monkeypatch):
    from torch._inductor import cpu_vec_isa

    probed: list = []

    class Set:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return self.name

        def __bool__(self):
            probed.append((self.name, threading.current_thread().name))
            return True

    sets = [Set("avx512 avx512_vnni amx_tile"), Set("avx512 avx512_vnni"), Set("avx512"), Set("avx2"), Set("asimd")]
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", sets)
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512", "avx512_vnni"])
    kernel_library.probe_side_by_side()
    assert sorted(name for name, _ in probed) == ["avx2", "avx512", "avx512 avx512_vnni"]
    threads = [thread for _, thread in probed]
    assert len(set(threads)) == 3 and threading.current_thread().name not in threads


def test_probes_answered_in_parallel_threads_all_reach_the_record(tmp_path):
    from staticformers.backends.cpu import isa_probes

    path = str(tmp_path / "isa-probes.json")
    keys = [f"lib{i}.so|1|2|cpu|python|torch" for i in range(16)]
    threads = [threading.Thread(target=isa_probes.add_to_record, args=(path, key)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert isa_probes.read_record(path) == set(keys)
