"""pyproject.toml and the Makefile: no setuptools deprecation banner, the plot extra installed by make."""

import os
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
