"""The XLA suite's set-up: XLA's CPU device (PJRT_DEVICE=CPU) unless the caller chose another, XLA's
backend optimisation off (tiny graphs: compiling them fast matters more than running them fast; the
arithmetic is the same IEEE fp32), strict shapes, and one model per family for the session.

`make test` runs this folder in its own environment (torch_xla pins its torch): `make test-xla`. In the
main environment every module here skips, saying that torch_xla is not installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_XLA = importlib.util.find_spec("torch_xla") is not None
if HAVE_XLA:  # never in the main suite's process: these would reach its other tests
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    os.environ.setdefault("STATICFORMERS_STRICT_SHAPES", "1")

from xla_support import plan  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _xla_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the session (a test reads it from another process)."""
    if HAVE_XLA and "STATICFORMERS_CACHE" not in os.environ:
        os.environ["STATICFORMERS_CACHE"] = str(tmp_path_factory.mktemp("staticformers_cache"))
    yield os.environ["STATICFORMERS_CACHE"]


@pytest.fixture(scope="session")
def xla_models(tiny_checkpoints):
    """family -> (our model on XLA with the suite's plan, transformers' model on the CPU), loaded once."""
    transformers = pytest.importorskip("transformers")
    from staticformers import AutoModelForCausalLM
    from staticformers.generation.engines import engine_for

    loaded = {}

    def get(family: str):
        if family not in loaded:
            path = tiny_checkpoints(family)
            ours = AutoModelForCausalLM.from_pretrained(path, device_map="xla")
            engine_for(ours, plan())
            hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            loaded[family] = (ours, hf, path)
        return loaded[family]

    return get
