"""Helpers of the GPU check suite's files (imported by name: pytest puts this folder on sys.path,
and a section file run as a script has it as its own folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def write_summary(name: str, data) -> None:
    """$OUT/<name>.json when OUT is set: the section's numbers beside pytest's pass/fail."""
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def out_problems(out, err: float, limit: float, caches=()) -> list[str]:
    """A kernel case's problems: NaN in out, a relative error past its limit, and each cache
    (name, got, want) that differs from what the reference wrote (NaN poison equal to NaN)."""
    problems = []
    if out.isnan().any():
        problems.append(f"NaN in out at {out.isnan().nonzero()[:3].tolist()}")
    if not err <= limit:
        problems.append(f"relative error {err:.3g} > {limit:.3g}")
    for what, got, want in caches:
        if not torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)):
            problems.append(f"{what} differs at {(got.nan_to_num(7.0) != want.nan_to_num(7.0)).nonzero()[:3].tolist()}")
    return problems


# the interpreter smoke variants: what the ordinary (CPU) suite runs of a section; on a GPU
# machine the section's `gpu` tests run the same code at real shapes instead
cpu_smoke = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke variant: the gpu tests cover it here")


def run_smoke(script: Path, *args: str, interpret: bool = True, timeout: int = 600, env: dict | None = None):
    """Run a section file as a script (its CPU smoke mode) in a child process; the child's
    output. TRITON_INTERPRET=1 must be set before triton is first imported, hence the child."""
    child_env = {**os.environ, **(env or {})}
    child_env.pop("TRITON_INTERPRET", None)
    if interpret:
        child_env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=child_env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


sys.path.insert(0, str(ROOT / "scripts"))  # scripts/timing.py: the one timing helper
