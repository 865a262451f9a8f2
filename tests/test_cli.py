"""The `dsc` command line's set-up: -h, --version, help text for every flag, the commands'
imports (`dsc inspect` reads JSON: no torch), and a missing dependency as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer.main

import dsc
from dsc.cli import app

HEAVY = ("torch", "transformers", "triton", "safetensors", "dsc.kernels", "dsc.compiler", "dsc.runtime.engine")

# runs `dsc ARGS...` in this process (optionally with modules made unimportable), then prints
# which heavy modules it imported as the last line of stderr
_RUN = rf"""
import json, sys
blocked, argv = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in blocked:
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError, as without the package
sys.argv = ["dsc", *argv]
from dsc.cli import main
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code or 0
sys.stdout.flush()
heavy = [m for m in {HEAVY!r} if sys.modules.get(m) is not None]
print(json.dumps({{"code": code, "imported": heavy}}), file=sys.stderr)
"""


def run_dsc(*argv: str, blocked: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(list(blocked)), json.dumps(list(argv))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = r.stderr.strip().splitlines()
    assert lines, r.stderr
    return r, json.loads(lines[-1])


def test_help_and_version_import_nothing_heavy():
    r, info = run_dsc("-h")
    assert info == {"code": 0, "imported": []}, r.stderr
    for command in ("compile", "generate", "inspect", "bench", "diff"):
        assert command in r.stdout
    assert "--version" in r.stdout
    r, info = run_dsc("--version")
    assert info == {"code": 0, "imported": []} and r.stdout.strip() == f"dsc {dsc.__version__}", r.stderr
    r, info = run_dsc("generate", "-h")
    assert info["code"] == 0 and "--max-new-tokens" in r.stdout and info["imported"] == [], r.stderr


def test_every_flag_and_argument_has_help():
    """A flag without help text is a question for the user: every command's options and
    arguments say what they take."""
    root = typer.main.get_command(app)
    missing = [
        f"{name} {p.name}"
        for name, cmd in root.commands.items()
        for p in cmd.params
        if not (getattr(p, "help", None) or "").strip()
    ]
    assert not missing, missing
    assert [p.name for p in root.params if not p.help] == []


def test_inspect_reads_the_artifact_without_torch(compile_artifact):
    """`dsc inspect` reads the manifest, the plan and the rank files' headers: no torch, no
    transformers, no kernels; it works where torch cannot be imported at all."""
    art = compile_artifact("llama-tiny", dtype="fp32")
    r, info = run_dsc("inspect", str(art), "--json")
    assert info == {"code": 0, "imported": []}, r.stderr
    got = json.loads(r.stdout)
    assert got["tp"] == 1 and got["programs"]["decode"]["launches"] > 0
    assert got["attention_windows"] == {"0": json.loads((art / "plan.json").read_text())["model"]["layers"]}
    r, info = run_dsc("inspect", str(art), "--json", blocked=("torch",))
    assert info["code"] == 0 and json.loads(r.stdout) == got, r.stderr


@pytest.mark.parametrize(
    "command", [["generate", "{art}", "--token-ids", "1,2"], ["bench", "{art}"], ["compile", "{ckpt}", "-o", "{out}"]]
)
def test_a_missing_torch_is_one_line(command, compile_artifact, make_checkpoint, tmp_path):
    art, ckpt = compile_artifact("llama-tiny", dtype="fp32"), make_checkpoint("llama-tiny")
    argv = [a.format(art=art, ckpt=ckpt, out=tmp_path / "out") for a in command]
    r, info = run_dsc(*argv, blocked=("torch",))
    lines = r.stderr.strip().splitlines()
    assert info["code"] == 2 and lines[:-1] == ["error: torch is not installed: pip install torch"], r.stderr
    assert not (tmp_path / "out").exists()
