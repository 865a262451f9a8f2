"""canonicalize: one spelling for things architectures write differently.

Matches / rewrites (each counted under `canonicalize.<rule>`):
  drop_assert   aten._assert_tensor_metadata / _assert_scalar          -> removed
  drop_dropout  aten.dropout(x, p, train=False), aten.alias/detach(x)   -> x
  drop_cast     aten.to / _to_copy to the dtype x already has           -> x; a device move is dropped
  drop_mul_one  aten.mul(x, 1.0)                                        -> x
  out_of_place  aten.add_/mul_/div_(x, y) where nothing reads x after it (Falcon's `mlp_out += attn`,
                a router's `top_k /= top_k.sum()`) -> aten.add/mul/div(x, y)
  addmm_to_linear  aten.addmm(b, x, W) with W a weight [in, out] (GPT-2 Conv1D)
                -> aten.linear(x, W.T, b), the weight transposed at emit
  dedupe_weight two weight names with the same recipe (tied embeddings) -> one
Requires: graphs from `trace`. Guarantees: every matmul against a weight is aten.linear with
the weight [out, in]; no device arguments on casts; dead code removed.
"""

from __future__ import annotations

import dataclasses

from dsc.compiler.ir import Model, weight_nodes
from dsc.passes._util import arg_node, aten, bypass, is_call, replace_with

_ASSERTS = (
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
)
_IDENTITY = (aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default)
_CASTS = (aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default)
_IN_PLACE = {aten.add_.Tensor: aten.add.Tensor, aten.mul_.Tensor: aten.mul.Tensor, aten.div_.Tensor: aten.div.Tensor}


def _cast_target_dtype(node):
    if node.target is aten.to.dtype:
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    if node.target is aten.to.device:
        return node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    return node.kwargs.get("dtype")


def _simplify_nodes(model: Model, graph) -> None:
    c = model.counters
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ASSERTS:
            graph.erase_node(node)
            c["canonicalize.drop_assert"] += 1
        elif is_call(node, aten.dropout.default) or node.target in _IDENTITY:
            bypass(node, node.args[0])
            c["canonicalize.drop_dropout"] += 1
        elif node.target in _CASTS:
            src = node.args[0]
            want = _cast_target_dtype(node)
            have = src.meta["val"].dtype
            if want is None or want == have:
                bypass(node, src)
            else:
                replace_with(node, aten.to.dtype, (src, want))
            c["canonicalize.drop_cast"] += 1
        elif is_call(node, aten.mul.Tensor) and node.args[1] == 1.0 and not isinstance(node.args[1], bool):
            bypass(node, arg_node(node, 0))
            c["canonicalize.drop_mul_one"] += 1
        elif node.target in _IN_PLACE and _last_reader(node):
            replace_with(node, _IN_PLACE[node.target], node.args)
            c["canonicalize.out_of_place"] += 1


def _last_reader(node) -> bool:
    """Nothing reads the in-place op's destination after it (later reads see the op's result)."""
    later, n = set(), node.next
    while n.op != "root":
        later.add(n)
        n = n.next
    return not any(u in later for u in node.args[0].users)


def _addmm_to_linear(model: Model, graph, transposed: set[str]) -> None:
    weights = weight_nodes(graph)
    for name, w in weights.items():
        users = list(w.users)
        if not users or not all(is_call(u, aten.addmm.default) and u.args[2] is w and not u.kwargs for u in users):
            continue
        if name not in transposed:
            spec = model.weights[name]
            model.weights[name] = dataclasses.replace(
                spec, transpose=not spec.transpose, shape=tuple(reversed(spec.shape))
            )
            transposed.add(name)
        w.meta["val"] = w.meta["val"].t().contiguous() if "val" in w.meta else None
        for u in users:
            bias, x, _ = u.args
            replace_with(u, aten.linear.default, (x, w, bias))
            model.counters["canonicalize.addmm_to_linear"] += 1


def _dedupe_weights(model: Model) -> None:
    by_recipe: dict = {}
    # keep the name the checkpoint uses (transformer.wte.weight over a tied lm_head.weight)
    for name in sorted(model.weights, key=lambda n: (n not in model.weights[n].sources, n)):
        spec = model.weights[name]
        if spec.const is not None:
            continue
        by_recipe.setdefault(spec, []).append(name)
    for names in by_recipe.values():
        keep, *drop = names
        for name in drop:
            for _, graph in model.graphs():
                node = weight_nodes(graph).get(name)
                if node is not None:
                    node.target = keep
            del model.weights[name]
            model.counters["canonicalize.dedupe_weight"] += 1


def canonicalize(model: Model) -> Model:
    transposed: set[str] = set()
    for _, graph in model.graphs():
        _simplify_nodes(model, graph)
        _addmm_to_linear(model, graph, transposed)
        graph.eliminate_dead_code()
        # a get_attr that lost its users is dead too
        for n in list(graph.nodes):
            if n.op == "get_attr" and not n.users:
                graph.erase_node(n)
    _dedupe_weights(model)
    used = {n.target for _, g in model.graphs() for n in g.nodes if n.op == "get_attr"}
    for name in list(model.weights):
        if name not in used:
            del model.weights[name]
    return model
