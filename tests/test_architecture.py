"""The declared architecture holds: layers import downward only (pyproject's import-linter contracts), no
module imports another in a cycle, and no module outside the backends tests a device's type."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import staticformers

SRC = os.path.dirname(os.path.abspath(staticformers.__file__))
ROOT = os.path.dirname(os.path.dirname(SRC))


def test_the_layer_contracts_are_kept():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run(
        [lint, "--config", os.path.join(ROOT, "pyproject.toml"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2 kept, 0 broken" in out.stdout


def _imports(path: str, module: str, known: set) -> set:
    """Modules of the package that `path` imports, lazy ones inside functions included."""
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    annotations = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }  # never run: not dependencies
    found = set()
    for node in ast.walk(tree):
        if id(node) in annotations:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            head = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(head + (node.module.split(".") if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def test_no_module_imports_itself_through_others():
    """Lazy imports count (import-linter sees them too, but allows a cycle inside one layer)."""
    paths = {}
    for folder, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(SRC))[:-3].replace(os.sep, ".")
                paths[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    # a package's __init__ re-exporting its own children is how a package is built, not a cycle
    graph = {
        m: {t for t in _imports(p, m, set(paths)) if not (p.endswith("__init__.py") and t.startswith(m + "."))}
        for m, p in paths.items()
    }
    # a module is on a cycle when it reaches itself
    on_cycle = []
    for start in graph:
        seen, stack = set(), list(graph[start])
        while stack:
            m = stack.pop()
            if m == start:
                on_cycle.append(start)
                break
            if m not in seen:
                seen.add(m)
                stack.extend(graph.get(m, ()))
    assert on_cycle == []


def test_no_device_type_tests_outside_the_backends():
    offenders = []
    for folder, _, files in os.walk(SRC):
        if os.path.relpath(folder, SRC).split(os.sep)[0] == "backends":
            continue
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name), encoding="utf-8").read()
                for i, line in enumerate(text.splitlines(), 1):
                    if re.search(r"device\.type|\.type\s*(==|!=|in\b)", line):
                        offenders.append(f"{os.path.relpath(os.path.join(folder, name), SRC)}:{i}: {line.strip()}")
    assert offenders == []


def test_every_folder_says_what_it_holds_and_may_import():
    for folder, dirs, files in os.walk(SRC):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if folder == SRC or "__init__.py" not in files:
            continue
        doc = ast.get_docstring(ast.parse(open(os.path.join(folder, "__init__.py"), encoding="utf-8").read()))
        assert doc, folder
        if os.path.dirname(folder) == SRC:  # a layer
            assert "May import" in doc, folder
