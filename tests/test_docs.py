"""The docs hold the design once, stay current, and carry no project history.

- docs/passes.md is what scripts/gen_docs.py writes from the passes' docstrings today;
- README.md and docs/ hold no "session <n>" work-log lines, nor do the code and the tests;
- every `dsc` command that cli.py registers has a reference heading in README.md, and every
  README command heading names a registered command;
- README.md stays a product page (at most 250 lines), docs/ stays small (under 50 files);
- every relative link in README.md and docs/*.md points at a file that exists.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# where the history check looks: the product, as the project's rule names it
HISTORY_PATHS = ["README.md", "docs", "compiler", "passes", "kernels", "runtime", "cli.py", "tests"]
HISTORY = re.compile(r"session [0-9]", re.IGNORECASE)
TEXT_SUFFIXES = {".md", ".py", ".json", ".txt", ".toml", ".sh", ".cfg", ".ini", ".yaml", ".yml", ""}


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _history_lines(paths: list[Path]) -> list[str]:
    hits = []
    for top in paths:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for f in files:
            if f.suffix not in TEXT_SUFFIXES or "__pycache__" in f.parts:
                continue
            try:
                text = f.read_text()
            except UnicodeDecodeError:
                continue
            name = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
            hits += [
                f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)
            ]
    return hits


def test_generated_pages_are_current():
    gen = _gen_docs()
    assert "docs/passes.md" in gen.PAGES
    stale = [rel for rel, make in gen.PAGES.items() if not (ROOT / rel).exists() or (ROOT / rel).read_text() != make()]
    assert not stale, f"stale generated pages (run python scripts/gen_docs.py): {stale}"


def test_passes_page_lists_every_pass_in_pipeline_order():
    import types

    from dsc.compiler.pipeline import pipeline

    text = (DOCS / "passes.md").read_text()
    names = [
        n for n, _ in pipeline(types.SimpleNamespace(fuse=True, int8=True, fp8=False, int4=False, auto_precision=None))
    ]
    headings = re.findall(r"^## (\w+)$", text, re.MULTILINE)
    assert [h for h in headings if h in names] == names


def test_history_check_finds_a_planted_line(tmp_path):
    """The check itself can fail: a work-log line in a doc is reported."""
    planted = tmp_path / "note.md"
    planted.write_text("fine\nMeasured in Session " + "12 on an H200.\n")
    clean = tmp_path / "ok.md"
    clean.write_text("sessions of a server, batch 12\n")
    hits = _history_lines([tmp_path])
    assert len(hits) == 1 and hits[0].endswith("on an H200.")


def test_no_project_history_in_the_product():
    hits = _history_lines([ROOT / p for p in HISTORY_PATHS if (ROOT / p).exists()])
    assert not hits, "project history in the product (git keeps it):\n" + "\n".join(hits[:20])


def _cli_commands() -> set[str]:
    import typer.main

    from dsc.cli import app

    return set(typer.main.get_command(app).commands)


def _readme_command_headings() -> set[str]:
    return set(re.findall(r"^#{2,4} `dsc ([a-z][a-z0-9-]*)", README.read_text(), re.MULTILINE))


def test_every_command_has_a_readme_reference():
    commands, documented = _cli_commands(), _readme_command_headings()
    assert {"compile", "generate"} <= commands
    assert commands - documented == set(), f"commands without a README reference heading: {commands - documented}"
    assert documented - commands == set(), f"README headings for commands cli.py lacks: {documented - commands}"


def test_readme_is_a_product_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the limit is 250"


def test_docs_folder_stays_small():
    files = [p for p in DOCS.rglob("*") if p.is_file()]
    assert len(files) < 50, f"docs/ holds {len(files)} files"


@pytest.mark.parametrize("page", [README] + sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = page.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not t.startswith("mailto:") and not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


# a repository path as code, comments and docs name one: a top folder, then a path
_PATH_REF = re.compile(r"(?<![\w/.-])((?:compiler|runtime|kernels|passes|serve|scripts|tests|docs|\.ci)/[\w./-]*\w)")
_ROOT_DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b")  # a doc in capitals: a file at the root
ARTIFACT_PATHS = {"kernels/binaries.json"}  # paths inside an artifact folder (docs/artifact.md), not the repository
REFERENCE_ROOTS = [
    "README.md",
    "Makefile",
    "pyproject.toml",
    "cli.py",
    "errors.py",
    "switches.py",
    "launch_counts.py",
    "docs",
    "compiler",
    "passes",
    "kernels",
    "runtime",
    "serve",
    "scripts",
    "tests",
    ".ci",
]


def _names_a_file(ref: str) -> bool:
    ref = ref.split("#")[0].rstrip(".")
    stem = Path(ref).stem
    if ref in ARTIFACT_PATHS or ref.endswith("_") or len(stem) == 1 or (ROOT / ref).exists():
        return True  # a placeholder (scripts/X.py, passes/fuse_*), or there
    head, _, _attr = ref.rpartition(".")
    return (ROOT / (ref + ".py")).exists() or (head and (ROOT / (head + ".py")).exists())  # a module, a module.name


def test_paths_named_in_code_and_docs_exist():
    """A comment, docstring or doc that names a repository path names one that exists (a moved
    or removed file takes its mentions with it); a command quoted `at commit X` keeps its path."""
    missing = []
    for top in REFERENCE_ROOTS:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if f.suffix not in TEXT_SUFFIXES or rel.startswith(("docs/results/", "tests/golden/", "tests/data/")):
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if "at commit" in line:
                    continue
                for m in _PATH_REF.finditer(line):
                    if not _names_a_file(m.group(1)):
                        missing.append(f"{rel}:{n}: {m.group(1)}")
                for m in _ROOT_DOC.finditer(line):
                    if not (ROOT / m.group(1)).exists():
                        missing.append(f"{rel}:{n}: {m.group(1)}")
    assert not missing, missing
