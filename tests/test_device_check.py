"""bench/device_check.sh: its CPU dry run goes through every step and writes the JSON and the summary; without
a GPU and without --dry-run it says what to do; bad options get one sentence; targets are judged right."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import device_check  # noqa: E402


def _env(tmp_path) -> dict:
    return dict(
        os.environ,
        PYTHON=sys.executable,
        OUT=str(tmp_path / "out"),
        STATICFORMERS_BENCH_MODELS=str(tmp_path / "models"),
        STATICFORMERS_CACHE=str(tmp_path / "cache"),
    )


@pytest.mark.slow
def test_dry_run_goes_through_every_step_and_writes_the_results(tmp_path):
    # the dry run proves that every step runs, not how fast: limits generous enough for a busy machine (the
    # suite's other worker beside it), and a step that still runs out of time is named with its seconds
    generous = [arg for step in device_check.DEFAULT_LIMITS for arg in ("--limit", f"{step}=1200")]
    res = subprocess.run(
        ["bash", os.path.join(BENCH, "device_check.sh"), "--dry-run", "--total", "1400", *generous],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["device_check.json", "device_check.log", "device_check.md"]
    report = json.loads((out / "device_check.json").read_text())
    steps = report["steps"]
    slow = {
        name: (rec["status"], rec["seconds"], rec["limit"]) for name, rec in steps.items() if rec["status"] == "timeout"
    }
    assert not slow, f"these steps ran out of time (status, seconds, limit): {slow}"
    assert report["dry_run"] and report["device"] == "cpu" and report["wall_seconds"] <= report["total_limit"]
    assert list(steps) == ["cuda_tests", "reference", "generate_b1", "generate_b8", "train", "serve"]

    tests = steps["cuda_tests"]["result"]
    assert steps["cuda_tests"]["status"] == "ok" and tests["tests"] > 0 and tests["failing"] == []
    if not torch.cuda.is_available():
        assert tests["skipped"] == tests["tests"]
    assert steps["reference"]["status"] == "ok"
    for name, batch in (("generate_b1", 1), ("generate_b8", 2)):
        assert steps[name]["status"] == "ok", steps[name]["tail"]
        result = steps[name]["result"]
        assert result["ceilings"]["bfloat16"]["memory"]["gb_s"] > 0
        assert result["ceilings"]["bfloat16"]["matmul"]["tflop_s"] > 0
        (case,) = result["cases"]
        assert case["batch"] == batch and case["dtype"] == "bfloat16"
        for who in ("sf", "hf", "hf_static"):
            assert case[who]["decode_tok_s"] > 0 and case[who]["ttft_ms"] > 0 and case[who]["bandwidth_utilisation"] > 0
        assert case["sf"]["graphs_after_warmup"] == 0 and case["sf_graphs"] > 0
    train = steps["train"]["result"]["results"]["bf16-compiled"]["summary"]
    assert steps["train"]["status"] == "ok"
    assert (
        train["ours"]["steady_tokens_per_s"] > 0
        and train["ours"]["graphs"] == 2
        and train["ours"]["flops_utilisation"] > 0
    )
    assert train["transformers"]["steady_tokens_per_s"] or train["transformers"]["errors"]  # needs accelerate
    if not os.path.exists(os.path.join(BENCH, "serve.py")):
        assert steps["serve"]["status"] == "skipped" and "serve.py" in steps["serve"]["note"]
    else:
        assert steps["serve"]["status"] == "ok", steps["serve"]["tail"]

    md = (out / "device_check.md").read_text()
    assert "| generate_b1 | ok |" in md and "## Targets" in md and "Dry run on the CPU" in md
    assert "===== train:" in (out / "device_check.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_the_check_says_what_to_do(tmp_path):
    res = subprocess.run(
        ["bash", os.path.join(BENCH, "device_check.sh")],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "no CUDA GPU" in res.stderr and "--dry-run" in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dry-run", "--limit", "train"], "write STEP=SECONDS"),
        (["--dry-run", "--limit", "nosuch=3"], "write STEP=SECONDS with STEP one of"),
        (["--dry-run", "--only", "generate_b1,nosuch"], "unknown step"),
        (["--dry-run", "--device", "cuda"], "runs on the CPU"),
    ],
)
def test_bad_options_get_one_sentence(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        device_check.main(argv + ["--out", str(tmp_path)])


def _report(b1_sf_util, b1_hf, b1_static, graphs, train_ratio) -> dict:
    case = {
        "batch": 1,
        "sf": {"bandwidth_utilisation": b1_sf_util, "graphs_after_warmup": graphs},
        "ratio_decode_vs_hf": b1_hf,
        "ratio_decode_vs_hf_static": b1_static,
    }
    train = {"results": {"bf16-compiled": {"summary": {"steady_ratio": train_ratio}}}}
    return {
        "steps": {
            "generate_b1": {"result": {"cases": [case]}},
            "generate_b8": {"status": "timeout"},
            "train": {"result": train},
        }
    }


def test_targets_are_judged_against_the_issue_thresholds():
    met = device_check.figures(_report(0.85, 2.4, 1.31, 0, 1.5))
    assert [device_check.verdict(met[k], t) for _, k, t in device_check.TARGETS] == ["met"] * 5
    missed = device_check.figures(_report(0.79, 1.9, 1.2, 1, 1.1))
    assert [device_check.verdict(missed[k], t) for _, k, t in device_check.TARGETS] == ["missed"] * 5
    none = device_check.figures({"steps": {"generate_b1": {"status": "timeout"}}})
    assert [device_check.verdict(none[k], t) for _, k, t in device_check.TARGETS] == ["not measured"] * 5
