"""What a pass requires of the model and guarantees about it, as predicates that can be checked.

Each `Contract` is a name, a one-line statement, and a check over the model that lists what
violates it (empty: it holds). compiler/pipeline.py names, per pass, the contracts it requires
(checked before it runs) and guarantees (checked after); `dsc compile --check-passes` and the
tests run them between passes. A check reads the graphs and never changes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from dsc.compiler.ir import Model, meta_val
from dsc.compiler.weights import local_shape
from dsc.kernels import registry

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default)
_CASTS = (aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout)
_UNBOUND_ATTENTION = ("dsc.causal_attention.default", "dsc.ragged_attention.default")
_MAX_LISTED = 5  # violations named per contract; the rest are counted


@dataclass(frozen=True)
class Contract:
    name: str
    statement: str
    check: Callable[[Model], list[str]]  # the violations, each naming its program and node

    def violations(self, model: Model) -> list[str]:
        found = self.check(model)
        if len(found) > _MAX_LISTED:
            found = found[:_MAX_LISTED] + [f"{len(found) - _MAX_LISTED} more"]
        return found


def _calls(model: Model):
    for program, graph in model.graphs():
        for n in graph.nodes:
            if n.op == "call_function":
                yield program, n


def _op_name(n: fx.Node) -> str:
    return str(n.target) if isinstance(n.target, torch._ops.OpOverload) else ""


def _linear_weights(model: Model) -> list[str]:
    return [
        f"{p}: {n.name} ({n.target}) reads the weight {a.target} directly"
        for p, n in _calls(model)
        if n.target in _MATMULS
        for a in n.args
        if isinstance(a, fx.Node) and a.op == "get_attr"
    ]


def _cast_devices(model: Model) -> list[str]:
    return [
        f"{p}: {n.name} ({n.target}) moves to a device"
        for p, n in _calls(model)
        if n.target in _CASTS and "device" in n.kwargs
    ]


def _attention_bound(model: Model) -> list[str]:
    out = [f"{p}: {n.name} ({_op_name(n)}) has no cache" for p, n in _calls(model) if _op_name(n) in _UNBOUND_ATTENTION]
    attends = any(registry.traits(_op_name(n)).attention for _, n in _calls(model))
    if attends and model.kv_cache is None and model.kv_pool is None:
        out.append("the model attends but describes no KV cache (model.kv_cache, model.kv_pool)")
    return out


def _local_shapes(model: Model) -> list[str]:
    world = model.options.tp
    out = []
    for program, graph in model.graphs():
        for n in graph.nodes:
            spec = model.weights.get(n.target) if n.op == "get_attr" else None
            val = meta_val(n)
            if spec is None or not isinstance(val, torch.Tensor):
                continue
            want = local_shape(spec, world)
            if tuple(val.shape) != want:
                out.append(f"{program}: {n.target} is {tuple(val.shape)} in the graph, {want} on a rank of {world}")
    return out


def _quantized_weights(model: Model) -> list[str]:
    quantized = set(registry.ops_with("quantized"))
    out = []
    for p, n in _calls(model):
        if _op_name(n) in quantized:
            specs = [model.weights.get(a.target) for a in n.args if isinstance(a, fx.Node) and a.op == "get_attr"]
            if not any(spec is not None and spec.quant is not None for spec in specs):
                out.append(f"{p}: {n.name} ({_op_name(n)}) reads no weight whose spec has `quant`")
    return out


def _no_decode_linear(model: Model) -> list[str]:
    return [
        f"{p}: {n.name} is aten.linear over the 16-bit weight {w.target}"
        for p, n in _calls(model)
        if p in ("decode", "ragged") and n.target is aten.linear.default
        for w in n.args[1:2]
        if isinstance(w, fx.Node)
        and w.op == "get_attr"
        and getattr(meta_val(w), "dtype", None) in (torch.float16, torch.bfloat16)
    ]


def _planned(model: Model) -> list[str]:
    return [f"{p}: {n.name} ({n.target}) has no kernel" for p, n in _calls(model) if "kernel" not in n.meta]


LINEAR = Contract("linear", "every matmul against a weight is aten.linear with the weight [out, in]", _linear_weights)
CASTS = Contract("casts", "no cast moves a tensor to a device", _cast_devices)
ATTENTION = Contract(
    "attention_bound", "every attention reads its layer's KV cache, which the model describes", _attention_bound
)
LOCAL_SHAPES = Contract(
    "local_shapes", "every weight node's value has the shape one rank stores for its spec", _local_shapes
)
QUANTIZED = Contract("quantized", "every quantized op reads a weight whose spec has `quant`", _quantized_weights)
DECODE_LINEARS = Contract(
    "decode_linears",
    "no aten.linear of the decode and ragged programs reads a 16-bit weight (dsc's linears do)",
    _no_decode_linear,
)
PLANNED = Contract("planned", 'every call node has its "kernel" plan entry', _planned)
