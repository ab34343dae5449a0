"""Every shell block of README.md runs and succeeds, as a new user would type it after `make demo`.

Blocks are found by their fence (```bash, ```sh, ```shell), so sections added later are covered
without touching this file. A block that cannot run here (it needs the Hub, an accelerator, a second
node, or it is `make` itself) says so in an HTML comment on the line just above its fence:

    <!-- readme-test: skip (needs two nodes) -->

Each block runs with bash (`set -e`, so every line must succeed) in a scratch folder laid out as the
repository after `make demo`: `examples/` (linked), `.demo/model` (a tiny Qwen3 with a trained tokenizer,
512 positions like the demo's) and `.demo/corpus.txt`. It stays cheap through the environment, not by
editing the commands: `STATICFORMERS_COMPILE_BACKEND=eager` (graphs are traced and counted, not
compiled by inductor), `STATICFORMERS_EXAMPLE_STEPS=3` (the distributed example's default length).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```(bash|sh|shell)\s*$")
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b(.*?)-->")
pytestmark = pytest.mark.slow  # every shell block runs in its own shell


def shell_blocks(text: str) -> list[dict]:
    """Each shell block: its first line number, its text, and the skip reason of a marker right above it."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i].strip()):
            above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = SKIP.search(above)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append({"line": i + 1, "text": "\n".join(lines[i + 1:end]),
                           "skip": skip.group(1).strip(" ()") if skip else None})
            i = end
        i += 1
    return blocks


BLOCKS = shell_blocks(open(README, encoding="utf-8").read())


def test_the_readme_has_shell_blocks_and_the_parser_reads_markers():
    assert len(BLOCKS) >= 4 and any(b["skip"] for b in BLOCKS) and any(not b["skip"] for b in BLOCKS)
    sample = "x\n<!-- readme-test: skip (two nodes) -->\n```bash\necho a\n```\n\n```sh\necho b\n```\n"
    assert shell_blocks(sample) == [{"line": 3, "text": "echo a", "skip": "two nodes"},
                                    {"line": 7, "text": "echo b", "skip": None}]


@pytest.fixture(scope="module")
def after_demo(tmp_path_factory):
    """A scratch folder laid out as the repository after `make demo`, with a tiny model in .demo/model."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import inference

    work = tmp_path_factory.mktemp("readme")
    os.symlink(os.path.join(ROOT, "examples"), work / "examples")
    model = work / ".demo" / "model"
    inference.build_checkpoint(str(model), steps=0)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 512  # as the demo's model
    (model / "config.json").write_text(json.dumps(config))
    (work / ".demo" / "corpus.txt").write_text("\n\n".join(inference.CORPUS) + "\n")
    shutil.rmtree(model / "run", ignore_errors=True)
    return work


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b['line']}" for b in BLOCKS])
def test_readme_shell_block_runs(block, after_demo, tmp_path):
    if block["skip"]:
        pytest.skip(f"README.md:{block['line']}: {block['skip']}")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               STATICFORMERS_COMPILE_BACKEND="eager", STATICFORMERS_EXAMPLE_STEPS="3",
               STATICFORMERS_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", "-e", "-c", block["text"]], cwd=after_demo, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"README.md:{block['line']} failed:\n{block['text']}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    # nothing a new user would take for a problem (PyTorch's notices included: distributed/quiet.py)
    assert "Warning" not in res.stderr and "warning" not in res.stderr.lower().replace("no warning", ""), res.stderr[-3000:]


def test_the_readme_installs_from_the_clone_with_extras_that_exist():
    """The package is not on an index: every `pip install` of it in README.md is from the clone (`-e .` with
    extras pyproject.toml declares), and the serve extra holds what `staticformers serve` imports (llguidance: structured outputs)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    text = open(README, encoding="utf-8").read()
    extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    assert not re.search(r"pip install\s+['\"]?staticformers", text), "README installs staticformers from an index"
    installs = re.findall(r"pip install -e '\.\[([a-z,]+)\]'", text)
    assert installs and any("serve" in i.split(",") for i in installs)
    for names in installs:
        assert set(names.split(",")) <= set(extras), names
    assert {d.split(">")[0].split("=")[0] for d in extras["serve"]} == {"fastapi", "uvicorn", "prometheus_client", "llguidance"}
