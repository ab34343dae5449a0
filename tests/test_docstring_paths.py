"""Docstrings and comments name only repository files that exist.

The project's prose points readers at files (`models/kv_cache.py`, `backends/cpu/`, `BENCHMARKS.md`). When
code moves, such a pointer keeps naming the old place and misleads whoever follows it. This test reads
every docstring (a string statement: module, class, function or attribute docstring) and every comment of
src/staticformers/**/*.py, bench/*.py and examples/*.py, and fails on a file or folder name that resolves
to nothing in the tree.

What counts as a reference: a path-like token ending in one of EXTENSIONS (backticked or not), or a path
ending in `/` (a folder). A token that starts right after `/`, `:`, `.`, `~`, `$`, `<` or `>` is not one:
that is a URL, an absolute or home path, an environment variable's folder or a placeholder.

How a reference resolves (the first that exists wins), for a module in folder D:
  1. the repository root (`BENCHMARKS.md`, `bench/serve.py`, `src/`);
  2. src/staticformers/ (`models/kv_cache.py`, `backends/cpu/`);
  3. D itself (`loop.py` inside generation/ is generation/loop.py; `cpu/threads.py` from backends/);
  4. D's parent, which covers the parent package and its siblings (`loop.py` from generation/speculative/,
     `xla/` from backends/cpu/).
A name that resolves nowhere passes only if NOT_IN_REPOSITORY lists it (files of a user's model folder,
files a run writes).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "staticformers"

EXTENSIONS = ("py", "md", "json", "toml", "cpp", "jinja", "sh", "txt", "yml", "yaml")
_START = r"(?<![\w./:~$<>-])"
FILE = re.compile(_START + r"((?:[\w.-]+/)*\w[\w.-]*\.(?:" + "|".join(EXTENSIONS) + r"))(?![\w/-])")
FOLDER = re.compile(_START + r"((?:[\w.-]+/)+)(?=[\s`'\"),;:]|\.(?:\s|$)|$)")

# Names that are not files of this repository, so they resolve nowhere on purpose. Keep this list short
# and exact: a name listed here passes in every module.
NOT_IN_REPOSITORY = {
    # Files of a Hugging Face model, tokenizer, adapter or Trainer checkpoint folder (the user's files).
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "adapter_config.json",
    "trainer_state.json",
    "training_args.json",
    # Folders of a user's paths: a Trainer's output_dir, the Hub cache's blob store.
    "output_dir/checkpoint-N/",
    "blobs/",
    # Files a run writes (a benchmark's output, the compile cache's record, a usage line's own names).
    "bench/results/serve.json",
    "bench/results/device-check/",
    "device_check.json",
    "device_check.md",
    "isa-probes.json",
    "a.json",
    "b.json",
    "all.json",
    # The llama.cpp project, not a C++ file.
    "llama.cpp",
}


def scanned_modules() -> list:
    """The Python files whose docstrings and comments are checked."""
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "examples").glob("*.py")])


def prose(source: str):
    """(first line, text) of each string statement and each comment in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.value.lineno, node.value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def references(source: str) -> list:
    """(line, name) of each file or folder name in `source`'s docstrings and comments."""
    found = []
    for first_line, text in prose(source):
        for pattern in (FILE, FOLDER):
            for match in pattern.finditer(text):
                found.append((first_line + text.count("\n", 0, match.start()), match.group(1)))
    return sorted(found)


def resolves(name: str, module: Path) -> bool:
    """Whether `name`, written in `module`, is a file (or, ending in `/`, a folder) of the tree."""
    folder = module.parent
    exists = Path.is_dir if name.endswith("/") else Path.is_file
    return any(exists(base / name) for base in (ROOT, PACKAGE, folder, folder.parent))


def dangling(source: str, module: Path) -> list:
    """(line, name) of each reference in `source` (the text of `module`) that names nothing here."""
    return [
        (line, name)
        for line, name in references(source)
        if name not in NOT_IN_REPOSITORY and not resolves(name, module)
    ]


def _relative(module: Path) -> str:
    return module.relative_to(ROOT).as_posix()


def test_docstrings_and_comments_name_only_files_that_exist():
    stale = [
        f"{_relative(module)}:{line}: {name}"
        for module in scanned_modules()
        for line, name in dangling(module.read_text(encoding="utf-8"), module)
    ]
    assert not stale, (
        "docstrings or comments name files that do not exist (point them at the file that "
        "holds the thing now, or reword):\n" + "\n".join(stale)
    )


def test_a_made_up_reference_is_dangling():
    source = (
        '"""See `models/kv_cache.py`, `backends/cpu/`, BENCHMARKS.md and `models/no_such_module.py`."""\n'
        "\n"
        "# the old home was compilation/gone.py; a user's config.json is not ours\n"
        "X = 1\n"
        '"""Attribute docstring naming `no_such_folder/`."""\n'
    )
    module = PACKAGE / "generation" / "synthetic.py"
    assert dangling(source, module) == [
        (1, "models/no_such_module.py"),
        (3, "compilation/gone.py"),
        (5, "no_such_folder/"),
    ]


def test_an_existing_reference_passes():
    source = '"""Drives the loop (`loop.py`, see ARCHITECTURE.md and bench/serve.py)."""\n'
    assert references(source) == [(1, "ARCHITECTURE.md"), (1, "bench/serve.py"), (1, "loop.py")]
    assert dangling(source, PACKAGE / "generation" / "synthetic.py") == []


@pytest.mark.parametrize(
    "module, name, found",
    [
        ("generation/x.py", "loop.py", True),  # the module's own folder
        ("models/x.py", "loop.py", False),  # a bare name is not looked up in other packages
        ("generation/speculative/x.py", "loop.py", True),  # the parent package
        ("backends/x.py", "cpu/threads.py", True),  # a subpackage
        ("backends/cpu/x.py", "xla/", True),  # a sibling package
        ("models/x.py", "compilation/regions.py", True),  # src/staticformers/
        ("models/x.py", "bench/serve.py", True),  # the repository root
        ("models/x.py", "backends/cpu/", True),
        ("models/x.py", "backends/cpu/threads.py/", False),  # a file is not a folder
        ("models/x.py", "models/", True),
        ("models/x.py", "models/kv_cache.md", False),
    ],
)
def test_resolution_rules(module, name, found):
    assert resolves(name, PACKAGE / module) is found


@pytest.mark.parametrize(
    "text",
    [
        "https://github.com/org/repo/blob/main/models/no_such.py",  # a URL
        "/proc/pressure/cpu and /v1/no_such/",  # absolute paths
        "$STATICFORMERS_CACHE/no_such/",  # under an environment variable's folder
        "chat_templates/<name>.jinja",  # a placeholder
        "model.layers.0.mlp and grad_scale.ScaleGrad",  # dotted names, no file extension
    ],
)
def test_what_is_not_a_reference(text):
    assert references(f'"""{text}"""\n') == []
