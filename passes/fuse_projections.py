"""fuse_projections: linears that read the same input -> one linear on concatenated weights.

Matches / rewrites (counted under `fuse_projections.<rule>`):
  linear  k >= 2 nodes aten.linear(x, W_i[, b_i]) on one x, every W_i a checkpoint weight
          [out_i, in] (q/k/v; gate/up)
          -> y = aten.linear(x, W, b), W = cat(W_i) along dim 0 (one WeightSpec whose sources
          are the W_i's, concatenated at emit), and each old output = aten.slice(y, -1, ...).
          The fused weight is named for its members: q_proj+k_proj+v_proj -> qkv_proj,
          gate_proj+up_proj -> gate_up_proj. Counted per fused group.
Requires: bind_kv_cache (and shard_tensor_parallel, if it runs) ran. The W_i share dtype,
  transpose and in-features, are not quantized, and are either all unsharded or all
  column-sharded (Shard(dim=0, ...)); biases all present (same rules) or all absent.
Guarantees: under tensor parallelism the fused spec is sharded per member, never as one
  block: Shard(0, blocks=(n_q, n_k, n_v), groups=(g_q, g_k, g_v)), so rank r holds
  [q_r; k_r; v_r] and the slices' local sizes (read from the sharded graph) line up.
  Weights no program reads any more are dropped from model.weights.
"""

from __future__ import annotations

import os

import torch.fx as fx
from torch.fx.node import Argument

from dsc.compiler.ir import Model, Shard, WeightSpec, copy_meta, weight_nodes
from dsc.passes._pattern import insert_call, node_order
from dsc.passes._util import arg_node, aten, attr_name, is_call


def fused_name(names: list[str]) -> str:
    """model.l.0.attn.q_proj.weight, ...k_proj..., ...v_proj... -> model.l.0.attn.qkv_proj.weight."""
    parts = [n.split(".") for n in names]
    leaves = [p[-2] if len(p) >= 2 else p[-1] for p in parts]
    prefix, tail = parts[0][:-2], parts[0][-1:]
    suffix = os.path.commonprefix([leaf[::-1] for leaf in leaves])[::-1]
    stems = [leaf[: len(leaf) - len(suffix)] for leaf in leaves]
    joined = ("" if all(len(s) == 1 for s in stems) else "_").join(stems) + suffix
    return ".".join(prefix + [joined] + tail)


def fused_spec(specs: list[WeightSpec], world: int) -> WeightSpec | None:
    """One spec for cat(specs) along dim 0, or None if they cannot be concatenated."""
    first = specs[0]
    if any(s.quant or s.const is not None for s in specs):
        return None
    if any(s.dtype != first.dtype or s.transpose != first.transpose or s.shape[1:] != first.shape[1:] for s in specs):
        return None
    shape = (sum(s.shape[0] for s in specs),) + tuple(first.shape[1:])
    sources = tuple(src for s in specs for src in s.sources)
    shards = [s.shard for s in specs if s.shard is not None]
    shard: Shard | None
    if not shards:
        shard = None
    elif len(shards) == len(specs) and all(sh.dim == 0 for sh in shards):
        blocks = tuple(b for sh in shards for b in sh.blocks)
        groups = tuple(g for sh in shards for g in sh.pieces(world))
        shard = Shard(0, blocks, groups if any(sh.groups for sh in shards) else None)
    else:
        return None
    if shard is not None and any(sum(sh.blocks) != s.shape[0] for s, sh in zip(specs, shards)):
        return None
    return WeightSpec(sources=sources, shape=shape, dtype=first.dtype, transpose=first.transpose, shard=shard)


def _linear_groups(graph: fx.Graph, weights: dict[str, WeightSpec]) -> list[list[fx.Node]]:
    by_input: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        if is_call(n, aten.linear.default) and not n.kwargs:
            w = n.args[1]
            if isinstance(w, fx.Node) and w.op == "get_attr" and w.target in weights:
                by_input.setdefault(arg_node(n, 0), []).append(n)
    return [g for g in by_input.values() if len(g) > 1]


def _bias_of(n: fx.Node):
    return n.args[2] if len(n.args) > 2 else None


def _get_attr(graph: fx.Graph, name: str, before: fx.Node, val) -> fx.Node:
    node = weight_nodes(graph).get(name)
    if node is None:
        with graph.inserting_before(before):
            node = graph.get_attr(name)
        node.meta["val"] = val
    return node


def _fuse_group(model: Model, graph: fx.Graph, group: list[fx.Node]) -> bool:
    world = model.options.tp
    ws = [arg_node(n, 1) for n in group]
    bs = [_bias_of(n) for n in group]
    spec = fused_spec([model.weights[attr_name(w)] for w in ws], world)
    if spec is None:
        return False
    bias_spec = None
    if any(b is not None for b in bs):
        if not all(isinstance(b, fx.Node) and b.op == "get_attr" and b.target in model.weights for b in bs):
            return False
        bias_spec = fused_spec([model.weights[b.target] for b in bs], world)
        if bias_spec is None:
            return False
    name = fused_name([attr_name(w) for w in ws])
    # one fused spec per name, the same in every program
    if model.weights.setdefault(name, spec) != spec:
        return False
    vw = [w.meta["val"] for w in ws]
    first = min(ws, key=node_order(graph).__getitem__)
    w_node = _get_attr(graph, name, first, vw[0].new_empty((sum(v.shape[0] for v in vw),) + tuple(vw[0].shape[1:])))
    args: tuple[Argument, ...] = (group[0].args[0], w_node)
    if bias_spec is not None:
        bname = fused_name([b.target for b in bs])
        if model.weights.setdefault(bname, bias_spec) != bias_spec:
            return False
        vb = [b.meta["val"] for b in bs]
        args += (_get_attr(graph, bname, first, vb[0].new_empty((sum(v.shape[0] for v in vb),))),)
    fused = insert_call(graph, aten.linear.default, args, group[0])
    fused.meta["nn_module_stack"] = _renamed_stack(group[0], name)
    # each member's output becomes a slice of the fused output, at its local (sharded) size
    start, anchor = 0, fused
    for n in group:
        size = n.meta["val"].shape[-1]
        with graph.inserting_after(anchor):
            sl = graph.call_function(aten.slice.Tensor, (fused, -1, start, start + size))
        copy_meta(sl, n)
        sl.meta["val"] = fused.meta["val"][..., start : start + size]
        n.replace_all_uses_with(sl)
        graph.erase_node(n)
        start, anchor = start + size, sl
    return True


def _renamed_stack(node: fx.Node, weight_name: str) -> dict:
    """The node's module stack with its innermost module renamed to the fused module."""
    stack = dict(node.meta.get("nn_module_stack") or {})
    if not stack:
        return stack
    key = list(stack)[-1]
    path, ty = stack[key]
    leaf = weight_name.split(".")[-2]
    stack[key] = (path.rsplit(".", 1)[0] + "." + leaf if "." in path else leaf, ty)
    return stack


def fuse_projections(model: Model) -> Model:
    for _, graph in model.graphs():
        for group in _linear_groups(graph, model.weights):
            if _fuse_group(model, graph, group):
                model.counters["fuse_projections.linear"] += 1
        graph.eliminate_dead_code()
        for n in list(graph.nodes):
            if n.op == "get_attr" and not n.users:
                graph.erase_node(n)
    used = {n.target for _, g in model.graphs() for n in g.nodes if n.op == "get_attr"}
    for name in [k for k in model.weights if k not in used and not k.startswith("kv_cache.")]:
        del model.weights[name]
    return model
