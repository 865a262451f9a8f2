"""decode_linears: the decode program's 16-bit linears -> dsc.linear (GEMV at batch 1).

Matches / rewrites (counted under `decode_linears.gemv`):
  aten.linear(x, W[, b]) in the decode program, W a 16-bit weight from the rank file
  -> dsc.linear(x, W, b): F.linear everywhere except on a GPU whose tuning table has a GEMV
  row for W's shape, where a batch-1 step runs the Triton GEMV (kernels/linear.py), bias fused.
  and under tensor parallelism (counted under `decode_linears.all_reduce`):
  s, y = dsc.all_reduce_add_rmsnorm(r, dsc.linear(x, W), w, eps), the linear's only user
  -> s, y = dsc.linear_all_reduce_add_rmsnorm(r, x, W, w, eps): the row-parallel o_proj /
  down_proj and the fused all-reduce + norm after it; on GPUs with the push all-reduce the
  GEMV stores its outputs straight into every rank's push buffer (kernels/collectives.py),
  elsewhere the same two ops.
Prefill keeps aten.linear (cuBLAS at M = batch x seq); int8 linears are already dsc ops.
Requires: every pass that matches aten.linear ran (fusions, sharding, quantize_int8).
Guarantees: same math as F.linear (fp32 accumulation in the GEMV); no other change.
"""
from __future__ import annotations

import torch

from dsc.compiler.ir import Model
from dsc.passes._util import aten, is_call, replace_with

_16BIT = (torch.float16, torch.bfloat16)


def decode_linears(model: Model) -> Model:
    graph = model.programs.get("decode")
    if graph is None:
        return model
    for n in list(graph.nodes):
        if not is_call(n, aten.linear.default) or n.kwargs:
            continue
        w = n.args[1]
        wv = w.meta.get("val") if hasattr(w, "meta") else None
        if getattr(w, "op", None) != "get_attr" or not isinstance(wv, torch.Tensor) or wv.dtype not in _16BIT:
            continue
        replace_with(n, torch.ops.dsc.linear.default, tuple(n.args))
        model.counters["decode_linears.gemv"] += 1
    for n in list(graph.nodes):
        if not is_call(n, torch.ops.dsc.all_reduce_add_rmsnorm.default):
            continue
        r, lin, w, eps = n.args
        if (is_call(lin, torch.ops.dsc.linear.default) and list(lin.users) == [n]
                and (len(lin.args) == 2 or lin.args[2] is None)):
            n.target, n.args = torch.ops.dsc.linear_all_reduce_add_rmsnorm.default, (r, lin.args[0], lin.args[1], w, eps)
            graph.erase_node(lin)
            model.counters["decode_linears.all_reduce"] += 1
    return model
