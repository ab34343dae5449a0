"""Every code block of README.md and of the documentation site (docs/*.md) runs and succeeds, as a new user
would type it after `make demo`, in order.

Blocks are found by their fence: shell blocks (```bash, ```sh, ```shell) run one by one, each with bash
(`set -e`: every line must succeed); the Python blocks (```python) of one page run in order in one Python
process, so a later block uses the names an earlier one defined (each page's first block loads what the
page needs). A block that cannot run here says why in an HTML comment (it does not show when the page is
rendered) on the line just above its fence, with exactly one reason from `REASONS`:

    <!-- skip: hub (downloads Qwen/Qwen3-0.6B; the next block is the same with the demo's model) -->

Everything runs in a scratch folder laid out as the repository after `make demo`: `examples/` (linked),
`.demo/model` (a tiny Qwen3 with a trained tokenizer and no chat template, 512 positions, like the demo's),
`.demo/chat` (the same with the demo's training chat template, like the chat stage's) and
`.demo/corpus.txt`. It stays cheap through the environment, not by editing the blocks:
`STATICFORMERS_COMPILE_BACKEND=eager` (graphs are traced and counted, not compiled by inductor),
`STATICFORMERS_EXAMPLE_STEPS=3` (the distributed example's default length). A Trainer with
`torch_compile=True` takes its backend from `TrainingArguments` (inductor on the CPU), not from that variable,
so the first Python blocks of the Train and Fine-tune pages do compile with inductor: `TORCHINDUCTOR_VEC_ISA_OK=0`
has inductor write scalar C++ kernels, which the C++ compiler builds much faster than vectorised ones (the same
graphs and regions; each of those blocks a quarter to a third shorter).

That the commands after the demo reuse its graphs is checked from the plans (`test_generate_commands_use_the_
demos_plan`): every `staticformers generate` on a demo model needs only the shapes the demo compiled. With the
eager backend nothing is cached on disk, so a compile count of 0 across processes cannot be observed here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
FENCE = re.compile(r"^```(bash|sh|shell|python)\s*$")
SKIP = re.compile(r"<!--\s*skip:\s*(\w+)\s*(?:\((.*)\))?\s*-->")
# the one reason a block may give for not running here
REASONS = {
    "hub": "needs the Hugging Face Hub (a download)",
    "hardware": "needs hardware this machine lacks (Trainium, a GPU, several ranks or nodes)",
    "server": "starts a server that runs until it is stopped, or talks to one",
    "install": "installs packages",
    "make": "is `make` itself",
}
pytestmark = pytest.mark.slow  # every block runs in its own process


def page_order() -> list[str]:
    """README.md, then the site's pages in the order of mkdocs.yml's nav (a page's blocks build on earlier pages'
    outputs only through .demo/, which every page starts from)."""
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = re.findall(r":\s*([\w./-]+\.md)\s*$", f.read(), re.M)
    pages = [p for p in nav if not p.startswith("reference/")]  # ARCHITECTURE.md, BENCHMARKS.md: no blocks to run
    return ["README.md"] + [f"docs/{p}" for p in pages]


def code_blocks(text: str) -> list[dict]:
    """Each fenced code block: its language, first line number, text, and the skip marker right above it."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i].strip())
        if fence:
            above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = SKIP.search(above)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append(
                {
                    "lang": "python" if fence.group(1) == "python" else "shell",
                    "line": i + 1,
                    "text": "\n".join(lines[i + 1 : end]),
                    "skip": skip.group(1) if skip else None,
                }
            )
            i = end
        i += 1
    return blocks


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


PAGES = page_order()
BLOCKS = {page: code_blocks(read(page)) for page in PAGES}
SHELL = [(page, b) for page in PAGES for b in BLOCKS[page] if b["lang"] == "shell"]
PYTHON_PAGES = [page for page in PAGES if any(b["lang"] == "python" and not b["skip"] for b in BLOCKS[page])]


def test_the_parser_reads_blocks_and_markers():
    sample = (
        "x\n<!-- skip: hardware (two nodes) -->\n```bash\necho a\n```\n\n```sh\necho b\n```\n"
        "<!-- skip: hub -->\n```python\nprint(1)\n```\n"
    )
    assert code_blocks(sample) == [
        {"lang": "shell", "line": 3, "text": "echo a", "skip": "hardware"},
        {"lang": "shell", "line": 7, "text": "echo b", "skip": None},
        {"lang": "python", "line": 11, "text": "print(1)", "skip": "hub"},
    ]
    assert len(SHELL) >= 10 and len(PYTHON_PAGES) >= 6


def test_every_marker_gives_one_known_reason_and_none_is_left_over():
    for page in PAGES + [f"docs/{p}" for p in os.listdir(DOCS) if p.endswith(".md")]:
        text = read(page)
        assert "readme-test" not in text, f"{page}: an old readme-test marker"
        markers = re.findall(r"<!--\s*skip:.*?-->", text)
        for marker in markers:
            m = SKIP.fullmatch(marker)
            assert m and m.group(1) in REASONS, f"{page}: {marker!r} gives no reason among {sorted(REASONS)}"
        lines = text.splitlines()
        for i, line in enumerate(lines):  # a marker stands right above a fence, or it skips nothing
            if SKIP.search(line):
                after = next((x for x in lines[i + 1 :] if x.strip()), "")
                assert FENCE.match(after.strip()), f"{page}:{i + 1}: a skip marker with no code block under it"


def test_the_readme_s_first_screen_is_short_and_says_the_two_commands():
    text = read("README.md")
    assert len(text.splitlines()) < 80
    assert "make demo" in text and "make test" in text
    assert re.search(r"`make test`: \d+ min", text) and re.search(r"`make demo`: \d+ min", text)  # measured durations
    assert "docs/" in text


def test_the_first_block_has_an_offline_alternative_beside_it():
    """A page's first Python block may need the Hub only when the next block is the same offline."""
    for page in PYTHON_PAGES:
        python = [b for b in BLOCKS[page] if b["lang"] == "python"]
        if python[0]["skip"] == "hub":
            assert not python[1]["skip"] and ".demo/" in python[1]["text"], page


@pytest.fixture(scope="module")
def after_demo(tmp_path_factory):
    """A scratch folder laid out as the repository after `make demo`: a tiny model in .demo/model (no chat
    template, as the demo's), the same with the demo's training chat template in .demo/chat, the corpus."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import inference

    work = tmp_path_factory.mktemp("readme")
    os.symlink(os.path.join(ROOT, "examples"), work / "examples")
    model = work / ".demo" / "model"
    inference.build_checkpoint(str(model), steps=0)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 512  # as the demo's model
    (model / "config.json").write_text(json.dumps(config))
    shutil.rmtree(model / "run", ignore_errors=True)
    chat = work / ".demo" / "chat"
    shutil.copytree(model, chat)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)  # the demo's model was never trained to chat
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    shutil.copy(os.path.join(ROOT, "examples", "qa_training.jinja"), chat / "chat_template.jinja")
    chat_config = dict(tokenizer_config)
    (chat / "tokenizer_config.json").write_text(json.dumps(chat_config))
    (work / ".demo" / "corpus.txt").write_text("\n\n".join(inference.CORPUS) + "\n")
    (work / ".venv" / "bin").mkdir(parents=True)  # `source .venv/bin/activate`: this interpreter's environment
    (work / ".venv" / "bin" / "activate").write_text(f"export PATH={os.path.dirname(sys.executable)}:$PATH\n")
    return work


def environment(tmp_path) -> dict:
    return dict(
        os.environ,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        STATICFORMERS_COMPILE_BACKEND="eager",
        STATICFORMERS_EXAMPLE_STEPS="3",
        STATICFORMERS_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.path.join(ROOT, "src"),
    )


def check_quiet(res, where: str, text: str) -> None:
    assert res.returncode == 0, (
        f"{where} failed:\n{text}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
    )
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    # nothing a new user would take for a problem (PyTorch's notices included: distributed/quiet.py)
    assert "Warning" not in res.stderr and "warning" not in res.stderr.lower().replace("no warning", ""), (
        f"{where}:\n{res.stderr[-3000:]}"
    )


@pytest.mark.parametrize("page,block", SHELL, ids=[f"{p}:{b['line']}" for p, b in SHELL])
def test_shell_block_runs(page, block, after_demo, tmp_path):
    if block["skip"]:
        pytest.skip(f"{page}:{block['line']}: {REASONS[block['skip']]}")
    res = subprocess.run(
        ["bash", "-e", "-c", block["text"]],
        cwd=after_demo,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    check_quiet(res, f"{page}:{block['line']}", block["text"])


DRIVER = """
import sys
blocks = {blocks!r}
for where, text in blocks:
    print(f"--- {{where}}", flush=True)
    exec(compile(text, where, "exec"), globals())
"""


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_of_a_page_run_in_order(page, after_demo, tmp_path):
    blocks = [(f"{page}:{b['line']}", b["text"]) for b in BLOCKS[page] if b["lang"] == "python" and not b["skip"]]
    code = DRIVER.format(blocks=blocks)
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=after_demo,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=900,
    )
    check_quiet(res, page, "\n\n".join(text for _, text in blocks))


def generate_commands() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for block in BLOCKS[page]:
            if block["lang"] != "shell":
                continue
            for line in block["text"].replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:2] == ["staticformers", "generate"] and words[2] in (".demo/model", ".demo/chat"):
                    out.append((f"{page}:{block['line']}", words))
    return out


def test_generate_commands_use_the_demos_plan():
    """After `make demo`, a README or docs `generate` on the demo's model needs only the shapes the demo compiled
    (examples/demo.py's PLAN: batch 1, prompts up to 16 tokens, a 256-position cache), so it loads them from the
    on-disk cache. A chat prompt is longer than 16 tokens, so only plain prompts of the demo's model are held to it."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import demo

    from staticformers import ShapePlan

    commands = generate_commands()
    assert commands
    kv, prompt = int(demo.PLAN["kv_lengths"]), int(demo.PLAN["prompt_lengths"])
    for where, words in commands:
        flags = dict(zip(words[3:], words[4:]))
        if words[2] != ".demo/model" or "--chat" in words:
            continue
        plan = ShapePlan(max_model_len=int(flags.get("--max-model-len", 0)) or None).bind(512)
        new = int(flags.get("--max-new-tokens", 128))
        assert plan.max_model_len == int(demo.PLAN["max_model_len"]), f"{where}: pass --max-model-len 256, the demo's"
        assert plan.kv_bucket(plan.positions_needed(prompt, new)) == kv and prompt in plan.prompt_lengths, where


def test_the_docs_install_from_the_clone_with_extras_that_exist():
    """The package is not on an index: every `pip install` of it is from the clone (`-e .` with extras pyproject.toml
    declares), and the serve extra holds what `staticformers serve` imports (llguidance: structured outputs)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    text = "\n".join(read(page) for page in PAGES)
    extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    assert not re.search(r"pip install\s+['\"]?staticformers", text), "the docs install staticformers from an index"
    installs = re.findall(r"pip install -e '\.\[([a-z,]+)\]'", text)
    assert installs and any("serve" in i.split(",") for i in installs)
    for names in installs:
        assert set(names.split(",")) <= set(extras), names
    assert {d.split(">")[0].split("=")[0] for d in extras["serve"]} == {
        "fastapi",
        "uvicorn",
        "prometheus_client",
        "llguidance",
    }
