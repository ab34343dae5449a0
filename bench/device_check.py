"""The one prepared device check (run through bench/device_check.sh): every step a lent GPU must run, each
under its own time limit, all within `--total` seconds (480 by default), with the results in one JSON
file and a markdown summary.

Steps, in order (a step that runs out of time is stopped, process group and all, and the next one starts):
1. `cuda_tests`: `pytest -m cuda` over the test files that can hold a test marked `cuda`
   (tests/test_on_device.py and every other file naming CUDA or taking the `device` fixture).
2. `reference`: bench/reference.py builds the random Qwen3-1.7B-shaped checkpoint on the device.
3. `generate_b1`, `generate_b8`: bench/generate.py, bf16, prompt 128, 128 new tokens: staticformers
   against transformers' default `generate` and its static cache + compile; decode tok/s, time to first
   token, bandwidth utilisation against a copy of the weights' size measured in the same run.
4. `train`: bench/train.py, a short bf16 compiled run of both Trainers on the 41.6M reference model.
5. `serve`: bench/serve.py at 1 and 16 clients, once that file exists (skipped with a note until then);
   it is called as `bench/serve.py --device D --size S --clients 1 16 --out FILE`.

`--dry-run` runs the same steps on the CPU with the tiny reference model, tiny sizes and Dynamo's
eager backend everywhere, inductor nowhere: no C++ compile (tests/test_device_check.py runs it in `make test`,
so the script keeps working).
Output (under $OUT, else bench/results/device-check/): device_check.json (every step: status, seconds,
limit, its benchmark JSON, the end of its output), device_check.md (the summary, with the issue's targets
met or missed) and device_check.log (every step's full output).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_LIMITS = {"cuda_tests": 80, "reference": 30, "generate_b1": 130, "generate_b8": 100, "train": 80, "serve": 50}
# The dry run proves that every step runs, not how fast: on a loaded 2-core machine (the test suite's other
# worker beside it) its steps take several times what they take alone, so its limits are wider.
DRY_RUN_SLACK = 3
TAIL = 3000  # characters of each step's output kept in the JSON


@dataclass
class Step:
    name: str
    argv: list
    limit: float
    result_file: Optional[str] = None  # the benchmark's own JSON (--out), read even after a timeout
    skip: Optional[str] = None  # why the step does not run
    record: dict = field(default_factory=dict)


_DEVICE_PARAM = re.compile(r"def test_\w+\([^)]*\bdevice\b")


def cuda_test_files() -> list[str]:
    """The test files that can hold a test marked `cuda`: those that name CUDA, and those whose tests take
    the `device` fixture (each runs once per device, the CUDA variant marked; tests/conftest.py).
    Collecting the whole suite for them would cost seconds of a lent GPU's time."""
    tests = os.path.join(ROOT, "tests")
    out = []
    for name in sorted(os.listdir(tests)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(tests, name)) as f:
                text = f.read()
            if "cuda" in text or _DEVICE_PARAM.search(text):
                out.append(os.path.join(tests, name))
    return out or [tests]


def plan_steps(py: str, device: str, dry: bool, work: str, limits: dict, compile_mode: Optional[str]) -> list[Step]:
    """The steps of a check (module docstring); `dry` shrinks every size and uses the cheap backends."""
    size, train_size = ("tiny", "tiny") if dry else ("1.7b", "41m")
    gen = [py, os.path.join(HERE, "generate.py"), "--device", device, "--size", size, "--dtypes", "bfloat16"]
    if dry:
        # a small matmul ceiling: on a CPU without native bf16 products a 1024^3 bf16 matmul takes seconds
        gen += ["--prompt", "16", "--new", "8", "--repeats", "1", "--backend", "eager", "--matmul-n", "128"]
    else:
        gen += ["--prompt", "128", "--new", "128", "--repeats", "2"]
    if compile_mode:
        gen += ["--compile-mode", compile_mode]
    train = [
        py,
        os.path.join(HERE, "train.py"),
        "--device",
        device,
        "--size",
        train_size,
        "--precisions",
        "bf16",
        "--modes",
        "compiled",
        "--rounds",
        "1",
        "--no-packed",
    ]
    train += (
        ["--steps", "3", "--documents", "40", "--batch", "2", "--seq", "32", "--backend", "eager", "--matmul-n", "128"]
        if dry
        else ["--steps", "8", "--documents", "200"]
    )
    serve_script = os.path.join(HERE, "serve.py")
    steps = [
        # a test module that cannot be imported under the machine's own packages must not stop the others
        Step(
            "cuda_tests",
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-m",
                "cuda",
                "-p",
                "no:cacheprovider",
                "--continue-on-collection-errors",
                f"--junitxml={os.path.join(work, 'cuda_tests.xml')}",
                *cuda_test_files(),
            ],
            limits["cuda_tests"],
            os.path.join(work, "cuda_tests.xml"),
        ),
        Step(
            "reference",
            [py, os.path.join(HERE, "reference.py"), "--size", size, "--device", device],
            limits["reference"],
        ),
        Step(
            "generate_b1",
            gen + ["--batches", "1", "--out", os.path.join(work, "generate_b1.json")],
            limits["generate_b1"],
            os.path.join(work, "generate_b1.json"),
        ),
        Step(
            "generate_b8",
            gen + ["--batches", "2" if dry else "8", "--out", os.path.join(work, "generate_b8.json")],
            limits["generate_b8"],
            os.path.join(work, "generate_b8.json"),
        ),
        Step(
            "train",
            train + ["--out", os.path.join(work, "train.json")],
            limits["train"],
            os.path.join(work, "train.json"),
        ),
        Step(
            "serve",
            [
                py,
                serve_script,
                "--device",
                device,
                "--size",
                size,
                "--clients",
                "1",
                "16",
                "--out",
                os.path.join(work, "serve.json"),
            ]
            + (
                [
                    "--requests",
                    "8",
                    "--prompt",
                    "16",
                    "--new",
                    "4",
                    "--peers",
                    "none",
                    "--no-compile",
                    "--backend",
                    "eager",
                ]
                if dry
                else ["--requests", "64", "--new", "64", "--no-compile"]
            ),  # a whole-model compile per batch bucket
            # of the 1.7B model would not fit the step's limit
            limits["serve"],
            os.path.join(work, "serve.json"),
            skip=None if os.path.exists(serve_script) else "bench/serve.py does not exist yet (serving has not landed)",
        ),
    ]
    return steps


def run_step(step: Step, seconds: float, env: dict, log) -> dict:
    """Run one step in its own process group, stopped (the whole group) after `seconds`."""
    if step.skip:
        return {"status": "skipped", "note": step.skip, "seconds": 0.0, "limit": step.limit}
    if seconds < 5:
        return {"status": "skipped", "note": "no time left in the check's total", "seconds": 0.0, "limit": step.limit}
    log.write(f"\n===== {step.name}: {' '.join(step.argv)} (limit {seconds:.0f} s)\n")
    log.flush()
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(
            step.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=seconds)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, status = None, "timeout"
        try:  # stray children of a finished step (compile workers) go too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.seek(0)
        text = out.read()
    log.write(text)
    log.flush()
    record = {
        "status": status,
        "returncode": rc,
        "seconds": round(time.perf_counter() - start, 1),
        "limit": round(seconds),
        "tail": text[-TAIL:],
    }
    if step.result_file and os.path.exists(step.result_file):
        record["result"] = (
            junit_counts(step.result_file) if step.result_file.endswith(".xml") else _read_json(step.result_file)
        )
    return record


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        return {"error": f"unreadable result {os.path.basename(path)}: {err}"}


def junit_counts(path: str) -> dict:
    """Passed / failed / skipped counts and the failing tests' names from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failing.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failing"] = failing
    return counts


# ---------------------------------------------------------------------------------------------
# the summary
# ---------------------------------------------------------------------------------------------
TARGETS = (  # issue 20, item 5
    ("batch-1 bf16 decode at >= 80% of the measured memory bandwidth", "sf_b1_bandwidth_utilisation", 0.80),
    (">= 2x transformers' default generate (batch-1 decode tok/s)", "b1_ratio_vs_hf", 2.0),
    (">= 1.3x transformers' static cache + compile (batch-1 decode tok/s)", "b1_ratio_vs_hf_static", 1.3),
    ("no compile after warm-up (staticformers' graphs while timed)", "sf_graphs_after_warmup", None),
    ("training tokens/s >= 1.3x transformers' compiled Trainer in bf16", "train_ratio", 1.3),
)


def figures(report: dict) -> dict:
    """The numbers the targets are judged on, from the steps' results (None where not measured)."""
    out = {}
    steps = report["steps"]

    def case(name: str) -> Optional[dict]:
        cases = (steps.get(name, {}).get("result") or {}).get("cases") or []
        return cases[0] if cases and "sf" in cases[0] else None

    b1, b8 = case("generate_b1"), case("generate_b8")
    out["sf_b1_bandwidth_utilisation"] = b1["sf"].get("bandwidth_utilisation") if b1 else None
    out["b1_ratio_vs_hf"] = b1.get("ratio_decode_vs_hf") if b1 else None
    out["b1_ratio_vs_hf_static"] = b1.get("ratio_decode_vs_hf_static") if b1 else None
    done = [c for c in (b1, b8) if c]
    out["sf_graphs_after_warmup"] = sum(c["sf"]["graphs_after_warmup"] for c in done) if done else None
    train = (steps.get("train", {}).get("result") or {}).get("results", {}).get("bf16-compiled", {})
    out["train_ratio"] = train.get("summary", {}).get("steady_ratio")
    return out


def verdict(value, threshold) -> str:
    if value is None:
        return "not measured"
    if threshold is None:
        return "met" if value == 0 else "missed"
    return "met" if value >= threshold else "missed"


def summary_markdown(report: dict) -> str:
    lines = [
        f"# Device check ({'dry run on the CPU' if report['dry_run'] else report['device']})",
        "",
        f"{report['started']}, {report['wall_seconds']:.0f} s of {report['total_limit']} s; python {report['python']}.",
        "",
    ]
    info = report.get("device_info") or {}
    if info:
        lines += [
            f"Device: {info.get('name')} ({info.get('device')}), torch {info.get('torch')}, "
            f"transformers {info.get('transformers')}.",
            "",
        ]
    lines += ["| step | status | seconds | limit | note |", "| --- | --- | --- | --- | --- |"]
    for name, rec in report["steps"].items():
        note = rec.get("note", "")
        res = rec.get("result") or {}
        if name == "cuda_tests" and "tests" in res:
            note = f"{res['passed']} passed, {res['failures'] + res['errors']} failed, {res['skipped']} skipped"
            if res["failing"]:
                note += ": " + ", ".join(res["failing"][:8])
        lines.append(f"| {name} | {rec['status']} | {rec['seconds']} | {rec['limit']} | {note} |")
    for name in ("generate_b1", "generate_b8"):
        res = report["steps"].get(name, {}).get("result") or {}
        ceil = (res.get("ceilings") or {}).get("bfloat16", {})
        for c in res.get("cases", []):
            lines += [
                "",
                f"## {name}: batch {c['batch']}, {c['dtype']}, prompt {c['prompt']}, {c['new']} new tokens",
                "",
                f"Memory ceiling: {ceil.get('memory', {}).get('gb_s')} GB/s ({ceil.get('memory', {}).get('what')}); "
                f"matmul ceiling: {ceil.get('matmul', {}).get('tflop_s')} TFLOP/s. Warm-up s: {c.get('warmup_seconds')}.",
                "",
                "| contender | TTFT ms | decode tok/s | step ms | bandwidth util. | prefill FLOP util. | graphs after warm-up |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
            for who in ("sf", "hf", "hf_static"):
                e = c.get(who)
                if e:
                    lines.append(
                        f"| {who} | {e['ttft_ms']} | {e['decode_tok_s']} | {e['step_ms']} | "
                        f"{e.get('bandwidth_utilisation')} | {e.get('prefill_flops_utilisation')} | "
                        f"{e['graphs_after_warmup']} |"
                    )
            lines += [
                "",
                f"Ratios (sf over peer, decode): vs hf {c.get('ratio_decode_vs_hf')}, vs hf_static "
                f"{c.get('ratio_decode_vs_hf_static')}; TTFT (peer over sf): vs hf {c.get('ratio_ttft_vs_hf')}, "
                f"vs hf_static {c.get('ratio_ttft_vs_hf_static')}.",
            ]
    train = report["steps"].get("train", {}).get("result") or {}
    for key, r in (train.get("results") or {}).items():
        s = r["summary"]
        lines += [
            "",
            f"## train: {key}, {train.get('model')}, batch {train.get('batch')} x {train.get('seq')}",
            "",
            f"Matmul ceiling {train.get('ceiling', {}).get('tflop_s')} TFLOP/s.",
            "",
            "| trainer | tokens/s | model TFLOP/s | FLOP util. | first step s | graphs | errors |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for who in ("ours", "transformers"):
            e = s[who]
            lines.append(
                f"| {who} | {e['steady_tokens_per_s']} | {e['model_tflop_s']} | {e['flops_utilisation']} | "
                f"{e['first_step_s']} | {e['graphs']} | {'; '.join(e['errors'])[:200]} |"
            )
        lines += ["", f"Steady ratio (ours over transformers): {s.get('steady_ratio')}."]
    serve = report["steps"].get("serve", {})
    if serve.get("result"):
        lines += ["", "## serve", "", "```json", json.dumps(serve["result"], indent=1)[:4000], "```"]
    lines += ["", "## Targets (issue 20, item 5)", ""]
    if report["dry_run"]:
        lines += ["Dry run on the CPU with the tiny model: these say nothing about the targets.", ""]
    fig = report["figures"]
    lines += ["| target | value | verdict |", "| --- | --- | --- |"]
    for text, key, threshold in TARGETS:
        lines.append(f"| {text} | {fig.get(key)} | {verdict(fig.get(key), threshold)} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, tiny model and sizes")
    ap.add_argument("--device", default=None, help="cuda (default), cuda:N; the CPU with --dry-run")
    ap.add_argument(
        "--total",
        type=float,
        default=None,
        help=f"seconds for the whole check (default 480; {DRY_RUN_SLACK}x that with --dry-run)",
    )
    ap.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="STEP=SECONDS",
        help=f"a step's own limit (defaults: {DEFAULT_LIMITS})",
    )
    ap.add_argument("--only", default=None, help="comma-separated steps to run (the others are skipped)")
    ap.add_argument(
        "--compile-mode",
        default=None,
        help="staticformers' CompileConfig(mode=...) in the generate steps, e.g. reduce-overhead",
    )
    ap.add_argument(
        "--out", default=None, help="folder for the results (default: $OUT, else bench/results/device-check)"
    )
    a = ap.parse_args(argv)
    wall_start = time.perf_counter()
    slack = DRY_RUN_SLACK if a.dry_run else 1
    limits = {name: seconds * slack for name, seconds in DEFAULT_LIMITS.items()}
    a.total = 480.0 * slack if a.total is None else a.total
    for item in a.limit:
        name, _, value = item.partition("=")
        if name not in limits or not value.replace(".", "", 1).isdigit():
            raise SystemExit(f"--limit {item!r}: write STEP=SECONDS with STEP one of {', '.join(limits)}.")
        limits[name] = float(value)
    import torch

    if a.dry_run:
        device = a.device or "cpu"
        if device != "cpu":
            raise SystemExit("--dry-run runs on the CPU: drop --device.")
    else:
        device = a.device or "cuda"
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise SystemExit(
                f"No CUDA GPU for this check (torch {torch.__version__} at {sys.executable} sees none): "
                f"run it on a machine with an NVIDIA GPU, or pass --dry-run for the CPU."
            )
    out_dir = a.out or os.environ.get("OUT") or os.path.join(HERE, "results", "device-check")
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="device-check-")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), env.get("PYTHONPATH")) if p)
    if a.dry_run:
        env.setdefault("STATICFORMERS_BENCH_MODELS", os.path.join(work, "models"))
    steps = plan_steps(sys.executable, device, a.dry_run, work, limits, a.compile_mode)
    if a.only:
        wanted = set(a.only.split(","))
        unknown = wanted - {s.name for s in steps}
        if unknown:
            raise SystemExit(
                f"--only {a.only}: unknown step(s) {', '.join(sorted(unknown))}; "
                f"the steps are {', '.join(s.name for s in steps)}."
            )
        for s in steps:
            if s.name not in wanted and not s.skip:
                s.skip = "not in --only"
    from ceilings import as_device, device_info

    report = {
        "dry_run": a.dry_run,
        "device": device,
        "device_info": device_info(as_device(device)),
        "python": sys.executable,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "total_limit": a.total,
        "compile_mode": a.compile_mode,
        "limits": limits,
        "steps": {},
    }
    deadline = wall_start + a.total
    json_path, md_path = os.path.join(out_dir, "device_check.json"), os.path.join(out_dir, "device_check.md")
    with open(os.path.join(out_dir, "device_check.log"), "w") as log:
        for step in steps:
            left = deadline - time.perf_counter() - 2  # what is left, less the time to write the summary
            record = run_step(step, min(step.limit, left), env, log)
            report["steps"][step.name] = record
            print(
                f"[device_check] {step.name}: {record['status']} in {record['seconds']} s "
                f"(limit {record['limit']}){' - ' + record['note'] if record.get('note') else ''}",
                flush=True,
            )
            report["wall_seconds"] = time.perf_counter() - wall_start
            report["figures"] = figures(report)
            with open(json_path, "w") as f:  # after every step: a check stopped from outside keeps what it did
                json.dump(report, f, indent=1, default=str)
    report["wall_seconds"] = round(time.perf_counter() - wall_start, 1)
    report["figures"] = figures(report)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(summary_markdown(report))
    print(f"[device_check] wrote {json_path} and {md_path} in {report['wall_seconds']} s", flush=True)
    failed = [n for n, r in report["steps"].items() if r["status"] in ("failed", "timeout")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
