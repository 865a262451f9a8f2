"""How dsc's fused Triton kernels are launched, configured and planned.

- **Lazy Triton.** Kernel bodies are plain functions in their op files that use the module
  global `tl`; `jit(fn)` imports triton on first use, binds `tl` in fn's module and applies
  `triton.jit`. Importing an op file never imports triton, so CPU machines (and the compiler)
  need no GPU toolchain, and tests can set TRITON_INTERPRET=1 before the first launch.
- **Tuning table.** Launch configurations live in kernels/tuning.json:
  `{arch: {kernel: {shape_class: {"num_warps": ..., ...}}}}` with arch "sm_90" for H100/H200
  and "default" for anything else (the Triton interpreter included). `scripts/tune_kernels.py`
  rewrites the sm_90 rows on a GPU. A kernel's wrapper (at run time) and its planner (in the
  `plan_kernels` pass, at compile time) call the same `<op>_config` function, so plan.json
  records the configuration the runtime uses on that arch.
- **Planners.** Each op file registers, per op, a function of the op's arguments (fake tensors
  and literals) returning `{"name": kernel, "config": {...}, "launches": n}` for a target arch;
  `plan_kernels` looks them up by stable op name (`dsc.add_rmsnorm.default`).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import torch

TARGET_ARCH = "sm_90"  # what `dsc compile` plans for (H100 / H200)
TUNING_FILE = Path(__file__).with_name("tuning.json")

_JITTED: dict[Callable, Any] = {}
PLANNERS: dict[str, Callable[..., dict]] = {}


@functools.cache
def _triton():
    import triton
    import triton.language as tl

    return triton, tl


def jit(fn: Callable):
    """`triton.jit(fn)`, made on first use (binds `tl` in fn's module first)."""
    if fn not in _JITTED:
        triton, tl = _triton()
        fn.__globals__["tl"] = tl
        _JITTED[fn] = triton.jit(fn)
    return _JITTED[fn]


def arch_of(device: torch.device) -> str:
    """Tuning-table key for a device: "sm_90" for capability 9.0, "default" off-GPU."""
    if device.type != "cuda":
        return "default"
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


@functools.cache
def tuning_table() -> dict:
    return json.loads(TUNING_FILE.read_text())


def tuned(kernel: str, shape_class: str, arch: str, default: dict) -> dict:
    """`default` overridden by the table's entry for (arch, kernel, shape_class), if any."""
    entry = tuning_table().get(arch, {}).get(kernel, {}).get(shape_class, {})
    return {**default, **entry}


COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # buffers replaced by larger ones: graphs captured earlier still use them


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for kernels that elect the last program of a group with an atomic
    counter and reset it to 0 (decode attention's splits of one (sequence, kv head), the
    split-K W8A16 GEMM's splits of one tile): one buffer per device shared by all of them,
    since launches on one stream run one after another and each leaves its counters at 0.
    Allocated (zeroed) on first use, then kept; a larger request gets a larger buffer, and the
    old one stays allocated for the CUDA graphs that captured its address."""
    c = COUNTERS.get(device)
    if c is None or c.numel() < n:
        if c is not None:
            _OUTGROWN.append(c)
        c = COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x viewed as [rows, x.shape[-1]] without a copy when its leading dims collapse into one
    strided dim with unit stride in the last: (x or a contiguous copy, rows, row_stride)."""
    n = x.shape[-1]
    lead = [(s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1]
    ok = x.stride(-1) == 1 or n == 1
    for (s0, st0), (s1, st1) in zip(lead, lead[1:]):
        ok = ok and st0 == st1 * s1
    if not ok:
        x = x.contiguous()
        lead = [(s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1]
    rows = x.numel() // n if n else 0
    return x, rows, (lead[-1][1] if lead else n)


def compile_for_arch(fn: Callable, types: dict[str, str], constexprs: dict[str, Any],
                     num_warps: int = 4, capability: int = 90):
    """Compile a kernel ahead of time for a GPU arch (no GPU needed): `types` gives the
    Triton type of every runtime argument ("*fp16", "i32", "fp32"), `constexprs` the values
    of the constexpr ones. Returns triton's CompiledKernel (asm["cubin"] is the binary)."""
    triton, _ = _triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = jit(fn)
    signature = {**types, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})


def planner(*ops: str):
    """Register `fn(*op_args, arch=...) -> {"name", "config", "launches"}` for these ops."""
    def register(fn):
        for op in ops:
            PLANNERS[op] = fn
        return fn
    return register
