"""The layers are enforced: import-linter's contracts in pyproject.toml hold, and fail when an
import that breaks them is planted; no import cycle anywhere in the tree (two modules of one folder included); the
op vocabulary has one source (kernels/registry.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import dsc

ROOT = Path(dsc.__file__).parent
FOLDERS = ("compiler", "passes", "kernels", "runtime", "serve")


def _copy_package(tmp_path: Path) -> Path:
    """The package's Python files and pyproject.toml under tmp_path/dsc."""
    dest = tmp_path / "dsc"
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for f in [*ROOT.glob("*.py"), *(p for d in FOLDERS for p in (ROOT / d).glob("*.py"))]:
        (dest / f.parent.relative_to(ROOT)).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest / f.relative_to(ROOT))
    return tmp_path


def _lint_imports(project: Path) -> subprocess.CompletedProcess:
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        env={"PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _plant(project: Path, module: str, line: str) -> None:
    f = project / "dsc" / f"{module.replace('.', '/')}.py"
    f.write_text(f.read_text() + f"\n\ndef _planted():\n    {line}\n")


def test_import_contracts_hold(tmp_path):
    r = _lint_imports(_copy_package(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 kept, 0 broken" in r.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        # kernels -> compiler closes a cycle (the compiler imports every kernel file)
        ("kernels.registry", "from dsc.compiler import pipeline", "cli -> compiler"),
        ("runtime.engine", "import transformers", "production loads an artifact"),
        ("passes.plan_kernels", "from dsc.runtime import inspect", "passes | runtime"),
        ("compiler.ir", "from dsc.passes import canonicalize", "compiler IR"),
        ("serve.app", "import transformers", "the server runs an artifact"),
        ("runtime.engine", "from dsc.serve import app", "compiler | serve"),
    ],
)
def test_a_planted_import_breaks_a_contract(tmp_path, module, line, contract):
    project = _copy_package(tmp_path)
    _plant(project, module, line)
    r = _lint_imports(project)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "BROKEN" in r.stdout and contract in r.stdout.split("Broken contracts")[-1], r.stdout
    assert f"dsc.{module}" in r.stdout


def _cycles(graph: grimp.ImportGraph) -> list[set[str]]:
    """Strongly connected components of more than one module (the root facade `dsc`, whose
    functions import the compiler and the runtime lazily, left out)."""
    modules = sorted(m for m in graph.modules if m != "dsc")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v) - {"dsc"}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or v not in comp:
                comp.add(stack.pop())
            if len(comp) > 1:
                out.append(comp)

    for m in modules:
        if m not in index:
            visit(m)
    return out


def test_no_import_cycle_anywhere_in_the_tree():
    assert [sorted(c) for c in _cycles(grimp.build_graph("dsc"))] == []


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("dsc.kernels.registry", "dsc.compiler.pipeline"),  # across folders
        ("dsc.kernels.launch", "dsc.kernels.attention"),  # within one folder
    ],
)
def test_the_cycle_check_sees_a_planted_import(importer, imported):
    graph = grimp.build_graph("dsc")
    graph.add_import(importer=importer, imported=imported)
    assert any({importer, imported} <= c for c in _cycles(graph))


def test_every_dsc_op_declares_its_traits():
    import torch

    from dsc.kernels import registry

    registered = {
        f"dsc.{name}.{overload}"
        for name in dir(torch.ops.dsc)
        if not name.startswith("_")
        for packet in [getattr(torch.ops.dsc, name)]
        if isinstance(packet, torch._ops.OpOverloadPacket)
        for overload in packet.overloads()
    }
    assert registered and registered <= set(registry.DECLARED_OPS)


def test_the_collective_vocabulary_comes_from_the_registry():
    from dsc.kernels import registry
    from dsc.runtime import engine, plan

    assert set(engine.ALL_REDUCE_OPS) <= set(engine.SLOT_OPS)
    assert "dsc.all_gather.default" in engine.SLOT_OPS and "dsc.all_gather.default" not in engine.ALL_REDUCE_OPS
    assert set(plan.ATTENTION_OPS) == {
        "dsc.attention.default",
        "dsc.rotary_attention.default",
        "dsc.paged_attention.default",
    }
    assert all(registry.traits(op).simulate is not None for op in engine.SLOT_OPS)
    assert (
        registry.fused("dsc.linear.default", "dsc.all_reduce_add_rmsnorm.default")
        == "dsc.linear_all_reduce_add_rmsnorm.default"
    )
