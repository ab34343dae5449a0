"""pyproject.toml and the Makefile: no setuptools deprecation banner, the plot extra installed by make."""

import os
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_license_is_an_spdx_string_and_setuptools_reads_it():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    # a TOML table ({ text = ... }) makes every pip install print setuptools' deprecation banner
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read SPDX strings
    assert any(dep.startswith("matplotlib") for dep in project["project"]["optional-dependencies"]["plot"])


def test_make_installs_the_plot_extra():
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert "-e '.[test,plot]'" in f.read()


def _make_plan(tmp_path, venv, *overrides) -> str:
    """The commands `make setup` would run (`make -n`), for a venv at `venv`."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    res = subprocess.run(
        ["make", "-n", "-C", ROOT, "setup", f"VENV={venv}", *overrides], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_make_pins_torch_unless_told_or_a_neuron_sdk_is_there(tmp_path):
    import stat
    import sys

    fresh = _make_plan(tmp_path, tmp_path / "fresh")
    assert f"-m venv {tmp_path / 'fresh'}" in fresh and "pip install -q 'torch==2.13.0'" in fresh
    assert "pip install -q 'torch==2.9.0'" in _make_plan(tmp_path, tmp_path / "fresh", "TORCH_SPEC=torch==2.9.0")
    kept = _make_plan(tmp_path, tmp_path / "fresh", "SKIP_TORCH=1")
    assert "pip install -q 'torch" not in kept and "(SKIP_TORCH=1)" in kept and "-e '.[test,plot]'" in kept

    # a venv where torch-neuronx is installed (a stand-in package on the path its python sees)
    neuron = tmp_path / "neuron"
    (neuron / "site" / "torch_neuronx").mkdir(parents=True)
    (neuron / "site" / "torch_neuronx" / "__init__.py").write_text("")
    (neuron / "bin").mkdir()
    python = neuron / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={neuron / "site"} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    plan = _make_plan(tmp_path, neuron)
    assert "pip install -q 'torch" not in plan and "-m venv" not in plan and "(torch-neuronx)" in plan


def test_the_cpus_int8_kernel_source_ships_in_the_package():
    """backends/cpu/gemv.cpp is built from source where it runs, so a wheel must carry it."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "backends/cpu/*.cpp" in project["tool"]["setuptools"]["package-data"]["staticformers"]
    assert os.path.exists(os.path.join(ROOT, "src", "staticformers", "backends", "cpu", "gemv.cpp"))


def test_torch_spec_may_name_an_index_and_each_word_reaches_pip_alone(tmp_path):
    """`TORCH_SPEC='torch==2.13.0 --index-url URL'` (a CUDA build) was one quoted word pip refused as an
    "Invalid requirement"; TORCH_INDEX_URL says the same apart, and a `>=` stays a version."""
    url = "https://download.pytorch.org/whl/cu128"
    plan = _make_plan(tmp_path, tmp_path / "fresh", f"TORCH_SPEC=torch==2.13.0 --index-url {url}")
    assert f"pip install -q 'torch==2.13.0' '--index-url' '{url}'" in plan
    plan = _make_plan(tmp_path, tmp_path / "fresh", "TORCH_SPEC=torch>=2.13", f"TORCH_INDEX_URL={url}")
    assert f"pip install -q 'torch>=2.13' --index-url '{url}'" in plan


def test_the_test_extra_builds_the_docs_and_draws_the_loss_curve():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        test = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    assert any(d.startswith("mkdocs") for d in test) and any(d.startswith("matplotlib") for d in test)


@pytest.mark.parametrize("statuses", [(3, 0), (0, 4)], ids=["main-fails", "xla-fails"])
def test_make_test_runs_both_suites_side_by_side_and_reports_both(tmp_path, statuses):
    """A failure of one suite must not hide the other: both run (the XLA suite beside the main one), both exit codes
    are printed, the XLA suite's output after the main suite's, and the target fails. Stand-in pythons record what
    they were asked to run and print a line; the one named fails its pytest run."""
    import shutil
    import stat
    import subprocess
    import sys

    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    log = tmp_path / "ran.log"
    for name, pytest_status in zip(("main", "xla"), statuses):
        venv = tmp_path / name
        (venv / "bin").mkdir(parents=True)
        python = venv / "bin" / "python"
        python.write_text(
            "#!/bin/sh\n"
            f'case "$*" in *pytest*) echo "{name} $*" >> {log}; echo "{name} suite output"; exit {pytest_status};; esac\n'
            f'exec {sys.executable} "$@"\n'
        )
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
        (venv / ".installed").touch()  # the set-up stamps, newer than pyproject.toml: nothing is installed
    res = subprocess.run(
        ["make", "-s", "-C", ROOT, "test", f"VENV={tmp_path / 'main'}", f"XLA_VENV={tmp_path / 'xla'}", "SKIP_TORCH=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    ran = {line.split()[0]: line for line in log.read_text().splitlines()}
    assert sorted(ran) == ["main", "xla"], (ran, res.stdout, res.stderr)
    assert "tests/xla" in ran["xla"]
    assert res.returncode != 0
    main, xla = statuses
    xla = 2 if xla else 0  # the XLA suite runs under make, whose status for a failed recipe is 2
    assert re.search(
        rf"make test: main suite exit {main} in \d+ s, XLA suite exit {xla}, all done in \d+ s", res.stdout
    )
    out = res.stdout
    assert out.index("main suite output") < out.index("--- XLA suite") < out.index("xla suite output"), out
