"""pipeline("text-generation"), the generate/compile commands and the inference example, on a tiny
Qwen3 checkpoint with a small trained tokenizer (built by the example itself)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import inference

    return inference.build_checkpoint(str(tmp_path_factory.mktemp("example")))


@pytest.fixture(autouse=True)
def eager_backend(monkeypatch):
    monkeypatch.setenv("STATICFORMERS_COMPILE_BACKEND", "eager")


def test_pipeline_string_list_and_chat(checkpoint):
    from staticformers import AutoTokenizer, pipeline

    pipe = pipeline("text-generation", model=checkpoint, device="cpu")
    tok = AutoTokenizer.from_pretrained(checkpoint)
    out = pipe("The French Bread Law", max_new_tokens=5, disable_compile=True)
    assert isinstance(out, list) and out[0]["generated_text"].startswith("The French Bread Law")
    ids = tok("The French Bread Law", return_tensors="pt")["input_ids"]
    ref = pipe.model.generate(input_ids=ids, max_new_tokens=5, disable_compile=True)
    assert out[0]["generated_text"] == "The French Bread Law" + tok.decode(
        ref[0, ids.shape[1] :], skip_special_tokens=True
    )
    many = pipe(["a", "Keep the growing tensors"], max_new_tokens=3, return_full_text=False, disable_compile=True)
    assert len(many) == 2 and all(isinstance(m[0]["generated_text"], str) for m in many)
    chat = pipe([{"role": "user", "content": "hello"}], max_new_tokens=3, disable_compile=True)
    assert chat[0]["generated_text"][-1]["role"] == "assistant"
    with pytest.raises(ValueError, match="not available"):
        pipeline("summarization", model=checkpoint)


def test_pipeline_with_a_loaded_model_and_dtype_auto(checkpoint):
    from staticformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    for kwargs in ({"dtype": "auto"}, {"torch_dtype": "auto"}):
        pipe = pipeline("text-generation", model=model, tokenizer=tok, **kwargs)
        assert pipe.model.dtype == model.dtype


def test_cli_hub_errors_are_one_sentence(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    res = subprocess.run(
        [sys.executable, "-m", "staticformers.commands.cli", "generate", "nosuchorg/nosuchmodel", "hi"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "nosuchorg/nosuchmodel" in res.stderr


@pytest.mark.slow
def test_cli_generate_streams_and_compile_prints_the_plan(checkpoint):
    env = dict(os.environ, STATICFORMERS_COMPILE_BACKEND="eager")
    cli = [sys.executable, "-m", "staticformers.commands.cli"]
    res = subprocess.run(
        cli
        + ["generate", checkpoint, "The French", "--max-new-tokens", "4", "--device", "cpu", "--no-compile", "--stats"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("The French") and "4 new tokens" in res.stderr and "no graphs (eager)" in res.stderr
    res = subprocess.run(
        cli
        + [
            "compile",
            checkpoint,
            "--device",
            "cpu",
            "--batch-sizes",
            "1",
            "--prompt-lengths",
            "8",
            "--kv-lengths",
            "16",
            "--max-model-len",
            "16",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "2 shapes at most" in res.stdout and "prefill" in res.stdout and "[1, 1, 16]" in res.stdout
    assert "2 shapes, 4 graphs" in res.stdout  # on the CPU: prefill's layer, decode's prepare and layer, one head
    res = subprocess.run(
        cli + ["generate", checkpoint, "x" * 3000, "--device", "cpu", "--no-compile"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2 and "largest prompt bucket" in res.stderr and "Traceback" not in res.stderr


def test_examples_inference_runs(checkpoint):
    env = dict(os.environ, STATICFORMERS_COMPILE_BACKEND="eager", STATICFORMERS_EXAMPLE_DIR=checkpoint)
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "inference.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    # the example's model is trained on a sentence starting so: text, never a half character (U+FFFD)
    assert res.stdout.startswith("The French Bread Law states that a baguette must be made")
    assert "\ufffd" not in res.stdout
