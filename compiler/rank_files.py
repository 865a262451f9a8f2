"""Write every rank's safetensors file from one read of the checkpoint.

The source files are read once, front to back, by a background thread that also hashes them
(the manifest's source hashes) and hands each tensor a weight needs, whole, to the writer.
As soon as all the sources of a weight are in memory, every rank's tensors of it (sliced,
cast, quantized: `RankTensors`) are produced and written at their offsets in the rank files
(the headers are computed from the declared shapes first), then the sources are dropped.
Peak memory is a few of the largest tensors, whatever the model size and the tp: a tensor
waits only for the other sources of its weight (a fused q/k/v reads three), and the reader
runs at most `READ_AHEAD` bytes ahead of the writer. Torch kernels, file reads, writes and
sha256 release the GIL, so reading and hashing overlap quantizing and writing.

The bytes written are those of writing each file in header order: only the order of the
writes differs, so artifacts are byte-identical whatever the order of the source files.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import struct
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from dsc.compiler.ir import Model
from dsc.compiler.source import Checkpoint
from dsc.compiler.weights import (_ST_TO_TORCH, SourceReader, float_tensor, local_dtype, local_shape,
                                  safetensors_layout, tensor_bytes)
from dsc.errors import UserError
from dsc.runtime.artifact import sha256_file

READ_AHEAD = 256 << 20  # bytes of read tensors the writer has not finished with, beyond which the reader waits
_CHUNK = 64 << 20  # reads of bytes no weight needs (hashed only)

Timing = Callable[[str, float], None]


class RankTensors:
    """Produces the tensors of one rank, quantizing each weight once for all its parts.

    A row-parallel shard (its input features split across ranks) of a weight that tp=1
    quantizes per channel takes its whole rows' scales, so every rank's int8 entries and scales
    are tp=1's and the all-reduced output equals tp=1's up to the order of the sum (scale groups,
    --int8-group-size, never cross a shard boundary, so grouped shards are tp=1's already; a
    shard that is one whole group is per channel locally and keeps its own scales).
    `row_params` keeps those scales across the ranks of one emit (one read of the whole weight)."""

    def __init__(self, model: Model, reader: SourceReader, rank: int, world: int,
                 row_params: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.model, self.reader, self.rank, self.world = model, reader, rank, world
        self._qkey: Any = None
        self._qparts: dict[str, torch.Tensor] = {}
        self._row_params = {} if row_params is None else row_params

    def __call__(self, name: str) -> torch.Tensor:
        spec = self.model.weights[name]
        if spec.quant is None:
            return float_tensor(spec, self.rank, self.world, self.reader)
        base = dataclasses.replace(spec, quant=dataclasses.replace(spec.quant, part="qweight"))
        if self._qkey != base:
            from dsc.kernels.int8 import quantize_weight, weight_qparams
            from dsc.passes.quantize_int8 import group_size_for

            unquantized = dataclasses.replace(spec, quant=None, dtype="float32")
            params = None
            key = name.rpartition(".")[0]  # the weight's name, shared by its parts
            if spec.shard is not None and spec.shard.dim == 1 and self.world > 1 and spec.quant.group_size is None \
                    and group_size_for(self.model, f"{key}.qweight", tp=1) is None:
                if key not in self._row_params:
                    whole = float_tensor(dataclasses.replace(unquantized, shard=None), 0, 1, self.reader)
                    self._row_params[key] = weight_qparams(whole, None, spec.quant.symmetric)
                params = self._row_params[key]
            w = float_tensor(unquantized, self.rank, self.world, self.reader)
            self._qparts = quantize_weight(w, spec.quant.group_size, spec.quant.symmetric, params)
            self._qkey = base
        return self._qparts[spec.quant.part]

    def drop(self) -> None:
        """Forget the quantized parts of the last weight (all of them were written)."""
        self._qkey, self._qparts = None, {}


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

    def __enter__(self) -> "SourceStream":
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

    def _read(self, f, buf: memoryview, h) -> None:
        t0 = time.perf_counter()
        if f.readinto(buf) != len(buf):
            raise UserError(f"{f.name}: truncated safetensors file")
        t1 = time.perf_counter()
        h.update(buf)
        self.read_s += t1 - t0
        self.hash_s += time.perf_counter() - t1

    def _read_file(self, path: Path) -> bool:
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head)
            raw = f.read(n)
            h.update(head)
            h.update(raw)
            header = json.loads(raw)
            pos, start = 8 + n, 8 + n
            spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name)
                           for name, info in header.items() if name != "__metadata__")
            scratch = torch.empty(_CHUNK, dtype=torch.uint8)
            for lo, hi, name in spans + [(None, None, None)]:
                end = start + lo if lo is not None else os.fstat(f.fileno()).st_size
                while pos < end:  # bytes between tensors or after the last: hashed only
                    k = min(_CHUNK, end - pos)
                    self._read(f, memoryview(scratch.numpy())[:k], h)
                    pos += k
                if name is None:
                    break
                if name not in self.wanted:
                    continue  # read and hashed as a gap by the next span
                if not self._reserve(hi - lo):
                    return False
                buf = torch.empty(hi - lo, dtype=torch.uint8)
                self._read(f, memoryview(buf.numpy()), h)
                pos += hi - lo
                info = header[name]
                self._q.put((name, buf.view(_ST_TO_TORCH[info["dtype"]]).reshape(info["shape"])))
        self.hashes[path.name] = h.hexdigest()
        return True


@dataclasses.dataclass
class Written:
    source_hashes: dict[str, str]  # the checkpoint's files (config.json too) -> sha256
    weight_sqnr: dict[str, float] | None  # int8_report's "layers", measured on the written weights


def write_rank_files(model: Model, ckpt: Checkpoint, folder: Path, *, on_bytes: Callable[[int], None] | None = None,
                     on_timing: Timing | None = None, weight_sqnr: bool = False) -> Written:
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
    sq = None
    try:
        for r, (head, _) in enumerate(layouts):
            fds.append(os.open(folder / f"rank{r}.safetensors", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            _pwrite(fds[r], memoryview(head), 0)
        with SourceReader(ckpt) as reader, SourceStream(ckpt, set(users)) as stream:
            row_params: dict = {}
            makers = [RankTensors(model, reader, r, world, row_params) for r in range(world)]
            if weight_sqnr:
                from dsc.compiler.int8_report import _WeightSQNR

                sq = _WeightSQNR(model, reader)

            def write_group(srcs: tuple[str, ...]) -> None:
                for name in groups[srcs]:
                    for r in range(world):
                        t0 = time.perf_counter()
                        t = makers[r](name)
                        if sq is not None and name.endswith(".qweight") and model.weights[name].quant:
                            base = name.removesuffix("qweight")
                            sq.add(name, r, lambda part: t if part == "qweight" else makers[r](base + part))
                        t1 = time.perf_counter()
                        data = tensor_bytes(t, name, *shapes[name])
                        _pwrite(fds[r], data, layouts[r][1][name])
                        produce_s[r] += t1 - t0
                        write_s[r] += time.perf_counter() - t1
                        if on_bytes:
                            on_bytes(data.nbytes)
                        del t, data
                for m in makers:
                    m.drop()

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
                key, tensor = item
                held[key] = tensor
                reader.hold(key, tensor)
                for srcs in users[key]:
                    if srcs in pending and all(k in held for k in srcs):
                        write_group(srcs)
                        pending.discard(srcs)
                for k in [k for k in held if not any(s in pending for s in users[k])]:
                    reader.release(k)
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
        for r in range(world):
            on_timing(f"emit.rank {r}: slice and quantize" if model.options.int8 else f"emit.rank {r}: slice",
                      produce_s[r])
            on_timing(f"emit.rank {r}: write", write_s[r])
    hashes = {"config.json": sha256_file(ckpt.root / "config.json"), **stream.hashes}
    return Written(dict(sorted(hashes.items())), sq.layers() if sq is not None else None)


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    data = data.cast("B")
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
