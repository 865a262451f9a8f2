"""Write every rank's safetensors file from one read of the checkpoint.

The source files are read once, front to back, by a background thread that hands each tensor
a weight needs, whole, to the writer; a second thread hashes the bytes read (the manifest's
source hashes) while the next are read. As soon as all the sources of a weight are in memory,
every rank's tensors of it (sliced, cast, quantized: `RankTensors`, which quantizes a weight
once for all ranks) are produced and written at their offsets in the rank files (the headers
are computed from the declared shapes first), then the sources are dropped.
Peak memory is a few of the largest tensors, whatever the model size and the tp: a tensor
waits only for the other sources of its weight (a fused q/k/v reads three), and the reader
runs at most `READ_AHEAD` bytes ahead of the writer. Reading, hashing, producing (on one
torch thread) and writing (`_Writer`) each have a thread: torch kernels, file reads, writes
and sha256 release the GIL, so they overlap on the machine's cores.

The bytes written are those of writing each file in header order: only the order of the
writes differs, so artifacts are byte-identical whatever the order of the source files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import queue
import struct
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dsc.compiler.ir import Model
from dsc.compiler.source import Checkpoint
from dsc.compiler.weights import (
    _ST_TO_TORCH,
    SourceReader,
    float_tensor,
    local_columns,
    local_dtype,
    local_shape,
    safetensors_layout,
    tensor_bytes,
    torch_threads,
)
from dsc.errors import UserError
from dsc.runtime.artifact import sha256_file

WRITE_BEHIND = 256 << 20  # bytes of produced tensors not yet written, beyond which the writer waits
READ_AHEAD = 256 << 20  # bytes of read tensors the writer has not finished with, beyond which the reader waits
_CHUNK = 64 << 20  # reads of bytes no weight needs (hashed only); pieces hashed at a time
_HASH_BEHIND = 4  # pieces read and not yet hashed, beyond which the reader waits

Timing = Callable[[str, float], None]


CAP_DB = 999.0  # SQNR of an exact match (infinite) is written as this


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) dB, capped at +-CAP_DB (an exact match is CAP_DB)."""
    return CAP_DB if noise == 0 else min(CAP_DB, 10 * math.log10(signal / noise)) if signal > 0 else -CAP_DB


def weight_sqnr_db(errors: dict[str, tuple[float, float]]) -> dict[str, float]:
    """{layer: SQNR dB} from {weight name: (|W|^2, |W - dequant(Q)|^2)}."""
    return {key.removesuffix(".weight"): round(sqnr_db(*sn), 3) for key, sn in sorted(errors.items())}


class RankTensors:
    """Produces every rank's tensors: `(name, rank) -> tensor`, quantizing each weight once for
    all ranks.

    A quantized weight is quantized whole (its sources as stored, each element cast to fp32 as
    it is quantized), then each rank takes its rows or columns of the int8 values and scales:
    the bytes every rank's own quantization of its shard gives, whenever the rank's scale
    groups are groups of the whole weight. They are: scales are per row, or per group of input
    features that never crosses a shard boundary; a row-parallel shard (its input features
    split across ranks) of a weight that tp=1 quantizes per channel takes its whole rows'
    scales, so every rank's int8 entries and scales are tp=1's and the all-reduced output
    equals tp=1's up to the order of the sum; a shard that is one whole group keeps its own
    scales (a group of the shard's width). A shard whose groups are not groups of the whole
    weight (its columns in pieces) is quantized on its own.
    With `error`, each quantized weight's (signal, noise) over the whole weight, in the original
    weight space (int8_report's weight SQNR), accumulates there as it is quantized."""

    def __init__(self, model: Model, reader: SourceReader, error: dict[str, tuple[float, float]] | None = None):
        self.model, self.reader, self.world, self.error = model, reader, model.options.tp, error
        self._key: str | None = None
        self._whole: dict[str, torch.Tensor] = {}
        self._group: int | None = None
        self._own: dict[int, dict[str, torch.Tensor]] = {}  # rank -> parts, for shards quantized alone
        self._own_error: dict[int, tuple] = {}
        self.quantize_s = self.error_s = 0.0  # seconds quantizing, and measuring the error

    def __call__(self, name: str, rank: int) -> torch.Tensor:
        spec = self.model.weights[name]
        if spec.quant is None:
            return float_tensor(spec, rank, self.world, self.reader)
        key, _, part = name.rpartition(".")  # the weight's name, shared by its parts
        if self._key != key:
            self.drop()
            self._quantize(key, spec)
            self._key = key
        if not self._whole:
            if rank not in self._own:
                self._quantize_shard(key, spec, rank)
            return self._own[rank][part]
        t = self._whole[part]
        if spec.shard is None:
            return t
        ranges = spec.shard.ranges(rank, self.world)
        if spec.shard.dim == 0:  # rows: parts' rows alike
            return torch.cat([t[a:b] for a, b in ranges]) if len(ranges) > 1 else t[ranges[0][0] : ranges[0][1]]
        if part != "qweight":  # columns: the scale groups the rank's columns span
            if self._group is None:
                return t
            ranges = [(a // self._group, b // self._group) for a, b in ranges]
        elif spec.quant.scheme == "int4":  # two columns per byte (group sizes are even)
            ranges = [(a // 2, b // 2) for a, b in ranges]
        return torch.cat([t[:, a:b] for a, b in ranges], 1)

    def _quantize(self, key: str, spec) -> None:
        """The whole weight's parts, when the ranks' shards are slices of them."""
        whole, self._group = _whole_groups(self.model, key, spec, self.world)
        if not whole:
            return
        n, k = spec.shape
        g = k // self._group if self._group else 1
        qdtype = local_dtype(dataclasses.replace(spec, quant=dataclasses.replace(spec.quant, part="qweight")))
        if spec.quant.scheme == "int4":
            self._whole = {
                "qweight": torch.empty(n, k // 2, dtype=qdtype),
                "scale": torch.empty(n, g, dtype=torch.float16),
                "min": torch.empty(n, g, dtype=torch.float16),
            }
        else:
            self._whole = {
                "qweight": torch.empty(n, k, dtype=qdtype),
                "scale": torch.empty(n, g),
                "zero": torch.empty(n, g, dtype=torch.int8),
            }
        errors = []
        for r0, w in _row_pieces(spec, self.reader):  # each source's rows into its rows of the parts
            rows = {p: t[r0 : r0 + w.shape[0]] for p, t in self._whole.items()}
            errors.append(self._quantized(w, self._group, spec, spec.col_scale, rows)[1])
        if self.error is not None:
            self.error[key] = tuple(map(sum, zip(*errors)))

    def _quantize_shard(self, key: str, spec, rank: int) -> None:
        """One rank's shard, quantized on its own; the error sums over the ranks' shards."""
        w = float_tensor(
            dataclasses.replace(spec, quant=None, col_scale=None, dtype="float32"), rank, self.world, self.reader
        )
        cols = None if spec.col_scale is None else local_columns(spec, spec.col_scale, rank, self.world)
        self._own[rank], self._own_error[rank] = self._quantized(w, spec.quant.group_size, spec, cols)
        if self.error is not None:
            self.error[key] = tuple(map(sum, zip(*self._own_error.values())))

    def _quantized(self, w: torch.Tensor, group: int | None, spec, col_scale, out=None) -> tuple[dict, tuple | None]:
        from dsc.kernels import fp8, int4
        from dsc.kernels.int8 import quantization_error, quantize_weight

        t0 = time.perf_counter()
        if spec.quant.scheme == "fp8":
            parts = fp8.quantize_weight(w, col_scale=col_scale, out=out)
        elif spec.quant.scheme == "int4":
            parts = int4.quantize_weight(w, group, out=out)
        else:
            parts = quantize_weight(w, group, spec.quant.symmetric, col_scale=col_scale, out=out)
        t1 = time.perf_counter()
        if self.error is None:
            err = None
        elif spec.quant.scheme == "int4":
            err = int4.quantization_error(w, parts)
        else:
            err = quantization_error(w, parts, col_scale, zero=not spec.quant.symmetric)
        self.quantize_s += t1 - t0
        self.error_s += time.perf_counter() - t1
        return parts, err

    def drop(self) -> None:
        """Forget the quantized parts of the last weight (all of them were written)."""
        self._key, self._whole, self._own, self._own_error = None, {}, {}, {}


def _whole_groups(model: Model, key: str, spec, world: int) -> tuple[bool, int | None]:
    """(whether every rank's quantized shard is a slice of the whole weight's quantization, the
    whole weight's scale group size then: None for one scale per row)."""
    q = spec.quant
    if spec.shard is None or spec.shard.dim == 0 or world == 1:
        return True, q.group_size
    from dsc.passes.quantize_int8 import group_size_for

    if q.group_size is None and group_size_for(model, f"{key}.qweight", tp=1) is None:
        return True, None  # whole rows' scales
    group = q.group_size or spec.shard.local_size(world)
    aligned = all(a % group == 0 and b % group == 0 for r in range(world) for a, b in spec.shard.ranges(r, world))
    return aligned, group


def _row_pieces(spec, reader: SourceReader) -> list[tuple[int, torch.Tensor]]:
    """(first row, rows) of a weight's unsharded, unquantized [N, K] value, as its sources store
    them (no copy of a source in memory, no cast): each source's rows, or the whole weight made
    once (transposed sources, a constant)."""
    if spec.const is None and not spec.transpose:
        pieces, r0 = [], 0
        for key in spec.sources:
            t = reader.slice(key)[:]
            pieces.append((r0, t))
            r0 += t.shape[0]
        return pieces
    whole = dataclasses.replace(spec, quant=None, shard=None, col_scale=None, dtype="float32")
    return [(0, float_tensor(whole, 0, 1, reader))]


def rank_entries(model: Model, world: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(n, local_shape(s, world), local_dtype(s)) for n, s in model.weights.items()]


class SourceStream:
    """A background thread that reads the checkpoint's files once, in order, hashing each whole
    file, and queues the tensors in `wanted` (whole, as torch tensors over their own buffers).
    It waits while more than READ_AHEAD bytes it handed over are not yet `done`, unless the
    writer has nothing left to do (`next` is waiting), so it cannot stall the writer."""

    def __init__(self, ckpt: Checkpoint, wanted: set[str]):
        self.ckpt, self.wanted = ckpt, wanted
        self.hashes: dict[str, str] = {}
        self.read_s = self.hash_s = 0.0
        self._q: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._alive = 0  # bytes handed over and not yet done
        self._starving = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dsc-source-reader", daemon=True)

    def __enter__(self) -> SourceStream:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def next(self) -> tuple[str, torch.Tensor] | None:
        """The next wanted tensor in file order; None after the last file."""
        with self._cond:
            self._starving = True
            self._cond.notify_all()
        item = self._q.get()
        with self._cond:
            self._starving = False
        if isinstance(item, BaseException):
            raise item
        return item

    def done(self, t: torch.Tensor) -> None:
        with self._cond:
            self._alive -= t.nbytes
            self._cond.notify_all()

    def _reserve(self, n: int) -> bool:
        with self._cond:
            while not self._stop and self._alive > 0 and self._alive + n > READ_AHEAD and not self._starving:
                self._cond.wait()
            self._alive += n
            return not self._stop

    def _run(self) -> None:
        try:
            for path in self.ckpt.files:
                if not self._read_file(path):
                    return
            self._q.put(None)
        except BaseException as e:  # handed to the writer's thread, which raises it
            self._q.put(e)

    def _read(self, f, buf: memoryview, h: _Hasher) -> None:
        t0 = time.perf_counter()
        if f.readinto(buf) != len(buf):
            raise UserError(f"{f.name}: truncated {'GGUF' if self.ckpt.gguf is not None else 'safetensors'} file")
        self.read_s += time.perf_counter() - t0
        h.update(buf)

    def _read_file(self, path: Path) -> bool:
        h = _Hasher(path.name, self.hashes)
        with open(path, "rb", buffering=0) as f, h:
            pos, spans, decode, held_bytes = self._layout(f, h)
            for lo, hi, name in spans + [(None, None, None)]:
                end = lo if lo is not None else os.fstat(f.fileno()).st_size
                while pos < end:  # bytes between tensors or after the last: hashed only
                    k = min(_CHUNK, end - pos)
                    self._read(f, memoryview(bytearray(k)), h)
                    pos += k
                if name is None:
                    break
                if name not in self.wanted:
                    continue  # read and hashed as a gap by the next span
                size = held_bytes(name, hi - lo)
                if not self._reserve(size):
                    return False
                if size > READ_AHEAD:
                    h.drain()  # a large tensor: the last one's bytes are hashed (and freed) first
                buf = torch.empty(hi - lo, dtype=torch.uint8)
                self._read(f, memoryview(buf.numpy()), h)
                pos += hi - lo
                self._q.put((name, decode(name, buf)))
                del buf  # the writer's, until it is done
        self.hash_s += h.seconds
        return True

    def _layout(self, f, h: _Hasher):
        """(bytes already read, [(first byte, end byte, name)] of the file's tensors in file
        order, decode(name, raw bytes) -> tensor, bytes a tensor holds once decoded)."""
        if self.ckpt.gguf is not None:  # the header is hashed with the gap before the first tensor
            g = self.ckpt.gguf
            return 0, g.spans(), g.decode, lambda name, n: g.decoded_bytes(name)
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
        h.update(memoryview(head + raw))
        header = json.loads(raw)
        start = 8 + n
        spans = sorted(
            (start + info["data_offsets"][0], start + info["data_offsets"][1], name)
            for name, info in header.items()
            if name != "__metadata__"
        )

        def decode(name: str, buf: torch.Tensor) -> torch.Tensor:
            info = header[name]
            return buf.view(_ST_TO_TORCH[info["dtype"]]).reshape(info["shape"])

        return start, spans, decode, lambda name, n: n


class _Hasher:
    """sha256 of one file's bytes, computed by a thread of its own while the next bytes are
    read (sha256 releases the GIL): at most _HASH_BEHIND pieces of _CHUNK bytes wait for it,
    so a buffer outlives its reading by that much at most. On leaving the block (the file
    read whole), waits for the digest and records it in `hashes[name]`."""

    def __init__(self, name: str, hashes: dict[str, str]):
        self.name, self.hashes, self.seconds = name, hashes, 0.0
        self._q: queue.Queue = queue.Queue(maxsize=_HASH_BEHIND)
        self._thread = threading.Thread(target=self._run, name="dsc-source-hash", daemon=True)

    def __enter__(self) -> _Hasher:
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._q.put(None)
        self._thread.join()

    def update(self, data: memoryview) -> None:
        for i in range(0, len(data), _CHUNK):
            self._q.put(data[i : i + _CHUNK])

    def drain(self) -> None:
        """Wait until every piece given so far is hashed (and no longer referenced here)."""
        self._q.join()

    def _run(self) -> None:
        h = hashlib.sha256()
        while (piece := self._q.get()) is not None:
            t0 = time.perf_counter()
            h.update(piece)
            self.seconds += time.perf_counter() - t0
            del piece
            self._q.task_done()
        self._q.task_done()
        self.hashes[self.name] = h.hexdigest()


@dataclasses.dataclass
class Written:
    source_hashes: dict[str, str]  # the checkpoint's files (config.json too) -> sha256
    weight_sqnr: dict[str, float] | None  # int8_report's "layers", measured on the written weights


def write_rank_files(
    model: Model,
    ckpt: Checkpoint,
    folder: Path,
    *,
    on_bytes: Callable[[int], None] | None = None,
    on_timing: Timing | None = None,
    weight_sqnr: bool = False,
) -> Written:
    """Write folder/rank{i}.safetensors for every rank (module docstring)."""
    world = model.options.tp
    entries = rank_entries(model, world)
    layouts = [safetensors_layout(entries) for _ in range(world)]
    groups: dict[tuple[str, ...], list[str]] = defaultdict(list)  # sources -> the weights made of them
    for name in sorted(model.weights):
        groups[model.weights[name].sources].append(name)
    users: dict[str, list[tuple[str, ...]]] = defaultdict(list)  # source -> groups that read it
    for srcs in groups:
        for key in srcs:
            users[key].append(srcs)
    shapes = {n: (s, d) for n, s, d in entries}
    produce_s, write_s = [0.0] * world, [0.0] * world  # per rank: slicing/quantizing, writing
    fds = []
    try:
        for r, (head, _) in enumerate(layouts):
            fds.append(os.open(folder / f"rank{r}.safetensors", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            _pwrite(fds[r], memoryview(head), 0)
        with (
            SourceReader(ckpt) as reader,
            SourceStream(ckpt, set(users)) as stream,
            torch_threads(1),
            _Writer(fds, write_s) as writer,
        ):
            errors: dict[str, tuple[float, float]] | None = {} if weight_sqnr else None
            make = RankTensors(model, reader, errors)

            def write_group(srcs: tuple[str, ...]) -> None:
                for name in groups[srcs]:
                    for r in range(world):
                        t0, busy = time.perf_counter(), make.quantize_s + make.error_s
                        t = make(name, r)
                        produce_s[r] += time.perf_counter() - t0 - (make.quantize_s + make.error_s - busy)
                        data = tensor_bytes(t, name, *shapes[name])
                        writer.write(r, data, layouts[r][1][name])
                        if on_bytes:
                            on_bytes(data.nbytes)
                        del t, data
                make.drop()

            pending = {srcs for srcs in groups if srcs}
            if () in groups:
                write_group(())  # constants: no source to wait for
            held: dict[str, torch.Tensor] = {}
            waited = 0.0
            while True:
                t0 = time.perf_counter()
                item = stream.next()
                waited += time.perf_counter() - t0
                if item is None:
                    break
                key, held[key] = item
                reader.hold(key, held[key])
                del item  # `held` alone keeps the tensor, until it is done
                for srcs in users[key]:
                    if srcs in pending and all(k in held for k in srcs):
                        write_group(srcs)
                        pending.discard(srcs)
                for k in [k for k in held if not any(s in pending for s in users[k])]:
                    reader.release(k)
                    if held[k].nbytes > WRITE_BEHIND:
                        writer.drain()  # writes of views of a large source done before the reader moves on
                    stream.done(held.pop(k))
            if pending:
                missing = sorted({k for srcs in pending for k in srcs} - set(held))
                raise UserError(f"{ckpt.root}: tensor '{missing[0]}' is not in the checkpoint's files")
    finally:
        for fd in fds:
            os.close(fd)
    if on_timing:
        on_timing("emit.read source", stream.read_s)
        on_timing("emit.hash source", stream.hash_s)
        on_timing("emit.wait for reads", waited)
        if model.options.int8:
            on_timing("emit.quantize", make.quantize_s)
            if weight_sqnr:
                on_timing("emit.quantization error", make.error_s)
        for r in range(world):
            on_timing(f"emit.rank {r}: slice", produce_s[r])
            on_timing(f"emit.rank {r}: write", write_s[r])
    hashes = {"config.json": sha256_file(ckpt.root / "config.json"), **stream.hashes}
    if errors is None:
        return Written(dict(sorted(hashes.items())), None)

    return Written(dict(sorted(hashes.items())), weight_sqnr_db(errors))


class _Writer:
    """pwrite on a thread of its own, so that writing a tensor overlaps producing the next; at
    most WRITE_BEHIND bytes (and the tensors they belong to) wait for it. Leaving the block
    waits for every write and raises the first error."""

    def __init__(self, fds: list[int], seconds: list[float]):
        self.fds, self.seconds = fds, seconds
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsc-rank-writer")
        self._pending: deque = deque()  # (future, bytes)
        self._bytes = 0

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._wait(0)
        finally:
            self._pool.shutdown()

    def drain(self) -> None:
        """Wait for every write given so far (their tensors are then no longer referenced here)."""
        self._wait(0)

    def write(self, rank: int, data: memoryview, offset: int) -> None:
        self._wait(WRITE_BEHIND - data.nbytes)
        self._pending.append((self._pool.submit(self._write, rank, data, offset), data.nbytes))
        self._bytes += data.nbytes

    def _wait(self, limit: int) -> None:
        while self._pending and self._bytes > limit:
            fut, n = self._pending.popleft()
            self._bytes -= n
            fut.result()

    def _write(self, rank: int, data: memoryview, offset: int) -> None:
        t0 = time.perf_counter()
        _pwrite(self.fds[rank], data, offset)
        self.seconds[rank] += time.perf_counter() - t0


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    data = data.cast("B")
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
