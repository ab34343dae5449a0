"""`make demo` (examples/demo.py), kept cheap: a few training steps, graphs traced with the eager backend,
in a scratch folder. What it prints: numbered stages, the training summary, each graph of the compile
stage, the streamed answers and their table; no raw JSON and no training-compile line unless asked."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_demo(folder, *flags):
    env = dict(
        os.environ,
        STATICFORMERS_DEMO_DIR=str(folder),
        STATICFORMERS_COMPILE_BACKEND="eager",
        STATICFORMERS_CACHE=str(folder / "cache"),
        OMP_NUM_THREADS="1",
    )
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "demo.py"), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout, res.stderr


@pytest.mark.slow
def test_demo_first_and_second_run(tmp_path):
    import demo  # examples/ (for its prompts and stage names)

    first, first_err = run_demo(tmp_path, "--steps", "4")
    for n, stage in enumerate(demo.STAGES, 1):
        assert f"[{n}/{len(demo.STAGES)}] {stage.name}: " in first
    headers = [line for line in first.splitlines() if line.startswith("[")]
    assert len(headers) == len(demo.STAGES) and all(line.endswith(" s since the demo started)") for line in headers)
    assert "4 steps in" in first and "held-out loss" in first and "training compile" not in first
    assert (tmp_path / "model" / "model.safetensors").exists() and (tmp_path / "corpus.txt").exists()
    assert "prefill  [1, 16]" in first and "decode   [1, 1, 256]" in first  # the compile stage's lines
    for prompt in demo.PROMPTS:
        assert f"> {prompt}" in first
    table = first[first.index("prompt  ") :].splitlines()
    assert table[0].split()[-3:] == ["tokens", "time", "tokens/s"]
    assert all(line.split()[-2] in ("us", "ms", "s") for line in table[1 : len(demo.PROMPTS) + 2])  # "12.3 ms"
    counts = [int(line[len(max(demo.PROMPTS, key=len)) :].split()[0]) for line in table[1 : len(demo.PROMPTS) + 1]]
    assert all(1 <= c <= demo.MAX_NEW_TOKENS for c in counts)  # what was generated, not the maximum
    assert "no prompt compiled a graph" in first
    assert not [line for line in first.splitlines() if line.lstrip().startswith("{")] and '"retired"' not in first
    # the chat stage fine-tunes with assistant-only loss and evaluates; the serve stage answers four questions at
    # once, three as trained and one phrased anew
    assert "with assistant-only loss" in first and (tmp_path / "chat" / "model.safetensors").exists()
    assert (
        "cosine after" in first and "evaluation (greedy answers, teacher-forced): the 36 trained questions: " in first
    )
    assert first.count("  Q: ") == 4 and first.count("(as trained)") == 3 and "streamed in" in first
    assert " of 3 trained questions answered exactly as the docs say; the new phrasing " in first
    assert "0 graphs compiled while serving" in first
    assert "4 requests finished" in first and "server stopped" in first

    # both training stages show the Trainer's bar (stage 6 ran minutes without one)
    assert first_err.count("train: 100%") >= 2, first_err[-3000:]

    second, _ = run_demo(tmp_path)
    n = len(demo.STAGES)
    assert f"[2/{n}] tokenizer: " in second and "skipped: reusing" in second and "steps in" not in second
    assert f"[6/{n}] chat: " in second and "skipped: reusing" in second
    assert "no prompt compiled a graph" in second and "0 graphs compiled while serving" in second


sys.path.insert(0, os.path.join(ROOT, "examples"))
