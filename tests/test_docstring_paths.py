"""Docstrings name only files that exist: a module, class or function docstring that cites a source, script,
page or requirements file (`*.py`, `*.md`, `*.sh`, `*.toml`, `*.cpp`, `*.yml`, `*.txt`) cites one that this
repository holds, so a rename that leaves a stale pointer fails here rather than misleading a reader.

A name matches a file whose path ends with it (`models/decoder.py`, `decoder.py`). Two kinds of names are not
pointers and pass: `llama.cpp` (the project), and a file the module itself reads or writes (its name is a
string in the module's code, such as the summary a benchmark writes)."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("src", "tests", "bench", "examples")
NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|sh|toml|cpp|yml|yaml|txt))\b")
NOT_POINTERS = {"llama.cpp"}


def _repository_files() -> list:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("site", "build", "__pycache__")]
        found += [os.path.relpath(os.path.join(folder, f), ROOT).replace(os.sep, "/") for f in files]
    return found


def _python_files() -> list:
    found = []
    for top in SCANNED:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            found += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def stale_names(path: str, repository: list) -> list:
    """(line, name) for each file name in `path`'s docstrings that names no file here."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    documented = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    docstrings = {id(n.body[0].value) for n in documented if ast.get_docstring(n, clean=False)}
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in docstrings}
    stale = []
    for node in documented:
        text = ast.get_docstring(node, clean=False)
        for match in NAME.finditer(text or ""):
            name = match.group(1)
            if name in NOT_POINTERS or any(os.path.basename(name) in s for s in strings):
                continue
            if not any(f == name or f.endswith("/" + name) for f in repository):
                stale.append((getattr(node, "lineno", 1), name))
    return stale


def test_docstrings_name_only_files_that_exist():
    repository = _repository_files()
    stale = [f"{os.path.relpath(path, ROOT)}:{line}: {name}" for path in _python_files()
             for line, name in stale_names(path, repository)]
    assert not stale, "docstrings name files that do not exist (rename the pointer):\n" + "\n".join(stale)


def test_a_stale_pointer_is_found(tmp_path):
    module = tmp_path / "module.py"
    module.write_text('"""Reads `config.json`; see `models/decoder.py` and `models/no_such_module.py`."""\n'
                      'OUT = "report.md"\n\n\ndef f():\n    """Writes report.md, unlike `gone.sh`."""\n')
    assert stale_names(str(module), _repository_files()) == [(1, "models/no_such_module.py"), (5, "gone.sh")]
