"""The kernel plan's program format: an FX graph written as JSON, and read back into one.

A program is a list of nodes in execution order. Each node is a dict:

    {"name": "model.layers.0.self_attn.q_proj.linear", "kind": "call",
     "op": "aten.linear.default", "args": [{"node": "..."}, {"node": "...weight"}],
     "kwargs": {}, "shape": ["batch", "seq", 64], "dtype": "float32", "kernel": {...}}

kinds: "input" (a program input), "weight" (a tensor from the rank file or the KV cache,
`target` names it), "call" (`op` is a stable schema name: `aten.mm.default`,
`dsc.attention.default`, `operator.getitem`), "output". Argument encoding: a node reference is
{"node": name}; dtypes, devices, layouts and memory formats are tagged dicts; devices are
written as {"device": "target"} and bound to the runtime's device when the graph is rebuilt.

This module is shared by the compiler (writing) and the runtime (reading); it needs torch only.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

_OPERATOR_FUNCS = {getattr(operator, n): n for n in dir(operator) if not n.startswith("_")}
# the ops that attend over a layer's KV cache and write the new tokens into it (the decode
# program's attention has the rotary embedding fused in: passes/fuse_rotary_attention.py)
ATTENTION_OPS = ("dsc.attention.default", "dsc.rotary_attention.default")
# table lookups (the token embedding; a vocab-parallel rank's, kernels/embedding.py, also with
# its all-reduce and layer 0's norm fused in): a step reads the rows of its tokens, at most one
# per token, not the table (the first argument)
GATHER_OPS = ("aten.embedding.default", "dsc.vocab_embedding.default",
              "dsc.vocab_embedding_all_reduce_rmsnorm.default")


def op_name(target: Any) -> str:
    """Stable schema name of an FX call_function target."""
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        packet, overload = target.name().split("::")[1].split(".")[0], target._overloadname
        return f"{ns}.{packet}.{overload}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.replace('::', '.')}.default"
    if target in _OPERATOR_FUNCS:
        return f"operator.{_OPERATOR_FUNCS[target]}"
    if getattr(target, "__module__", None) == "math":
        return f"math.{target.__name__}"
    if target in (torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not):
        return f"torch.{target.__name__}"
    raise ValueError(f"cannot name FX target {target!r} in a plan")


def resolve_op(name: str) -> Callable:
    """Inverse of op_name."""
    head, _, rest = name.partition(".")
    if head == "operator":
        return getattr(operator, rest)
    if head == "math":
        return getattr(math, rest)
    if head == "torch":
        return getattr(torch, rest)
    packet, _, overload = rest.rpartition(".")
    ns = getattr(torch.ops, head)
    return getattr(getattr(ns, packet), overload)


def encode_arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, (list, tuple)):
        return [encode_arg(x) for x in a]
    if isinstance(a, dict):
        return {"dict": {k: encode_arg(v) for k, v in a.items()}}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": "target"}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    if isinstance(a, float) and not math.isfinite(a):
        return {"float": repr(a)}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise ValueError(f"cannot encode argument {a!r} ({type(a).__name__}) in a plan")


def decode_arg(a: Any, env: dict[str, fx.Node], device: torch.device) -> Any:
    if isinstance(a, list):
        return [decode_arg(x, env, device) for x in a]
    if isinstance(a, dict):
        (tag, val), = a.items()
        if tag == "node":
            return env[val]
        if tag == "dict":
            return {k: decode_arg(v, env, device) for k, v in val.items()}
        if tag == "dtype":
            return getattr(torch, val)
        if tag == "device":
            return device
        if tag == "layout":
            return getattr(torch, val)
        if tag == "memory_format":
            return getattr(torch, val)
        if tag == "float":
            return float(val)
        raise ValueError(f"unknown argument tag {tag!r} in plan")
    return a


def build_graph(nodes: list[dict], device: torch.device) -> tuple[fx.Graph, list[str]]:
    """Rebuild an FX graph from a program's node list. Returns the graph and the qualified
    names its weight nodes read (the caller attaches those tensors to the GraphModule)."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    weights: list[str] = []
    for n in nodes:
        kind = n["kind"]
        if kind == "input":
            env[n["name"]] = g.placeholder(n["name"])
        elif kind == "weight":
            env[n["name"]] = g.get_attr(n["target"])
            weights.append(n["target"])
        elif kind == "call":
            args = tuple(decode_arg(n["args"], env, device))
            kwargs = {k: decode_arg(v, env, device) for k, v in n.get("kwargs", {}).items()}
            env[n["name"]] = g.call_function(resolve_op(n["op"]), args, kwargs)
        elif kind == "output":
            g.output(decode_arg(n["args"], env, device))
        else:
            raise ValueError(f"unknown node kind {kind!r} in plan")
    return g, weights
