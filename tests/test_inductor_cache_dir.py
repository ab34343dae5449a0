"""An unusable `TORCHINDUCTOR_CACHE_DIR` (here a path under a file: `NotADirectoryError`) costs one warning,
never a run: eager generation imports no Dynamo at all (the CPU's int8 kernel module used to import it at
load, which creates inductor's cache folder), and a compiled run goes on in a temporary folder, with the
same tokens. Each run is a fresh subprocess, so the variable is read as a user's shell would set it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import torch
    from staticformers import AutoModelForCausalLM, CompileConfig
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    kw = dict(disable_compile=True) if sys.argv[2] == "none" else dict(compile_config=CompileConfig(backend=sys.argv[2]))
    tokens = [model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, **kw)[0].tolist()
              for _ in range(2)]
print(json.dumps({"tokens": tokens, "dynamo": "torch._dynamo" in sys.modules,
                  "warnings": [str(w.message) for w in caught if "cache folder" in str(w.message)]}))
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny import save_served

    return save_served("qwen3", tmp_path_factory.mktemp("cache_dir_model"))


def _run(folder, backend: str, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONPATH": os.path.join(ROOT, "src")}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder), backend], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unusable(tmp_path_factory) -> str:
    a_file = tmp_path_factory.mktemp("cache_dir") / "a_file"
    a_file.write_text("")
    return str(a_file / "inductor")  # a folder under a file: NotADirectoryError


@pytest.fixture(scope="module")
def expected(folder) -> list:
    """The tokens of this process's eager run, where the folder is usable."""
    import torch

    from staticformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return [
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, disable_compile=True)[0].tolist()
    ] * 2


def test_eager_generation_never_imports_dynamo_and_ignores_the_folder(folder, unusable, expected):
    bad = _run(folder, "none", unusable)
    assert bad["tokens"] == expected
    assert bad["dynamo"] is False and bad["warnings"] == []


def test_a_compiled_run_warns_once_and_goes_on_without_a_persistent_cache(folder, unusable, expected):
    bad = _run(folder, "eager", unusable)  # the eager compile backend: Dynamo traces, inductor is not run
    assert bad["tokens"] == expected
    (warning,) = bad["warnings"]  # two generate calls, one warning
    assert warning.startswith(
        f"staticformers: inductor's cache folder {unusable!r} (TORCHINDUCTOR_CACHE_DIR) "
        "cannot be used (Not a directory); this process compiles without a persistent cache, "
        "in "
    )
    assert warning.endswith("Set TORCHINDUCTOR_CACHE_DIR to a writable folder to keep compiled graphs between runs.")
