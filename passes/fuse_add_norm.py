"""fuse_add_norm: the residual add and the normalization after it -> one kernel.

Matches / rewrites (each counted under `fuse_add_norm.<rule>`):
  add_rmsnorm    s = a + b; y = RMSNorm(s)             -> s, y = dsc.add_rmsnorm(a, b, weight, eps)
  rmsnorm        y = RMSNorm(x), x not such an add     -> y = dsc.rmsnorm(x, weight, eps)
  add_layernorm  s = a + b; y = aten.layer_norm(s, [N], weight, bias, eps)
                                                       -> s, y = dsc.add_layernorm(a, b, weight, bias, eps)
                 also through a view of the sum that keeps N last (OPT's [rows, N] flatten):
                 the addends are viewed the same way and the kernel reads the views
  bias           add_layernorm(linear(h, W, b), r, ...) -> add_layernorm(linear(h, W), r, ..., x_bias=b)
                 (GPT-2's attention and MLP output projections; also a bias added after a
                 row-parallel linear's all-reduce): one launch fewer at batch 1, where cuBLAS
                 has no bias epilogue
  all_reduce     s, y = dsc.add_rmsnorm(r, dsc.all_reduce(x), ...)   (tensor parallel: the sum after
                 a row-parallel o_proj / down_proj, when the add_rmsnorm is its only user)
                                                       -> s, y = dsc.all_reduce_add_rmsnorm(r, x, ...):
                 on GPUs with symmetric memory one kernel sums the ranks' rows over NVLink, adds
                 and normalizes (kernels/collectives.py); elsewhere the same two ops as before
  embedding_all_reduce
                 y = dsc.rmsnorm(h, w, eps), h = dsc.all_reduce(dsc.vocab_embedding(W, ids, start))
                 (tensor parallel: the vocab-parallel embedding, its lookup read by the all-reduce
                 alone, and layer 0's input norm; h is also layer 0's post-attention residual)
                 -> h, y = dsc.vocab_embedding_all_reduce_rmsnorm(W, ids, start, w, eps): h's other
                 readers take output 0, the norm's output 1; on GPUs with the push all-reduce one
                 kernel looks the rows up, sums and normalizes (kernels/collectives.py); elsewhere
                 the same three ops. After `all_reduce`, which leaves h (h has two readers)
  RMSNorm is `rmsnorm_pattern` (LlamaRMSNorm; Mistral and Qwen2 write the same), with or without
  its fp32 casts. A LayerNorm without an add before it stays aten.layer_norm (one launch already).
Requires: canonicalize ran (one spelling of casts). a and b have the add's shape and dtype
  (a residual add, not a broadcast); weight/bias are [N] of the same dtype.
Guarantees: the sum takes over every other use of the add (the residual stream), so a
  decoder layer's two adds disappear into its two norms; values equal the unfused ops'
  (kernels/norm.py keeps Hugging Face's rounding points) up to fp32 reduction order.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dsc.compiler.ir import Model, copy_meta
from dsc.passes._pattern import Pattern, insert_call, insert_fused
from dsc.passes._util import arg_float, arg_list, arg_node, aten, call_target, is_call, take_bias

dsc = torch.ops.dsc
_EPS = 1.2345e-7  # stands for any eps in the traced pattern


def rmsnorm_pattern(x, weight):
    # LlamaRMSNorm.forward
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + _EPS)).to(x.dtype)


RMSNORM = Pattern(
    rmsnorm_pattern,
    lambda dt: (torch.randn(2, 3, 8, dtype=dt), torch.ones(8, dtype=dt)),
    wildcards={"eps": _EPS, "dtype": torch.bfloat16},
)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _residual_add(x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) if x = a + b of two tensors with x's shape and dtype."""
    if not is_call(x, aten.add.Tensor) or x.kwargs or len(x.args) != 2:
        return None
    a, b = x.args
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None
    va, vb, vx = _val(a), _val(b), _val(x)
    if not all(isinstance(v, torch.Tensor) for v in (va, vb, vx)):
        return None
    if va.shape != vx.shape or vb.shape != vx.shape or va.dtype != vx.dtype or vb.dtype != vx.dtype:
        return None
    return a, b


def _residual_add_through_view(graph: fx.Graph, x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """x = view(a + b) keeping the last dim (OPT flattens the residual to [rows, N] between its
    add and the LayerNorm): (view(a), view(b)), new views the fused kernel can read."""
    if not is_call(x, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    s = x.args[0]
    add = _residual_add(s) if isinstance(s, fx.Node) and list(s.users) == [x] else None
    if not add or _val(s).shape[-1] != _val(x).shape[-1]:
        return None
    a, b = (insert_call(graph, call_target(x), (t, *x.args[1:]), x) for t in add)
    return a, b


def _is_vector_of(w, x: fx.Node) -> bool:
    vw, vx = _val(w), _val(x)
    return isinstance(vw, torch.Tensor) and tuple(vw.shape) == (vx.shape[-1],) and vw.dtype == vx.dtype


def _fuse_rmsnorms(model: Model, graph: fx.Graph) -> None:
    for m in RMSNORM.matches(graph):
        x, w, eps = m["x"], m["weight"], m["eps"]
        if not _is_vector_of(w, x) or m.get("dtype", _val(x).dtype) != _val(x).dtype:
            continue
        add = _residual_add(x)
        if add:
            insert_fused(graph, dsc.add_rmsnorm.default, (*add, w, eps), [x, m.output])
            model.counters["fuse_add_norm.add_rmsnorm"] += 1
        else:
            insert_fused(graph, dsc.rmsnorm.default, (x, w, eps), [m.output])
            model.counters["fuse_add_norm.rmsnorm"] += 1


def _fuse_layernorms(model: Model, graph: fx.Graph) -> None:
    for ln in [n for n in graph.nodes if is_call(n, aten.layer_norm.default) and not n.kwargs]:
        x, shape = arg_node(ln, 0), arg_list(ln, 1)
        w, b = (list(ln.args[2:4]) + [None, None])[:2]  # layer_norm(x, shape, w=None, b=None, eps=1e-5)
        if shape != [_val(x).shape[-1]] or not _is_vector_of(w, x) or (b is not None and not _is_vector_of(b, x)):
            continue
        add = _residual_add(x) or _residual_add_through_view(graph, x)
        if not add:
            continue
        insert_fused(graph, dsc.add_layernorm.default, (*add, w, b, arg_float(ln, 4, 1e-5)), [x, ln])
        graph.erase_node(ln)
        model.counters["fuse_add_norm.add_layernorm"] += 1


def _fold_biases(model: Model, graph: fx.Graph) -> None:
    for n in [n for n in graph.nodes if is_call(n, dsc.add_layernorm.default) and len(n.args) == 5]:
        a, b, *rest = n.args
        for value, other in ((a, b), (b, a)):  # the sum is symmetric: the biased addend goes first
            taken = take_bias(value, n)
            if taken:
                n.args = (taken[0], other, *rest, taken[1])
                model.counters["fuse_add_norm.bias"] += 1
                break


def _fuse_all_reduces(model: Model, graph: fx.Graph) -> None:
    for n in [n for n in graph.nodes if is_call(n, dsc.add_rmsnorm.default)]:
        a, b, w, eps = n.args
        # layer 0's post-attention norm adds two all-reduces (the embedding's, also read by the
        # input norm, and o_proj's): take the one this node alone reads, the second addend
        # first (Hugging Face writes residual + sublayer output; keeping that order lets
        # `dsc diff --numeric` pair the fused node's arguments with the unfused one's)
        for other, red in ((a, b), (b, a)):
            if is_call(red, dsc.all_reduce.default) and list(red.users) == [n]:
                n.target, n.args = dsc.all_reduce_add_rmsnorm.default, (other, red.args[0], w, eps)
                graph.erase_node(red)
                model.counters["fuse_add_norm.all_reduce"] += 1
                break


def _fuse_embedding_all_reduces(model: Model, graph: fx.Graph) -> None:
    for n in [n for n in graph.nodes if is_call(n, dsc.rmsnorm.default)]:
        red, w, eps = n.args
        if not is_call(red, dsc.all_reduce.default):
            continue
        emb = red.args[0]
        if not is_call(emb, dsc.vocab_embedding.default) or list(emb.users) != [red]:
            continue
        fused = insert_fused(graph, dsc.vocab_embedding_all_reduce_rmsnorm.default, (*emb.args, w, eps), [red, n])
        # the node takes the embedding's module path, not the norm's: its launches (four in a
        # prefill) count outside the layers, where the embedding's did
        copy_meta(fused, red, keys=("nn_module_stack",))
        model.counters["fuse_add_norm.embedding_all_reduce"] += 1


def fuse_add_norm(model: Model) -> Model:
    for _, graph in model.graphs():
        _fuse_rmsnorms(model, graph)
        _fuse_layernorms(model, graph)
        graph.eliminate_dead_code()
        _fold_biases(model, graph)
        _fuse_all_reduces(model, graph)
        # the embedding's all-reduce has two users (layer 0's input norm and its post-attention
        # add): _fuse_all_reduces, which takes an all-reduce only its add reads, leaves it to this
        _fuse_embedding_all_reduces(model, graph)
        graph.eliminate_dead_code()
    return model
