"""How dsc's fused Triton kernels are launched, configured and planned.

- **Lazy Triton.** Kernel bodies are plain functions in their op files that use the module
  global `tl`; `triton_jit(fn)` imports triton on first use, binds `tl` in fn's module and
  applies `triton.jit`. Importing an op file never imports triton, so CPU machines (and the
  compiler) need no GPU toolchain, and tests can set TRITON_INTERPRET=1 before the first launch.
  Wrappers launch `jit(fn)[grid](...)`: a kernels/binaries.py `Kernel`, which runs the loaded
  artifact's ahead-of-time binary for the launch when it has one, else `triton_jit(fn)`.
- **Tuning table.** Launch configurations live in kernels/tuning.json:
  `{arch: {kernel: {shape_class: {"num_warps": ..., ...}}}}` with arch "sm_90" for H100/H200
  and "default" for anything else (the Triton interpreter included). `scripts/tune_kernels.py`
  rewrites the sm_90 rows on a GPU. A kernel's wrapper (at run time) and its planner (in the
  `plan_kernels` pass, at compile time) call the same `<op>_config` function, so plan.json
  records the configuration the runtime uses on that arch.
- **Planners.** Each op file registers, per op, a function of the op's arguments (fake tensors
  and literals) returning `{"name": kernel, "config": {...}, "launches": n}` for a target arch;
  `plan_kernels` looks them up by stable op name (`dsc.add_rmsnorm.default`).
- **Programmatic Dependent Launch (PDL).** A decode step is ~300 short kernels back to back; on
  Hopper a kernel launched with PDL may start while its predecessor still runs. The decode-path
  kernels (GEMVs, int8 matmuls, norms, activations, rotary, decode attention, the fused
  all-reduce + norm) take a `PDL` constexpr and are launched with `launch_pdl` (both from
  `pdl_options`). With PDL, each program calls `gdc_launch_dependents()` first (the next
  kernel may be scheduled; decode attention calls it after its key loop), may read read-only
  data (weights, scales) before `gdc_wait()` (which returns once the previous kernel has
  finished and its writes are visible), and reads activations, caches and counters, and writes
  anything, only after it: the runtime's memory plan reuses buffers, so a write before the wait
  could clobber what the previous kernel still reads. Every program waits before it exits, so
  a kernel's end implies its predecessors' (decode attention's early reads rely on it: the
  position and cache slots written in earlier steps, see `_decode_kernel`). Without PDL the
  kernels compile to what they were before. `DSC_PDL=auto|off` (`pdl_enabled`; auto, the default, is on).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsc import switches
from dsc.kernels.binaries import Kernel, recording_arch

TARGET_ARCH = "sm_90"  # what `dsc compile` plans for (H100 / H200)
TUNING_FILE = Path(__file__).with_name("tuning.json")

# for planning and for recording a target's launches (kernels/binaries.py); at run time the
# device says (H100 SXM / H200: 132; A100: 108; A10 / A40: 84; L40S: 142)
SM_COUNT = {"sm_90": 132, "sm_80": 108, "sm_86": 84, "sm_89": 142, "default": 4}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        arch = recording_arch(device)
        if arch is not None:
            return SM_COUNT.get(arch, SM_COUNT["sm_90"])
        return SM_COUNT["default"]  # interpreter runs: a few programs' worth, as on a tiny GPU
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_JITTED: dict[Callable, Any] = {}
_KERNELS: dict[Any, Kernel] = {}
PLANNERS: dict[str, Callable[..., dict]] = {}


@functools.cache
def _triton():
    import triton
    import triton.language as tl

    return triton, tl


def jit(fn: Callable) -> Kernel:
    """The kernel `fn` as dsc launches it (`jit(fn)[grid](*args, **kwargs)`): through its
    ahead-of-time binary when the loaded artifact has one for the launch (kernels/binaries.py),
    else through `triton_jit(fn)`."""
    return _kernel(fn, "triton")


def gluon_jit(fn: Callable) -> Kernel:
    """`jit` for a Gluon kernel (`gluon_triton_jit`)."""
    return _kernel(fn, "gluon")


def launched(jitted) -> Kernel:
    """A kernel Triton has jitted already (kernels/attention.py's, jitted in their module),
    as `jit` gives it."""
    k = _KERNELS.get(jitted)
    if k is None:
        k = _KERNELS[jitted] = Kernel(jitted.fn, "triton", lambda: jitted)
    return k


def _kernel(fn: Callable, dialect: str) -> Kernel:
    k = _KERNELS.get(fn)
    if k is None:
        make = (lambda: triton_jit(fn)) if dialect == "triton" else (lambda: gluon_triton_jit(fn))
        k = _KERNELS[fn] = Kernel(fn, dialect, make)
    return k


def triton_jit(fn: Callable):
    """`triton.jit(fn)`, made on first use (binds `tl` in fn's module first, and jits the
    `device` functions fn calls, under their names, so that Triton can inline them)."""
    if fn not in _JITTED:
        triton, tl = _triton()
        fn.__globals__["tl"] = tl
        _jit_callees(fn, "dsc_device", triton_jit)
        _JITTED[fn] = triton.jit(fn)
    return _JITTED[fn]


def gluon_triton_jit(fn: Callable):
    """`gluon.jit(fn)` made on first use, as `triton_jit` (binds `gl`, gluon's mma.sync `mma_v2`,
    and `tl` for the extras gluon shares, such as the PDL intrinsics). Gluon kernels place every
    tensor in an explicit layout; they need a CUDA GPU (the Triton interpreter cannot run them)
    or `compile_for_arch`."""
    if fn not in _JITTED:
        _, tl = _triton()
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.ampere import mma_v2

        fn.__globals__.update(gl=gl, mma_v2=mma_v2, tl=tl)
        _jit_callees(fn, "dsc_gluon_device", gluon_triton_jit)
        _JITTED[fn] = gluon.jit(fn)
    return _JITTED[fn]


def _jit_callees(fn: Callable, marker: str, jitter: Callable) -> None:
    """Rebind, in fn's module, each function fn calls that carries `marker` (`device`,
    `gluon_device`) to its jitted form, so that the kernel's dialect inlines it."""
    for name in fn.__code__.co_names:
        callee = fn.__globals__.get(name)
        if getattr(callee, marker, False):
            fn.__globals__[name] = jitter(callee)


def device(fn: Callable) -> Callable:
    """Mark a plain function as a Triton device function that kernels of its module call
    (one body for a step several kernels share); `jit` of a caller jits it."""
    fn.dsc_device = True
    return fn


def gluon_device(fn: Callable) -> Callable:
    """`device` for Gluon kernels: `gluon_jit` of a caller jits it with gluon.jit (a function
    serves one dialect: jitting binds the module-level name to that dialect's function)."""
    fn.dsc_gluon_device = True
    return fn


def arch_of(device: torch.device) -> str:
    """Tuning-table key for a device: "sm_90" for capability 9.0, "default" off-GPU (on the
    meta device while kernel launches are recorded: the recording's target)."""
    if device.type != "cuda":
        if (arch := recording_arch(device)) is not None:
            return arch
        return "default"
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def tuning_table() -> dict:
    """kernels/tuning.json, with the rows of DSC_TUNING's file (switches.py; for tuners and A/B
    benches, e.g. GEMV push rows side by side) replacing its own: {arch: {kernel: {shape_class: row}}}."""
    return _tuning_table(switches.TUNING)


@functools.cache
def _tuning_table(override: str) -> dict:
    table = json.loads(TUNING_FILE.read_text())
    if not override:
        return table
    rows = json.loads(Path(override).read_text())  # its layout checked when the switch was read
    for arch, kernels in rows.items():
        if not arch.startswith("_"):
            for kernel, shapes in kernels.items():
                table.setdefault(arch, {}).setdefault(kernel, {}).update(shapes)
    return table


def tuning_row(kernel: str, shape_class: str, arch: str) -> dict:
    """The table's entry for (arch, kernel, shape_class), {} if none."""
    return tuning_table().get(arch, {}).get(kernel, {}).get(shape_class, {})


def tuned(kernel: str, shape_class: str, arch: str, default: dict) -> dict:
    """`default` overridden by the table's entry for (arch, kernel, shape_class), if any."""
    return {**default, **tuning_row(kernel, shape_class, arch)}


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: on an NVIDIA GPU of capability >= 9.0
    (Hopper) with a triton that has the griddepcontrol intrinsics, never on CPU or in the Triton
    interpreter (it cannot run inline PTX). DSC_PDL=auto (the default): wherever it can, at every
    tp (with the GEMVs' EARLY rows in kernels/tuning.json, Llama-8B's tp=2 and tp=4 decode steps
    are faster with PDL than without); off: never."""
    if device.type != "cuda" and (arch := recording_arch(device)) is not None:
        return int(arch[3:]) >= 90  # recording a target's launches: its default, from capability 9.0
    if switches.PDL == "off" or device.type != "cuda" or _interpreting():
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_options(device: torch.device) -> dict:
    """Launch keywords of a PDL-capable kernel: the `PDL` constexpr and triton's `launch_pdl`,
    always equal (a kernel launched with PDL but compiled without the wait would race)."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")  # as triton reads it


@functools.cache
def _pdl_supported(index: int) -> bool:
    if torch.version.hip is not None or torch.cuda.get_device_capability(index) < (9, 0):
        return False
    _, tl = _triton()
    return hasattr(tl.extra.cuda, "gdc_wait")  # the griddepcontrol intrinsics (triton 3.6 and 3.9 have them)


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
    for (_s0, st0), (s1, st1) in zip(lead, lead[1:]):
        ok = ok and st0 == st1 * s1
    if not ok:
        x = x.contiguous()
        lead = [(s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1]
    rows = x.numel() // n if n else 0
    return x, rows, (lead[-1][1] if lead else n)


def compile_for_arch(
    fn: Callable,
    types: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int = 4,
    capability: int = 90,
    aligned: tuple[str, ...] = (),
    gluon: bool = False,
    num_stages: int | None = None,
):
    """Compile a kernel ahead of time for a GPU arch (no GPU needed): `types` gives the
    Triton type of every runtime argument ("*fp16", "i32", "fp32"), `constexprs` the values
    of the constexpr ones (those with a default, such as PDL, may be left out), `aligned` the
    arguments to specialize as multiples of 16, as a launch does for torch's pointers and
    such sizes (vectorized loads and software pipelining depend on it), `num_stages` the
    launch option (triton's default where None). Returns triton's CompiledKernel
    (asm["cubin"] is the binary; metadata.shared its shared memory). gluon: fn is a Gluon
    kernel."""
    triton, _ = _triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = gluon_triton_jit(fn) if gluon else triton_jit(fn)
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs}
    signature = {**types, **{k: "constexpr" for k in constexprs}}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = (GluonASTSource if gluon else ASTSource)(kernel, signature, constexprs, attrs)
    options = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages is not None else {})}
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def planner(*ops: str):
    """Register `fn(*op_args, arch=...) -> {"name", "config", "launches"}` for these ops."""

    def register(fn):
        for op in ops:
            PLANNERS[op] = fn
        return fn

    return register
