"""The ops dsc emits, and what each one is: the one table every layer reads.

A dsc op declares its traits once, beside its `torch.library.custom_op` registration in its
kernel file (`declare("dsc.all_reduce.default", all_reduce=True, ...)`): whether it attends
over a KV cache, reads table rows, sums over the tensor-parallel ranks, takes a collective
buffer slot, how the compiler's simulator combines the ranks, and how it exports to ONNX.
The aten ops the compiler leaves in a program and the few Python functions FX graphs call
on sizes are listed here. A plan names ops by their stable schema names (`op_name`), and
the runtime resolves a name only through this table (`resolve_op`): nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import torch

KEEP = "keep"  # OpTraits.onnx: the op stays a node of the exported graph (see onnx_translation)


@dataclasses.dataclass(frozen=True)
class OpTraits:
    attention: bool = False  # attends over a layer's KV cache and writes the new tokens into it
    gather: bool = False  # a table lookup: a step reads the rows of its tokens of argument 0, not the table
    all_reduce: bool = False  # sums its input over the tensor-parallel ranks (alone or with ops fused in)
    collective_slot: bool = False  # takes one buffer slot per call in kernels/collectives.py `program_scope`
    quantized: bool = False  # an int8 linear (weights in the rank file as qweight/scale/zero)
    bias_arg: int | None = None  # a linear: the index of its optional bias argument
    fuses: tuple[str, ...] = ()  # (a, b): this op computes b(a(...)), a's bias-free args first
    # compiler/simulate.py: every rank's args -> every rank's result (a collective); None: per rank
    simulate: Callable[[list[tuple]], list] | None = None
    # compiler/onnx_export.py: None -> the op's plain-torch `<op>_reference`; a callable -> that
    # stand-in (standard ops and kept dsc ops); KEEP -> a node, written by onnx_translation
    onnx: Callable | str | None = None
    onnx_translation: Callable | None = None  # onnxscript function for a KEEP op


DECLARED_OPS: dict[str, OpTraits] = {}
CUDA_IMPLS: dict[str, Callable] = {}  # "dsc::rmsnorm" -> the op's CUDA implementation


def cuda_kernel(op) -> Callable:
    """`op.register_kernel("cuda")`, the implementation also kept in CUDA_IMPLS: what a
    recording of kernel launches (compiler/kernel_binaries.py) runs on meta tensors."""

    def register(fn: Callable) -> Callable:
        op.register_kernel("cuda")(fn)
        CUDA_IMPLS[op._qualname] = fn
        return fn

    return register


def declare(name: str, **traits: Any) -> OpTraits:
    """Record a dsc op's traits (call it beside the op's registration)."""
    if name in DECLARED_OPS:
        raise ValueError(f"{name} is declared twice")
    resolve_torch_op(name)  # the op must be registered first
    DECLARED_OPS[name] = OpTraits(**traits)
    return DECLARED_OPS[name]


def traits(name: str) -> OpTraits:
    """A dsc op's traits; an aten op's from ATEN_TRAITS; OpTraits() for the rest."""
    return DECLARED_OPS.get(name) or ATEN_TRAITS.get(name) or OpTraits()


def ops_with(trait: str) -> tuple[str, ...]:
    """The names of the ops (dsc and aten) whose `trait` is set, sorted."""
    return tuple(sorted(n for n, t in {**ATEN_TRAITS, **DECLARED_OPS}.items() if getattr(t, trait)))


def fused(first: str, then: str) -> str | None:
    """The dsc op that computes `then` over `first`'s output in one call, if one is declared."""
    return next((n for n, t in DECLARED_OPS.items() if t.fuses == (first, then)), None)


# -- the aten ops dsc emits ------------------------------------------------------------------
# What the compiler leaves in a program after its passes: the ops in the plans of every supported
# architecture (compiler/architectures.py's tiny shapes) at tp 1 and 2, with --int8 (w8a16,
# w8a8, grouped) and with fusion off; then the arithmetic, view and cast ops of the same
# families those models' traces hold under other shapes and dtypes. The loader refuses any other.
ATEN_OPS = (
    # in the plans
    "aten.add.Tensor",
    "aten.arange.default",
    "aten.cat.default",
    "aten.chunk.default",
    "aten.cos.default",
    "aten.embedding.default",
    "aten.flatten.using_ints",
    "aten.index.Tensor",
    "aten.layer_norm.default",
    "aten.linear.default",
    "aten.mean.dim",
    "aten.mul.Tensor",
    "aten.neg.default",
    "aten.pow.Tensor_Scalar",
    "aten.relu.default",
    "aten.reshape.default",
    "aten.rsqrt.default",
    "aten.select.int",
    "aten.silu.default",
    "aten.sin.default",
    "aten.slice.Tensor",
    "aten.split.Tensor",
    "aten.stack.default",
    "aten.sym_size.int",
    "aten.tanh.default",
    "aten.to.dtype",
    "aten.transpose.int",
    "aten.type_as.default",
    "aten.unsqueeze.default",
    "aten.view.default",
    # mixture-of-experts routers (softmax, top-k, renormalization; Qwen2-MoE's shared-expert gate)
    "aten.softmax.int",
    "aten.topk.default",
    "aten.sum.dim_IntList",
    "aten.sigmoid.default",
    # their families
    "aten.sub.Tensor",
    "aten.div.Tensor",
    "aten.gelu.default",
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.expand.default",
    "aten.permute.default",
    "aten.squeeze.dim",
    "aten.unflatten.int",
    "aten.split_with_sizes.default",
    "aten._unsafe_view.default",
    "aten.clone.default",
    "aten._to_copy.default",
    "aten.arange.start",
    "aten.arange.start_step",
    "aten.full.default",
    "aten.where.self",
    "aten.sym_numel.default",
    # encoders: BERT's token-type ids (a gather of its buffer), RoBERTa's positions counted past
    # the padding (ne, cumsum), DistilBERT's
    "aten.gather.default",
    "aten.ne.Scalar",
    "aten.cumsum.default",
)
ATEN_TRAITS: dict[str, OpTraits] = {"aten.embedding.default": OpTraits(gather=True)}

# The Python functions FX graphs call on sizes and tuples, with the kinds of their arguments:
# "value" a node or a number, "index" an int.
PYTHON_OPS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    **{
        f"operator.{f.__name__}": (f, ("value", "value"))
        for f in (
            operator.add,
            operator.sub,
            operator.mul,
            operator.truediv,
            operator.floordiv,
            operator.mod,
            operator.pow,
            operator.eq,
            operator.ne,
            operator.lt,
            operator.le,
            operator.gt,
            operator.ge,
        )
    },
    "operator.neg": (operator.neg, ("value",)),
    "operator.getitem": (operator.getitem, ("value", "index")),
    **{f"math.{f.__name__}": (f, ("value",)) for f in (math.ceil, math.floor, math.trunc, math.sqrt)},
    **{f"torch.{f.__name__}": (f, ("value",)) for f in (torch.sym_float, torch.sym_int, torch.sym_not)},
    **{f"torch.{f.__name__}": (f, ("value", "value")) for f in (torch.sym_max, torch.sym_min)},
}
_PYTHON_NAMES = {f: name for name, (f, _) in PYTHON_OPS.items()}


def op_name(target: Any) -> str:
    """Stable schema name of an FX call_function target."""
    if isinstance(target, torch._ops.OpOverload):
        packet, overload = target.name().split("::")[1].split(".")[0], target._overloadname
        return f"{target.namespace}.{packet}.{overload}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.replace('::', '.')}.default"
    if target in _PYTHON_NAMES:
        return _PYTHON_NAMES[target]
    raise ValueError(f"cannot name FX target {target!r} in a plan")


def resolve_torch_op(name: str) -> torch._ops.OpOverload:
    """`ns.packet.overload` -> torch.ops.ns.packet.overload (a name of this module's tables)."""
    ns, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload)


def is_known(name: Any) -> bool:
    """An op a plan may name: the dsc ops (not the export-only dsc_onnx ones), aten's, Python's."""
    return isinstance(name, str) and (
        name in PYTHON_OPS or name in ATEN_OPS or (name in DECLARED_OPS and name.startswith("dsc."))
    )


def resolve_op(name: str) -> Callable:
    """Inverse of op_name, for the names in the tables only (KeyError otherwise)."""
    if name in PYTHON_OPS:
        return PYTHON_OPS[name][0]
    if is_known(name):
        return resolve_torch_op(name)
    raise KeyError(name)
