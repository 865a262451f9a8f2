"""decode_linears: the decode and ragged programs' 16-bit linears -> dsc.linear (GEMV at one row).

The ragged program's steps of one token (batch-1 decode) then run the same GEMV kernels as the
static decode step; its steps of more tokens reach cuBLAS through the same op (its rewrites are
counted under `decode_linears.ragged_gemv` / `.ragged_swiglu`). The fused all-reduces are the
decode program's only (their buffers are sized for its step).

Matches / rewrites (counted under `decode_linears.gemv`):
  aten.linear(x, W[, b]) in the decode program, W a 16-bit weight from the rank file
  -> dsc.linear(x, W, b): F.linear everywhere except on a GPU whose tuning table has a GEMV
  row for W's shape, where a batch-1 step runs the Triton GEMV (kernels/linear.py), bias fused.
  and under tensor parallelism (counted under `decode_linears.all_reduce`):
  s, y = dsc.all_reduce_add_rmsnorm(r, dsc.linear(x, W), w, eps), the linear's only user
  -> s, y = dsc.linear_all_reduce_add_rmsnorm(r, x, W, w, eps): the row-parallel o_proj /
  down_proj and the fused all-reduce + norm after it; on GPUs with the push all-reduce the
  GEMV stores its outputs straight into every rank's push buffer (kernels/collectives.py),
  elsewhere the same two ops. With --int8 (W8A16), s, y = dsc.all_reduce_add_rmsnorm(r,
  dsc.linear_w8a16(x, qweight, scale, zero, None, group_size), w, eps) likewise
  -> dsc.linear_w8a16_all_reduce_add_rmsnorm(r, x, qweight, scale, zero, group_size, w, eps).
  and after fuse_activation (counted under `decode_linears.swiglu`):
  dsc.swiglu(slice(y, -1, 0, h), slice(y, -1, h, 2h)), y = dsc.linear(x, W) with W [2h, K],
  no bias, y read only by the two slices and each slice only by the swiglu (or the two halves
  as chunk(y, 2, -1)[0] and [1]: Phi-3's checkpoint-fused gate_up_proj)
  -> dsc.linear_swiglu(x, W): the MLP's fused gate_up projection and its activation; on GPUs
  with a tuned GEMV for W's shape one kernel computes both halves' rows and the activation
  (kernels/linear.py), elsewhere the same two ops. Under tensor parallelism W and the slices
  are the rank's local ones: fuse_projections shards gate_up per member, so every rank holds
  [gate_r; up_r] and its slices cut its own halves. With --int8 the same over
  y = dsc.linear_w8a16(x, qweight, scale, zero, None, group_size)
  -> dsc.linear_w8a16_swiglu(x, qweight, scale, zero, group_size) (kernels/int8.py: on GPUs one
  kernel at one row, elsewhere the two ops). W8A8 linears stay as they are.
Prefill keeps aten.linear (cuBLAS at M = batch x seq) and its int8 linears.
Requires: every pass that matches aten.linear ran (fusions, sharding, quantize_int8).
Guarantees: same math as F.linear (fp32 accumulation in the GEMV), and as the linear's output
  rounded to the dtype then swiglu for linear_swiglu (linear_w8a16_swiglu: linear_w8a16's); the
  fused all-reduce ops compute the pair's values; no other change.
"""

from __future__ import annotations

import operator
from typing import TypeGuard

import torch
import torch.fx as fx

from dsc.compiler.ir import Model
from dsc.kernels import registry
from dsc.passes._util import arg_node, aten, is_call, replace_with

_16BIT = (torch.float16, torch.bfloat16)


def decode_linears(model: Model) -> Model:
    for name, prefix in (("decode", "decode_linears."), ("ragged", "decode_linears.ragged_")):
        graph = model.programs.get(name)
        if graph is not None:
            _gemv_linears(model, graph, prefix)
            if name == "decode":  # the fused collectives' buffers are sized for the decode step
                _fuse_all_reduces(model, graph)
            _fuse_gate_up(model, graph, prefix)
    return model


def _gemv_linears(model: Model, graph: fx.Graph, prefix: str) -> None:
    for n in list(graph.nodes):
        if not is_call(n, aten.linear.default) or n.kwargs:
            continue
        w = n.args[1]
        wv = w.meta.get("val") if isinstance(w, fx.Node) else None
        if getattr(w, "op", None) != "get_attr" or not isinstance(wv, torch.Tensor) or wv.dtype not in _16BIT:
            continue
        replace_with(n, torch.ops.dsc.linear.default, tuple(n.args))
        model.counters[prefix + "gemv"] += 1


def _fuse_all_reduces(model: Model, graph: fx.Graph) -> None:
    for n in list(graph.nodes):
        if not is_call(n, torch.ops.dsc.all_reduce_add_rmsnorm.default):
            continue
        r, lin, w, eps = n.args
        if not isinstance(lin, fx.Node):
            continue
        op = _fused_over(lin, n)
        if op is None or list(lin.users) != [n]:
            continue
        n.target, n.args = op, (r, *_bias_free_args(lin), w, eps)
        graph.erase_node(lin)
        model.counters["decode_linears.all_reduce"] += 1


def _fuse_gate_up(model: Model, graph: fx.Graph, prefix: str) -> None:
    for n in list(graph.nodes):
        found = _gate_up_of(n)
        if found is not None:
            lin, dead = found
            replace_with(n, _fused_over(lin, n), _bias_free_args(lin))
            for d in dead:
                graph.erase_node(d)
            model.counters[prefix + "swiglu"] += 1


def _fused_over(lin, n: fx.Node):
    """The dsc op declared to compute n's op over lin's (kernels/registry.py `fuses`), where lin
    is a linear with no bias and no keyword arguments; else None."""
    if getattr(lin, "op", None) != "call_function" or lin.kwargs or not isinstance(lin.target, torch._ops.OpOverload):
        return None
    first = registry.op_name(lin.target)
    bias = registry.traits(first).bias_arg
    if bias is None or (len(lin.args) > bias and lin.args[bias] is not None):
        return None
    name = registry.fused(first, registry.op_name(n.target))
    return None if name is None else registry.resolve_torch_op(name)


def _bias_free_args(lin: fx.Node) -> tuple:
    """lin's arguments without its (absent) bias: dsc.linear(x, W[, None]) -> (x, W),
    dsc.linear_w8a16(x, qweight, scale, zero, None, group_size) -> (x, qweight, scale, zero, group_size)."""
    bias = registry.traits(registry.op_name(lin.target)).bias_arg
    return tuple(a for i, a in enumerate(lin.args) if i != bias)


def _gate_up_of(n: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(lin, the nodes the fusion leaves dead, each before its inputs) where lin is the bias-free
    dsc.linear(x, W) or dsc.linear_w8a16(x, qweight, ...), W [2h, K], whose output
    n = dsc.swiglu(gate, up) reads as exactly its two halves: gate = y[..., :h] and up = y[..., h:]
    as two slices, or as the two pieces of chunk(y, 2, -1); each half read by n alone and y by the
    halves (the chunk) alone; else None."""
    if not is_call(n, torch.ops.dsc.swiglu.default) or len(n.args) != 2 or n.kwargs:
        return None
    gate, up = n.args
    if not isinstance(gate, fx.Node) or not isinstance(up, fx.Node):
        return None
    if list(gate.users) != [n] or list(up.users) != [n]:
        return None
    chunk = None
    if is_call(gate, aten.slice.Tensor) and is_call(up, aten.slice.Tensor) and not gate.kwargs and not up.kwargs:
        lin = gate.args[0]
        if up.args[0] is not lin:
            return None
        readers = {gate, up}
    elif _is_piece(gate, 0) and _is_piece(up, 1) and gate.args[0] is up.args[0]:
        src = gate.args[0]
        if not is_call(src, aten.chunk.default) or src.kwargs or set(src.users) != {gate, up}:
            return None
        chunk = src
        lin, readers = chunk.args[0], {chunk}
    else:
        return None
    if not isinstance(lin, fx.Node) or _fused_over(lin, n) is None or set(lin.users) != readers:
        return None
    rows = arg_node(lin, 1).meta["val"].shape[0]  # the rank's local [gate; up] rows (int8: the qweight's)
    y = lin.meta["val"]
    if rows % 2 or y.shape[-1] != rows:
        return None
    if chunk is None:
        ok = _is_slice(gate, y.dim(), 0, rows // 2) and _is_slice(up, y.dim(), rows // 2, rows)
        dead = [gate, up, lin]
    else:
        parts, *dim = chunk.args[1:]
        ok = (
            type(parts) is int
            and parts == 2
            and all(type(a) is int for a in dim)
            and (dim or [0])[0] in (-1, y.dim() - 1)
        )
        dead = [gate, up, chunk, lin]
    return (lin, dead) if ok else None


def _is_piece(g: object, i: int) -> TypeGuard[fx.Node]:
    """g = operator.getitem(node, i)."""
    return isinstance(g, fx.Node) and g.op == "call_function" and g.target is operator.getitem and g.args[1:] == (i,)


def _is_slice(s: fx.Node, ndim: int, start: int, end: int) -> bool:
    """s = aten.slice(y, last dim, start, end[, step 1]), every bound a plain int."""
    dim, *rest = s.args[1:]
    return (
        all(type(a) is int for a in (dim, *rest))
        and dim in (-1, ndim - 1)
        and tuple(rest) in ((start, end), (start, end, 1))
    )
