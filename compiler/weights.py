"""Turn weight recipes (`WeightSpec`) into tensors, one rank at a time, from slices of the
source safetensors: read with plain file reads (no mmap), or cut from whole tensors already in
memory (`SourceReader.hold`, or `keep_bytes`; a GGUF file's tensors are read and dequantized whole); and the
safetensors layout and streaming writer
of rank files, so that no more than a few tensors are in memory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import struct
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from dsc.compiler.ir import WeightSpec
from dsc.compiler.source import Checkpoint
from dsc.errors import UserError

ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}
_ST_TO_TORCH = {v: k for k, v in ST_DTYPES.items()} | {"F64": torch.float64, "I16": torch.int16}


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@contextlib.contextmanager
def torch_threads(n: int):
    """Torch ops on `n` threads in the block. The compiler's stages that stream weights run
    their own threads (reading, hashing, writing; the int8 report's two programs), each
    calling torch ops on one thread: OpenMP workers that wait for a descheduled peer spin
    instead of computing, which on a 2-core machine with other threads busy costs far more
    than they gain."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def local_shape(spec: WeightSpec, world: int) -> tuple[int, ...]:
    """Shape of the tensor a rank stores for this spec."""
    shape = list(spec.shape)
    if spec.shard:
        shape[spec.shard.dim] = spec.shard.local_size(world)
    if spec.quant and spec.quant.part != "qweight":
        out, inp = shape
        groups = inp // spec.quant.group_size if spec.quant.group_size else 1
        shape = [out, groups]
    elif spec.quant and spec.quant.scheme == "int4":  # two 4-bit values per byte
        shape = [shape[0], shape[1] // 2]
    return tuple(shape)


def local_columns(spec: WeightSpec, v: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The entries of a per-input-column vector v [in] that rank's slice of the weight keeps."""
    if spec.shard is None or spec.shard.dim != 1:
        return v
    return torch.cat([v[a:b] for a, b in spec.shard.ranges(rank, world)])


def local_dtype(spec: WeightSpec) -> torch.dtype:
    if spec.quant:
        if spec.quant.part == "qweight" and spec.quant.scheme == "fp8":
            return torch.float8_e4m3fn
        if spec.quant.scheme == "int4":
            return torch.uint8 if spec.quant.part == "qweight" else torch.float16
        return torch.int8 if spec.quant.part in ("qweight", "zero") else torch.float32
    return torch_dtype(spec.dtype)


class FileSlice:
    """One tensor of a safetensors file, read with plain file reads on indexing (the interface
    of safetensors' `get_slice`: `get_shape()`, `[a:b, c:d]`). Not mmap: every page of a
    mapped file that a compile touches counts in its RSS until the file is closed, which made
    peak RSS grow with the checkpoint (an 8B model's 16 GB). Reads only rows [a, b) of dim 0;
    a slice of a later dim reads the rows, then copies the columns out."""

    def __init__(self, file, data_start: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self.file, self.start, self.dtype, self.shape = file, data_start, dtype, tuple(shape)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    def __getitem__(self, idx) -> torch.Tensor:
        idx = (idx if isinstance(idx, tuple) else (idx,)) + (slice(None),) * len(self.shape)
        lo, hi, step = idx[0].indices(self.shape[0]) if self.shape else (0, 1, 1)
        assert step == 1, "FileSlice reads contiguous row ranges only"
        row = self.dtype.itemsize * math.prod(self.shape[1:])
        buf = torch.empty(max(hi - lo, 0) * row, dtype=torch.uint8)  # rows lo..hi: [hi - lo, *shape[1:]]
        self.file.seek(self.start + lo * row)
        if self.file.readinto(buf.numpy()) != buf.numel():
            raise UserError(f"{self.file.name}: truncated safetensors file")
        t = buf.view(self.dtype).reshape((max(hi - lo, 0),) + self.shape[1:] if self.shape else ())
        rest = idx[1 : len(self.shape)]
        if any(s != slice(None) for s in rest):
            t = t[(slice(None),) + rest].contiguous()  # drop the rest of the rows' columns now
        return t


class HeldSlice:
    """A whole tensor already in memory, with FileSlice's interface: indexing gives views."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, idx) -> torch.Tensor:
        return self.t[idx]


class SourceReader:
    """Opens each source file once (header parsed, no mmap); hands out lazy slices.

    Tensors put in with `hold` (or, with `keep_bytes`, every tensor read of at most that size:
    whole, the most recent ones up to that many bytes) are served from memory, so the ranks'
    slices of a tensor come from one read of it."""

    def __init__(self, ckpt: Checkpoint, keep_bytes: int = 0):
        self.ckpt, self.keep_bytes = ckpt, keep_bytes
        self._stack = ExitStack()
        self._files: dict[Path, tuple] = {}  # path -> (file object, data start, header)
        self._held: dict[str, torch.Tensor] = {}  # insertion order: oldest first

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._held.clear()
        self._stack.close()

    def hold(self, key: str, t: torch.Tensor) -> None:
        self._held[key] = t

    def release(self, key: str) -> None:
        self._held.pop(key, None)

    def slice(self, key: str) -> FileSlice | HeldSlice:
        if key in self._held:
            return HeldSlice(self._held[key])
        if self.ckpt.gguf is not None:  # a GGUF tensor dequantizes whole
            return self._keep(key, self.ckpt.gguf.read(key))
        sl = self._file_slice(key)
        if sl.nbytes > self.keep_bytes:  # read slice by slice: holding it whole would cost more
            return sl
        return self._keep(key, sl[:])

    def _keep(self, key: str, t: torch.Tensor) -> HeldSlice:
        """`t`, kept (the oldest dropped first) when it fits in keep_bytes."""
        if t.nbytes <= self.keep_bytes:
            while self._held and sum(h.nbytes for h in self._held.values()) + t.nbytes > self.keep_bytes:
                del self._held[next(iter(self._held))]
            self._held[key] = t
        return HeldSlice(t)

    def _file_slice(self, key: str) -> FileSlice:
        path = self.ckpt.tensors[key].file
        if path not in self._files:
            f = self._stack.enter_context(open(path, "rb"))
            (n,) = struct.unpack("<Q", f.read(8))
            self._files[path] = (f, 8 + n, json.loads(f.read(n)))
        f, start, header = self._files[path]
        info = header[key]
        return FileSlice(f, start + info["data_offsets"][0], _ST_TO_TORCH[info["dtype"]], tuple(info["shape"]))


def _read(reader: SourceReader, key: str, transpose: bool, dim: int | None, lo: int, hi: int) -> torch.Tensor:
    """Rows/cols [lo, hi) along `dim` of source `key` (in post-transpose coordinates)."""
    sl = reader.slice(key)
    if dim is None:
        t = sl[:]
    else:
        stored = (1 - dim) if transpose else dim
        idx = [slice(None)] * len(sl.get_shape())
        idx[stored] = slice(lo, hi)
        t = sl[tuple(idx)]
    return t.t() if transpose else t


def float_tensor(spec: WeightSpec, rank: int, world: int, reader: SourceReader) -> torch.Tensor:
    """The unquantized tensor rank `rank` holds, in the spec's dtype."""
    if spec.col_scale is not None:  # columns scaled in fp32, then cast
        t = float_tensor(dataclasses.replace(spec, col_scale=None, dtype="float32"), rank, world, reader)
        return (t * local_columns(spec, spec.col_scale, rank, world)).to(torch_dtype(spec.dtype)).contiguous()
    if spec.const is not None:
        t = spec.const
        if spec.shard:
            t = torch.cat(
                [t.narrow(spec.shard.dim, a, b - a) for a, b in spec.shard.ranges(rank, world)], spec.shard.dim
            )
        return t.to(torch_dtype(spec.dtype)).contiguous()
    # extents of the concatenated sources along dim 0
    sizes = []
    for key in spec.sources:
        shp = reader.slice(key).get_shape()
        sizes.append(shp[1] if spec.transpose else shp[0])
    pieces: list[torch.Tensor] = []
    if spec.shard is None or spec.shard.dim != 0:
        for key in spec.sources:
            if spec.shard is None:
                t = _read(reader, key, spec.transpose, None, 0, 0)
            else:
                t = torch.cat(
                    [
                        _read(reader, key, spec.transpose, spec.shard.dim, a, b)
                        for a, b in spec.shard.ranges(rank, world)
                    ],
                    spec.shard.dim,
                )
            pieces.append(t.to(torch_dtype(spec.dtype)))
        out = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
        return out.contiguous()
    # sharded along the concatenation dim: map each global range onto the sources
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for a, b in spec.shard.ranges(rank, world):
        for key, s0, n in zip(spec.sources, starts, sizes):
            lo, hi = max(a, s0), min(b, s0 + n)
            if lo < hi:
                pieces.append(_read(reader, key, spec.transpose, 0, lo - s0, hi - s0).to(torch_dtype(spec.dtype)))
    out = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
    return out.contiguous()


def safetensors_layout(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (header length + JSON header, padded to 8) and each tensor's
    offset in the file, for `entries` stored in name order."""
    header: dict = {}
    offset = 0
    for name, shape, dtype in sorted(entries):
        n = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {k: start + v["data_offsets"][0] for k, v in header.items()}


def tensor_bytes(t: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> memoryview:
    """The raw bytes of `t` as a safetensors file stores them, after checking it is what the
    header declares."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise RuntimeError(f"weight {name}: produced {t.dtype}{list(t.shape)}, declared {dtype}{list(shape)}")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(
    path: Path,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    on_tensor: Callable[[int], None] | None = None,
) -> None:
    """Stream tensors into a safetensors file. The header is computed from the declared
    shapes first; `produce(name)` is then called once per tensor, in header order."""
    head, _ = safetensors_layout(entries)
    with open(path, "wb") as f:
        f.write(head)
        for name, shape, dtype in sorted(entries):
            data = tensor_bytes(produce(name), name, shape, dtype)
            f.write(data)
            if on_tensor:
                on_tensor(data.nbytes)
            del data
