"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors, and the links of README.md and of
every page lead somewhere: internal links to files that exist and to headings those files have; external
links well formed (nothing is fetched: the tests run offline).

The build goes into a temporary folder, never into the clone. Code blocks are run by tests/test_readme.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
FENCED = re.compile(r"^```.*?^```", re.M | re.S)


def pages() -> list[str]:
    found = [os.path.join(ROOT, "README.md")]
    for folder, _, files in os.walk(DOCS):
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".md")]
    return found


def anchors(path: str) -> set[str]:
    """The ids MkDocs gives the headings of a Markdown file (Python-Markdown's toc slugs)."""
    from markdown.extensions.toc import slugify

    with open(path, encoding="utf-8") as f:
        text = FENCED.sub("", f.read())
    seen, out = {}, set()
    for _, title in HEADING.findall(text):
        plain = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = slugify(plain, "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}_{n}")
    return out


def links(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = FENCED.sub("", f.read())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return LINK.findall(text)


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs")  # the `test` extra installs it
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "families" / "index.html").exists()
    assert not os.path.exists(os.path.join(ROOT, "site"))


def test_every_link_leads_somewhere():
    pytest.importorskip("markdown")  # mkdocs' own dependency
    problems = []
    for page in pages():
        here = os.path.dirname(page)
        for target in links(page):
            where = f"{os.path.relpath(page, ROOT)} -> {target}"
            parts = urllib.parse.urlsplit(target)
            if parts.scheme in ("http", "https"):
                if not parts.netloc or "." not in parts.netloc or " " in target:
                    problems.append(f"{where}: not a well-formed address")
                continue
            if parts.scheme:
                problems.append(f"{where}: a {parts.scheme}: link")
                continue
            file = os.path.normpath(os.path.join(here, parts.path)) if parts.path else page
            if not os.path.exists(file):
                problems.append(f"{where}: {os.path.relpath(file, ROOT)} does not exist")
            elif parts.fragment and (not file.endswith(".md") or parts.fragment not in anchors(file)):
                problems.append(f"{where}: no heading #{parts.fragment} in {os.path.relpath(file, ROOT)}")
    assert not problems, "\n".join(problems)


def test_the_link_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    pytest.importorskip("markdown")
    (tmp_path / "a.md").write_text(
        "# Title here\n\n## Second `code` part\n\n[x](b.md) [y](#second-code-part) "
        "[z](#nothing)\n```\n[not](a link.md)\n```\n"
    )
    assert links(str(tmp_path / "a.md")) == ["b.md", "#second-code-part", "#nothing"]
    assert anchors(str(tmp_path / "a.md")) == {"title-here", "second-code-part"}


def test_the_family_table_is_one_row_per_family_and_easy_to_extend():
    """docs/families.md: one table, a row per family, four columns (new families add a row)."""
    with open(os.path.join(DOCS, "families.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    # the family table: the rows after its header, up to the first line that is not a row (other tables follow)
    start = next(i for i, line in enumerate(lines) if line.startswith("| family")) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("| `"):
            break
        rows.append(line)
    names = [row.split("`")[1] for row in rows]
    assert {
        "Qwen3ForCausalLM",
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "MistralForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
    } <= set(names)
    assert all(row.count(" | ") == 3 for row in rows), "each row: family | needs | on the Hub | proven"
