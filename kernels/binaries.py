"""Kernel binaries: the launch specs of dsc's Triton kernels, and a launcher for ahead-of-time
compiled cubins that needs no Triton JIT, no Triton cache and no `ptxas`.

- **Spec.** What decides the machine code of one launch: the kernel (module and name, and the
  sha256 of the source files it is built from), each runtime argument's Triton type and whether
  it is specialized as a multiple of 16, the constexprs (those given, those with defaults, and
  the arguments Triton turns into constants: None, and integers equal to 1), and the launch
  options (num_warps, num_stages, launch_pdl). `spec_of` computes it from a launch's arguments
  by Triton's own specialization rules, in dsc's code, so a spec recorded on the compile
  machine (from meta tensors: their pointers are storage offsets, as aligned as on a GPU) equals
  the spec the runtime computes from real tensors whatever Triton versions the two run.
- **Recording.** `recording(arch)` makes every `Kernel` launch record its spec instead of
  running (compiler/kernel_binaries.py runs a plan's programs on meta tensors under it), and
  makes `launch.arch_of` and `launch.pdl_enabled` answer for the target arch.
- **Binaries.** `install(binaries)` (the runtime, from a trusted artifact) gives the cubins for
  this GPU's arch; a `Kernel` launch whose spec has one runs it through the CUDA driver API
  (ctypes, `cuLaunchKernelEx`, with the programmatic-serialization attribute for PDL), on
  torch's current stream, so CUDA graphs capture it as any launch. A launch whose spec has none
  prints one line per kernel and runs through Triton's JIT, as without binaries.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# torch dtype -> Triton's pointer element type
DTYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
OPTIONS = (
    "num_warps",
    "num_stages",
    "num_ctas",
    "launch_pdl",
    "maxnreg",
    "enable_fp_fusion",
)  # launch options dsc passes
_I32 = 1 << 31
_I64 = 1 << 63


class Unsupported(Exception):
    """A launch whose spec dsc cannot state (an argument of a type no rule covers)."""


@dataclass(frozen=True)
class Spec:
    kernel: str  # "dsc.kernels.norm:_rmsnorm_kernel"
    dialect: str  # "triton" or "gluon"
    source: str  # sha256 of the source files the kernel is built from
    args: tuple  # ((name, type, aligned), ...) per runtime argument; type "constexpr" for constants
    constants: tuple  # ((name, value), ...) sorted
    options: tuple  # ((name, value), ...) sorted

    def to_json(self) -> dict:
        return {
            "kernel": self.kernel,
            "dialect": self.dialect,
            "source": self.source,
            "args": [list(a) for a in self.args],
            "constants": [list(c) for c in self.constants],
            "options": [list(o) for o in self.options],
        }

    @classmethod
    def from_json(cls, d: dict) -> Spec:
        return cls(
            d["kernel"],
            d["dialect"],
            d["source"],
            tuple(tuple(a) for a in d["args"]),
            tuple(tuple(c) for c in d["constants"]),
            tuple(tuple(o) for o in d["options"]),
        )

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


def _int_type(v: int) -> str:
    if -_I32 <= v < _I32:
        return "i32"
    if -_I64 <= v < _I64:
        return "i64"
    return "u64"


def _arg_spec(name: str, v: Any, specialize: bool) -> tuple[str, bool, Any]:
    """(type, aligned, constant value) of one runtime argument, by Triton's rules."""
    if v is None:
        return "constexpr", False, None
    if isinstance(v, torch.Tensor):
        dt = DTYPES.get(v.dtype)
        if dt is None:
            raise Unsupported(f"argument {name}: a {v.dtype} tensor")
        return "*" + dt, v.data_ptr() % 16 == 0, None
    if isinstance(v, bool):
        return "u1", False, None
    if isinstance(v, int):
        if specialize and v == 1:
            return "constexpr", False, 1
        return _int_type(v), specialize and v % 16 == 0, None
    if isinstance(v, float):
        return "fp32", False, None
    raise Unsupported(f"argument {name}: a {type(v).__name__}")


def _json_constant(name: str, v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise Unsupported(f"constexpr {name}: a {type(v).__name__}")


@functools.cache
def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def source_digest(fn: Callable) -> str:
    """sha256 over the source files of fn and of the dsc functions it calls (transitively: the
    device functions Triton inlines): any edit there changes the binaries a spec names."""
    seen, todo, files = set(), [fn], set()
    while todo:
        f = todo.pop()
        f = getattr(f, "fn", f)  # a jitted function: its Python function
        if id(f) in seen or not hasattr(f, "__code__"):
            continue
        seen.add(id(f))
        files.add(f.__code__.co_filename)
        for name in f.__code__.co_names:
            callee = f.__globals__.get(name)
            inner = getattr(callee, "fn", callee)
            if callable(inner) and getattr(inner, "__module__", "").startswith("dsc.kernels"):
                todo.append(inner)
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(_file_digest(path).encode())
    return h.hexdigest()


class Kernel:
    """A dsc kernel, launched as Triton's are (`kernel[grid](*args, **kwargs)`): through its
    installed binary when there is one for the launch's spec, else through Triton's JIT."""

    def __init__(self, fn: Callable, dialect: str, make: Callable[[], Any]):
        self.fn, self.dialect, self._make = fn, dialect, make
        self.name = f"{fn.__module__}:{fn.__qualname__}"
        self._jitted = None
        self._params = None
        self._source: str | None = None

    @property
    def jitted(self):
        """Triton's JITFunction (gluon's for a Gluon kernel)."""
        if self._jitted is None:
            self._jitted = self._make()
        return self._jitted

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def params(self) -> list[tuple[str, bool, bool, Any, bool]]:
        """(name, is_constexpr, has_default, default, specialize) per parameter."""
        if self._params is None:
            self._params = [
                (p.name, p.is_constexpr, p.has_default, p.default, not p.do_not_specialize) for p in self.jitted.params
            ]
        return self._params

    def spec(self, args: tuple, kwargs: dict) -> tuple[Spec, list]:
        """The launch's spec and its runtime argument values (constants left out)."""
        params = self.params()
        if len(args) > len(params):
            raise Unsupported(f"{len(args)} arguments for {len(params)} parameters")
        arg_specs, constants, values = [], [], []
        for i, (name, constexpr, has_default, default, specialize) in enumerate(params):
            if i < len(args):
                v = args[i]
            elif name in kwargs:
                v = kwargs[name]
            elif has_default:
                v = default
            else:
                raise Unsupported(f"no value for parameter {name}")
            if constexpr:
                constants.append((name, _json_constant(name, v)))
                arg_specs.append((name, "constexpr", False))
                continue
            ty, aligned, const = _arg_spec(name, v, specialize)
            arg_specs.append((name, ty, aligned))
            if ty == "constexpr":
                constants.append((name, const))
            else:
                values.append(v)
        names = {p[0] for p in params}
        options = tuple(sorted((k, _json_constant(k, v)) for k, v in kwargs.items() if k not in names))
        for k, _ in options:
            if k not in OPTIONS:
                raise Unsupported(f"launch option {k}")
        if self._source is None:
            self._source = source_digest(self.fn)
        spec = Spec(self.name, self.dialect, self._source, tuple(arg_specs), tuple(sorted(constants)), options)
        return spec, values

    def _launch(self, grid, *args, **kwargs):
        if RECORDER.arch is None and not INSTALLED:
            return self.jitted[grid](*args, **kwargs)
        try:
            spec, values = self.spec(args, kwargs)
        except Unsupported as e:
            if RECORDER.arch is not None:
                RECORDER.skipped.setdefault(self.name, str(e))
                return None
            return self._jit(grid, args, kwargs, f"no binary ({e})")
        if RECORDER.arch is not None:
            RECORDER.specs.setdefault(_lookup_key(spec), spec)
            return None
        binary = INSTALLED.get(_lookup_key(spec))
        if binary is None:
            return self._jit(grid, args, kwargs, f"the artifact has no binary for this launch ({_nearest(spec)})")
        binary.launch(grid, values)
        return None

    def _jit(self, grid, args, kwargs, why: str):
        if self.name not in _WARNED:
            _WARNED.add(self.name)
            print(f"dsc: kernel {self.name.split(':')[-1]}: {why}; compiling it with Triton", file=sys.stderr)
        return self.jitted[grid](*args, **kwargs)


_WARNED: set[str] = set()


def _nearest(spec: Spec) -> str:
    """How the launch differs from the closest binary of its kernel: one field, for the line."""
    best = None
    for b in INSTALLED.values():
        if b.spec.kernel != spec.kernel:
            continue
        if b.spec.source != spec.source:
            return "its source differs from the compile's"
        diffs = (
            [f"argument {a[0]} {a[1:]} (binary: {x[1:]})" for a, x in zip(spec.args, b.spec.args) if a != x]
            + [
                f"{k}={v} (binary: {dict(b.spec.constants).get(k)})"
                for k, v in spec.constants
                if dict(b.spec.constants).get(k, object()) != v
            ]
            + [
                f"{k}={v} (binary: {dict(b.spec.options).get(k)})"
                for k, v in spec.options
                if dict(b.spec.options).get(k, object()) != v
            ]
        )
        if best is None or len(diffs) < len(best):
            best = diffs
    if best is None:
        return "none of this kernel"
    return f"{len(best)} differences, first {best[0]}" if best else "same spec"


def _lookup_key(spec: Spec) -> tuple:
    return spec.kernel, spec.source, spec.args, spec.constants, spec.options


# -- recording ---------------------------------------------------------------------------------
@dataclass
class _Recorder:
    arch: str | None = None
    specs: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # kernel -> why its launch has no spec


RECORDER = _Recorder()


@contextlib.contextmanager
def recording(arch: str):
    """Kernel launches inside record their specs (RECORDER.specs) and run nothing; arch_of and
    pdl_enabled answer for `arch` on meta tensors."""
    if RECORDER.arch is not None:
        raise RuntimeError("kernel launches are being recorded already")
    RECORDER.arch, RECORDER.specs, RECORDER.skipped = arch, {}, {}
    try:
        yield RECORDER
    finally:
        RECORDER.arch = None


def recording_arch(device: torch.device) -> str | None:
    """The arch a recording plans for, on the meta device; None otherwise."""
    return RECORDER.arch if device.type == "meta" else None


# -- binaries ----------------------------------------------------------------------------------
_PTX_PARAM = re.compile(r"\.param\s+\.(\w+)")
PTX_TYPES = {
    "u64": ctypes.c_uint64,
    "b64": ctypes.c_uint64,
    "s64": ctypes.c_int64,
    "u32": ctypes.c_uint32,
    "b32": ctypes.c_uint32,
    "s32": ctypes.c_int32,
    "f32": ctypes.c_float,
    "f64": ctypes.c_double,
    "u16": ctypes.c_uint16,
    "b16": ctypes.c_uint16,
    "s16": ctypes.c_int16,
    "u8": ctypes.c_uint8,
    "b8": ctypes.c_uint8,
    "s8": ctypes.c_int8,
}
_MASKS = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF, 8: 0xFFFFFFFFFFFFFFFF}


def ptx_params(ptx: str, entry: str) -> list[str]:
    """The PTX types of an entry's parameters ("u64", "u32", "f32", ...), in order."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.DOTALL)
    if m is None:
        raise ValueError(f"no entry {entry} in the PTX")
    return _PTX_PARAM.findall(m.group(1))


class Binary:
    """One cubin: its entry, launch sizes and parameter layout; loaded per device on first use."""

    def __init__(self, spec: Spec, cubin: bytes, entry: str, num_warps: int, shared: int, params: list[str]):
        self.spec, self.cubin, self.entry = spec, cubin, entry
        self.block, self.shared, self.params = 32 * num_warps, shared, params
        self.pdl = dict(spec.options).get("launch_pdl", False)
        self.launches = 0
        self._functions: dict[int, int] = {}
        fields = [(f"p{i}", PTX_TYPES[t]) for i, t in enumerate(params)]
        self._struct = type("Params", (ctypes.Structure,), {"_fields_": fields})()
        base = ctypes.addressof(self._struct)
        self._ptrs = (ctypes.c_void_p * max(1, len(params)))(
            *[base + getattr(type(self._struct), f"p{i}").offset for i in range(len(params))]
        )
        self._sizes = [ctypes.sizeof(PTX_TYPES[t]) for t in params]
        self._floats = [t.startswith("f") for t in params]

    def function(self, device: int) -> int:
        f = self._functions.get(device)
        if f is None:
            f = self._functions[device] = _driver().load(self.cubin, self.entry, self.shared)
        return f

    def launch(self, grid: tuple, values: list) -> None:
        self.launches += 1
        s = self._struct
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                v = v.data_ptr()
            elif not self._floats[i]:
                v = int(v) & _MASKS[self._sizes[i]]
            setattr(s, f"p{i}", v)
        for i in range(len(values), len(self.params)):  # Triton's trailing scratch pointers: none used
            setattr(s, f"p{i}", 0)
        device = torch.cuda.current_device()
        g = tuple(grid) + (1, 1)
        if g[0] * g[1] * g[2] == 0:
            return
        _driver().launch(
            self.function(device),
            g[:3],
            self.block,
            self.shared,
            torch.cuda.current_stream(device).cuda_stream,
            self._ptrs,
            self.pdl,
        )


INSTALLED: dict[tuple, Binary] = {}


def install(binaries: list[Binary]) -> None:
    """Make these binaries the ones kernel launches use (replacing any installed before), and
    load them on the current device."""
    INSTALLED.clear()
    _WARNED.clear()
    device = torch.cuda.current_device()
    for b in binaries:
        INSTALLED[_lookup_key(b.spec)] = b
        b.function(device)


def uninstall() -> None:
    INSTALLED.clear()


# -- the CUDA driver API through ctypes ---------------------------------------------------------
class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_FUNC_SHARED_SIZE_BYTES = 1  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
_FUNC_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_FUNC_CACHE_PREFER_SHARED = 1
_DEVICE_SHARED_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN


class _Driver:
    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self._modules: list[ctypes.c_void_p] = []  # kept loaded for the process's life
        self._config = _LaunchConfig()
        self._attr = _LaunchAttribute()
        self._attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
        ctypes.memmove(ctypes.addressof(self._attr) + _LaunchAttribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.cuda.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({rc})")

    def load(self, cubin: bytes, entry: str, shared: int) -> int:
        torch.cuda.synchronize()  # the device's primary context exists and is current
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        self._modules.append(module)
        self.check(self.cuda.cuModuleGetFunction(ctypes.byref(fn), module, entry.encode()), "cuModuleGetFunction")
        if shared > 49152:
            dev, optin, static = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            self.check(self.cuda.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
            self.check(
                self.cuda.cuDeviceGetAttribute(ctypes.byref(optin), _DEVICE_SHARED_OPTIN, dev), "cuDeviceGetAttribute"
            )
            if shared > optin.value:
                raise RuntimeError(
                    f"kernel {entry} needs {shared} bytes of shared memory; the device has {optin.value}"
                )
            self.check(self.cuda.cuFuncSetCacheConfig(fn, _FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig")
            self.check(
                self.cuda.cuFuncGetAttribute(ctypes.byref(static), _FUNC_SHARED_SIZE_BYTES, fn), "cuFuncGetAttribute"
            )
            self.check(
                self.cuda.cuFuncSetAttribute(fn, _FUNC_MAX_DYNAMIC_SHARED, optin.value - static.value),
                "cuFuncSetAttribute",
            )
        return fn.value

    def launch(self, fn: int, grid: tuple, block: int, shared: int, stream: int, params, pdl: bool) -> None:
        c = self._config
        c.gridDimX, c.gridDimY, c.gridDimZ = grid
        c.blockDimX, c.blockDimY, c.blockDimZ = block, 1, 1
        c.sharedMemBytes, c.hStream = shared, stream
        if pdl:
            c.attrs, c.numAttrs = ctypes.pointer(self._attr), 1
        else:
            c.attrs, c.numAttrs = None, 0
        self.check(self.cuda.cuLaunchKernelEx(ctypes.byref(c), ctypes.c_void_p(fn), params, None), "cuLaunchKernelEx")


@functools.cache
def _driver() -> _Driver:
    return _Driver()
