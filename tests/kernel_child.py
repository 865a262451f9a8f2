"""Kernel tests that run in a child process: TRITON_INTERPRET=1 must be set before triton is
first imported, and other test files import triton, so a kernel test file runs its cases as a
script (`python FILE interpret|aot OUT.json`) and its tests read the JSON.

    interpreted, compiled = child_fixtures(__file__, "kernels")   # module-scoped fixtures
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_child(script: str, mode: str, out) -> dict:
    """Run `script mode out` with the interpreter on for mode "interpret"; its JSON results."""
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, script, mode, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def child_fixtures(script: str, prefix: str):
    """The `interpreted` and `compiled` (sm_90, no GPU) result fixtures of a kernel test file."""
    @pytest.fixture(scope="module")
    def interpreted(tmp_path_factory):
        return run_child(script, "interpret", tmp_path_factory.mktemp(f"{prefix}-interpret") / "results.json")

    @pytest.fixture(scope="module")
    def compiled(tmp_path_factory):
        return run_child(script, "aot", tmp_path_factory.mktemp(f"{prefix}-aot") / "results.json")

    return interpreted, compiled
