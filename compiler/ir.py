"""The compiler's in-memory program: FX graphs (one per program) over a table of weight specs.

A weight is never held in memory during compilation. A `WeightSpec` is a recipe that says
how to produce one tensor of one rank file from the source checkpoint: which source tensors,
transposed or not, which slice for tensor parallelism, cast to which dtype, quantized how.
Passes edit recipes and graphs; `emit` streams the recipes into rank files.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


@dataclass(frozen=True)
class Shard:
    """Split `dim` across ranks. `blocks` lists the sizes of the independent blocks along
    `dim` (one block for a plain split; [q, k, v] rows for a fused projection): each block
    is split evenly and rank r keeps the r-th piece of every block, concatenated.
    `groups` (default: world for every block) splits block i into `groups[i]` pieces instead, of
    which rank r takes piece r * groups[i] // world: kv heads when tp > kv heads, each held by
    several ranks."""

    dim: int
    blocks: tuple[int, ...]
    groups: tuple[int, ...] | None = None  # pieces per block; default: world

    def pieces(self, world: int) -> tuple[int, ...]:
        return self.groups or tuple(world for _ in self.blocks)

    def ranges(self, rank: int, world: int) -> list[tuple[int, int]]:
        """[start, stop) ranges along dim that rank keeps, in order."""
        out, base = [], 0
        for size, n in zip(self.blocks, self.pieces(world)):
            piece = size // n
            i = rank * n // world
            out.append((base + i * piece, base + (i + 1) * piece))
            base += size
        return out

    def local_size(self, world: int) -> int:
        return sum(size // n for size, n in zip(self.blocks, self.pieces(world)))


@dataclass(frozen=True)
class Quant:
    """Quantization of a 2-D weight [out, in] after sharding. `part` picks the tensor this
    spec produces: the quantized values, the scales or the zero points."""

    part: str  # "qweight" | "scale" | "zero"
    group_size: int | None = None  # None: one scale per output row
    symmetric: bool = True
    scheme: str = "int8"  # "int8" (kernels/int8.py) | "fp8" (e4m3, kernels/fp8.py) | "int4" (kernels/int4.py)


@dataclass(frozen=True)
class WeightSpec:
    sources: tuple[str, ...]  # checkpoint tensors, concatenated along dim 0 (after transpose)
    shape: tuple[int, ...]  # full (unsharded, unquantized) shape after transpose/concat
    dtype: str  # storage dtype name, e.g. "bfloat16"
    transpose: bool = False
    shard: Shard | None = None
    quant: Quant | None = None
    const: torch.Tensor | None = field(default=None, compare=False, hash=False)  # value not in the checkpoint
    # [in] fp32, multiplies the columns of the full [out, in] weight before sharding and
    # quantization (SmoothQuant's migration of activation outliers into the weight)
    col_scale: torch.Tensor | None = field(default=None, compare=False, hash=False)

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"sources": list(self.sources), "shape": list(self.shape), "dtype": self.dtype}
        if self.transpose:
            d["transpose"] = True
        if self.shard:
            d["shard"] = {"dim": self.shard.dim, "blocks": list(self.shard.blocks)}
            if self.shard.groups:
                d["shard"]["groups"] = list(self.shard.groups)
        if self.quant:
            d["quant"] = {
                "part": self.quant.part,
                "group_size": self.quant.group_size,
                "symmetric": self.quant.symmetric,
            }
            if self.quant.scheme != "int8":
                d["quant"]["scheme"] = self.quant.scheme
        if self.const is not None:
            d["const"] = True
        if self.col_scale is not None:
            d["col_scale"] = True
        return d


@dataclass
class Model:
    """Everything the passes see."""

    programs: dict[str, fx.Graph]  # "prefill", "decode"
    weights: dict[str, WeightSpec]
    config: dict  # the checkpoint's config.json
    arch: Any  # compiler.architectures.Architecture
    options: Any  # CompileOptions
    fake_mode: Any  # the FakeTensorMode the programs were traced under
    sym_names: dict[str, dict[str, str]] = field(default_factory=dict)  # program -> {"s32": "batch"}
    kv_cache: dict[str, Any] | None = None
    kv_pool: dict[str, Any] | None = None  # the ragged program's paged cache (passes/bind_kv_cache.py)
    notes: dict[str, Any] = field(default_factory=dict)  # plan-level facts passes record
    counters: Counter = field(default_factory=Counter)  # "pass.rewrite" -> count
    checkpoint: Any = None  # compiler.source.Checkpoint, for passes that run the model (calibration)

    def graphs(self):
        return self.programs.items()


def weight_nodes(graph: fx.Graph) -> dict[str, fx.Node]:
    return {n.target: n for n in graph.nodes if n.op == "get_attr"}


def meta_val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def copy_meta(new: fx.Node, old: fx.Node, keys: tuple[str, ...] = ("nn_module_stack", "val")) -> fx.Node:
    for k in keys:
        if k in old.meta:
            new.meta[k] = old.meta[k]
    return new


def infer_val(node: fx.Node, model: Model | None = None) -> None:
    """Fill node.meta['val'] by running the node's op on its inputs' fake values."""

    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    args = fx.node.map_aggregate(node.args, val)
    kwargs = fx.node.map_aggregate(node.kwargs, val)
    mode = torch._guards.detect_fake_mode(list(torch.utils._pytree.tree_leaves((args, kwargs)))) or (
        model.fake_mode if model else None
    )
    # the Python dispatcher lets composite ops (linear -> matmul) run on symbolic sizes, as
    # torch.export itself does; without it older torch (2.11) calls numel() on a SymInt shape
    from torch._dispatch.python import enable_python_dispatcher

    with mode, enable_python_dispatcher():
        node.meta["val"] = node.target(*args, **kwargs)
