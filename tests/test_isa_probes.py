"""isa_probes.py: inductor's per-process CPU instruction-set probes, remembered in the compile cache."""

import json
import os

import pytest

import staticformers.compilation.compiler as sc
from staticformers.backends.cpu import isa_probes


class Prober:
    """A stand-in for inductor's probe (a child process loading the library): counts, answers `ok`."""

    def __init__(self, ok=True):
        self.ok, self.calls = ok, []

    def __call__(self, isa, library):
        self.calls.append(library)
        return self.ok


def test_a_successful_probe_is_remembered_for_the_next_process(tmp_path):
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"\x7fELF...")
    record = str(tmp_path / "cache" / isa_probes.RECORD)
    first = Prober()
    assert isa_probes.remembering(first, lambda: record)("avx512", str(lib)) is True
    assert first.calls == [str(lib)] and os.path.exists(record)
    later = Prober(ok=False)  # a new process: must not be asked at all
    assert isa_probes.remembering(later, lambda: record)("avx512", str(lib)) is True
    assert later.calls == []


def test_a_changed_library_is_probed_again(tmp_path):
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"one")
    record = str(tmp_path / isa_probes.RECORD)
    isa_probes.remembering(Prober(), lambda: record)("avx2", str(lib))
    lib.write_bytes(b"rebuilt, longer")  # another size (and mtime): another library
    again = Prober(ok=False)
    assert isa_probes.remembering(again, lambda: record)("avx2", str(lib)) is False
    assert again.calls == [str(lib)]


def test_failures_and_missing_libraries_are_not_remembered(tmp_path):
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"x")
    record = str(tmp_path / isa_probes.RECORD)
    failing = Prober(ok=False)
    probe = isa_probes.remembering(failing, lambda: record)
    assert probe("avx512", str(lib)) is False and probe("avx512", str(lib)) is False
    assert len(failing.calls) == 2 and not os.path.exists(record)
    missing = Prober()
    assert isa_probes.remembering(missing, lambda: record)("avx512", str(tmp_path / "none.so")) is True
    assert not os.path.exists(record)


def test_a_record_from_another_cpu_does_not_count(tmp_path, monkeypatch):
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"x")
    record = tmp_path / isa_probes.RECORD
    other = isa_probes.probe_key(str(lib)).rsplit("|", 2)
    other[1] = "another-cpu"
    record.write_text(json.dumps({"loaded": ["|".join(other)]}))
    prober = Prober()
    isa_probes.remembering(prober, lambda: str(record))("avx512", str(lib))
    assert prober.calls == [str(lib)]


def test_an_unwritable_or_corrupt_record_only_costs_the_probe(tmp_path):
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"x")
    record = tmp_path / isa_probes.RECORD
    record.write_text("{not json")
    prober = Prober()
    assert isa_probes.remembering(prober, lambda: str(record))("avx512", str(lib)) is True
    blocked = str(tmp_path / "file-not-dir" / isa_probes.RECORD)
    (tmp_path / "file-not-dir").write_text("")
    assert isa_probes.remembering(prober, lambda: blocked)("avx512", str(lib)) is True
    assert len(prober.calls) == 2


def test_the_cpu_backend_installs_the_remembering_probe_once(monkeypatch, tmp_path):
    """The CPU backend installs it before its first inductor compile (the generic path never does)."""
    from torch._inductor.cpu_vec_isa import VecISA

    from staticformers.backends import for_device
    from staticformers.generation.engine import CompileSettings

    monkeypatch.setenv("STATICFORMERS_CACHE", str(tmp_path))
    monkeypatch.setattr(sc, "_ENABLED_FOR", None)
    monkeypatch.setattr(VecISA, "_probe_load", VecISA._probe_load)  # restored after the test
    sc.enable_persistent_cache()
    backend = for_device("cpu")
    backend.before_compile(CompileSettings(backend="inductor"))
    installed = VecISA._probe_load
    assert getattr(installed, "remembers_probes", False)
    backend.before_compile(CompileSettings(backend="inductor"))
    assert VecISA._probe_load is installed  # not wrapped twice


@pytest.mark.parametrize("content", ['{"loaded": null}', '{"loaded": 5}', '{"loaded": [[1]]}', "[]", '"x"'])
def test_a_malformed_record_counts_as_empty(tmp_path, content):
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"x")
    record = tmp_path / isa_probes.RECORD
    record.write_text(content)
    prober = Prober()
    assert isa_probes.remembering(prober, lambda: str(record))("avx512", str(lib)) is True
    assert prober.calls == [str(lib)]
    assert isa_probes.probe_key(str(lib)) in isa_probes.read_record(str(record))  # rewritten, valid


def test_the_probe_may_be_called_with_a_keyword(tmp_path):
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"x")
    record = str(tmp_path / isa_probes.RECORD)

    def probe(isa, output_path):
        return True

    wrapped = isa_probes.remembering(probe, lambda: record)
    assert wrapped("avx2", output_path=str(lib)) is True
    assert isa_probes.probe_key(str(lib)) in isa_probes.read_record(record)
