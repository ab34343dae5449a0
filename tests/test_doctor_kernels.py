"""utils/cpu_features.py: the bf16 decode kernel's path and the weights' pages as `doctor` tells them from the
processor's flags and the environment, checked against the built kernel on this machine (the oracle), on fake
`/proc/cpuinfo` and transparent-huge-page texts for the machines this one is not, and in doctor's report."""

from __future__ import annotations

import json

import pytest

from staticformers.commands.cli import main
from staticformers.utils.cpu_features import (
    bf16_decode_path,
    cpu_flags,
    decode_layers,
    huge_pages,
    thp_mode,
    vector_isa,
)

AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
SAPPHIRE = AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ZEN4 = AVX512 | {"avx512_bf16"}


def cpuinfo(flags: set[str]) -> str:
    return "processor\t: 0\nvendor_id\t: X\nflags\t\t: " + " ".join(sorted(flags)) + "\n\nprocessor\t: 1\n"


@pytest.mark.parametrize(
    "flags, env, path",
    [
        (SAPPHIRE, {}, "amx"),
        (SAPPHIRE, {"STATICFORMERS_AMX": "0"}, "dot"),
        (SAPPHIRE, {"STATICFORMERS_AMX": "0", "STATICFORMERS_BF16_DOT": "0"}, "widen"),
        (ZEN4, {}, "dot"),
        (ZEN4, {"STATICFORMERS_BF16_DOT": "0"}, "widen"),
        (AVX512, {}, "widen"),
        ({"avx2", "fma", "avx512_bf16"}, {}, "widen"),  # AVX2 builds have neither AMX nor dot-product paths
        ({"sse4_2"}, {}, "none"),
        (set(), {}, "none"),  # not x86, or no /proc/cpuinfo
    ],
)
def test_the_path_follows_the_flags_and_the_switches(flags, env, path):
    got, why = bf16_decode_path(cpu_flags(cpuinfo(flags)), env)
    assert got == path and why
    if env:
        assert all(f"{name}=0" in why for name in env)


def test_flags_and_modes_are_read_from_their_files_texts():
    assert cpu_flags("processor\t: 0\nflags\t\t: fpu avx2 fma\n") == {"fpu", "avx2", "fma"}
    assert cpu_flags("Processor\t: AArch64\nFeatures\t: fp asimd\n") == set()
    assert vector_isa(ZEN4) == 512 and vector_isa({"avx2", "fma"}) == 256 and vector_isa({"avx"}) == 0
    assert thp_mode("always [madvise] never\n") == "madvise" and thp_mode("[always] madvise never") == "always"
    assert thp_mode("garbage") is None
    assert "huge pages (transparent huge pages: madvise)" in huge_pages("madvise", {})
    assert "4 KiB pages" in huge_pages("never", {}) and "4 KiB pages" in huge_pages(None, {})
    assert "STATICFORMERS_WEIGHT_ARENA=0" in huge_pages("always", {"STATICFORMERS_WEIGHT_ARENA": "0"})


@pytest.mark.parametrize("dot_off", [False, True])
def test_the_prediction_is_the_built_kernels_path(monkeypatch, dot_off):
    from staticformers.backends.cpu import gemv

    if not gemv.loaded():
        pytest.skip("the CPU kernels cannot be built here (no C++ compiler, or no AVX2/AVX-512)")
    if dot_off:
        monkeypatch.setenv("STATICFORMERS_BF16_DOT", "0")
    actual = "amx" if gemv.amx() else "dot" if gemv.dot() else "widen"
    assert bf16_decode_path(cpu_flags())[0] == actual


def test_doctor_reports_the_path_and_the_weights_pages(capsys):
    assert main(["doctor"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU bf16 decode projections: "))
    assert "; weights: " in line
    assert main(["doctor", "--json"]) == 0
    kernels = json.loads(capsys.readouterr().out)["cpu_kernels"]
    assert kernels["bf16_decode"] in ("amx", "dot", "widen", "none")
    assert kernels["bf16_decode_why"] in line and kernels["weights"] in line
    assert main(["doctor"]) == 0
    layers = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU bf16 decode layers: "))
    assert kernels["decode_layers"] in layers


def test_the_decode_layers_line_follows_the_switch_and_the_vector_isa():
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert decode_layers(avx512, {}).startswith("one call for all layers")
    assert decode_layers({"avx2", "fma"}, {}).startswith("one call for all layers")
    assert "STATICFORMERS_DECODE_LAYERS=0" in decode_layers(avx512, {"STATICFORMERS_DECODE_LAYERS": "0"})
    assert "compiled regions" in decode_layers(avx512, {"STATICFORMERS_DECODE_LAYERS": "0"})
    assert "no AVX2 or AVX-512" in decode_layers(set(), {})
