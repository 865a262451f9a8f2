"""Kernel tests that run in a child process: TRITON_INTERPRET=1 must be set before triton is
first imported, and other test files import triton, so a kernel test file runs its cases as a
script (`python FILE interpret|aot OUT.json`) and its tests read the JSON.

    interpreted, compiled = child_fixtures(__file__, "kernels")   # module-scoped fixtures
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def run_child(script: str, mode: str, out) -> dict:
    """Run `script mode out` with the interpreter on for mode "interpret"; its JSON results."""
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, script, mode, str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def pdl_check(kernel, pdl: bool, allowed_before_wait: frozenset[str] = frozenset()) -> str:
    """ "ok" if a kernel compiled with PDL=False has no griddepcontrol instruction, and one compiled
    with PDL=True has launch_dependents and wait in its PTX and issues no memory operation before
    the first wait but `allowed_before_wait`, named "<op> <variable>" ("load w", "asm
    prefetch.global.L2": inline asm with side effects; pure asm such as the int8 conversion is
    arithmetic); else what is wrong. Read in the TTGIR, which is in program order and comes after
    software pipelining (whose prologue issues loads of later iterations early: "copy x").
    (Triton 3.6 lowers the gdc calls to inline asm, 3.9 to tt ops.)"""
    ptx = kernel.asm.get("ptx", "")
    if not pdl:
        return "griddepcontrol in a kernel built without PDL" if "griddepcontrol" in ptx else "ok"
    missing = [i for i in ("griddepcontrol.launch_dependents", "griddepcontrol.wait") if i not in ptx]
    if missing:
        return f"PTX lacks {missing}"
    before = []
    ops = r"load|store|atomic_\w+|async_\w*copy_global_to_local|descriptor_\w+|elementwise_inline_asm"
    for line in kernel.asm["ttgir"].splitlines():
        if "tt.grid_dependency_wait" in line or "griddepcontrol.wait" in line:
            break
        m = re.search(rf'(?:%([A-Za-z]\w*?)(?:_\d+)?(?::\d+)? = )?tt[gn]*\.({ops})(?: "([^ ;"]*))?', line)
        asm = m and m.group(2) == "elementwise_inline_asm"
        if m and not (asm and ("pure = true" in line or "griddepcontrol.launch_dependents" in line)):
            op = "asm" if asm else "copy" if "copy" in m.group(2) else m.group(2)
            before.append(f"{op} {m.group(3) if op == 'asm' else m.group(1) or ''}".strip())
    bad = sorted(set(before) - allowed_before_wait)
    return f"before the wait: {bad}" if bad else "ok"


def spill_bytes(kernel) -> int:
    """Bytes of registers an sm_90 build spills to local memory (stores), from `ptxas -v` (the
    ptxas this triton runs) on the kernel's PTX: triton keeps the count only once a GPU loads it."""
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(kernel.asm["ptx"])
        proc = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", str(Path(d, "k.ptx")), "-o", str(Path(d, "k.cubin"))],
            capture_output=True,
            text=True,
            check=True,
        )
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", proc.stdout + proc.stderr))


def child_fixtures(script: str, prefix: str):
    """The `interpreted` and `compiled` (sm_90, no GPU) result fixtures of a kernel test file."""

    @pytest.fixture(scope="module")
    def interpreted(tmp_path_factory):
        return run_child(script, "interpret", tmp_path_factory.mktemp(f"{prefix}-interpret") / "results.json")

    @pytest.fixture(scope="module")
    def compiled(tmp_path_factory):
        return run_child(script, "aot", tmp_path_factory.mktemp(f"{prefix}-aot") / "results.json")

    return interpreted, compiled
