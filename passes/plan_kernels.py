"""plan_kernels: choose the kernel and launch configuration of every call node (the last pass).

Matches every call_function node and rewrites nothing: records node.meta["kernel"] =
{"name", "config", "launches"} on each, which serialize writes into plan.json:
  views        view/unsqueeze/transpose/slice/split/getitem/expand/...    -> "view", 0 launches
  host         sym_size and Python scalar ops on sizes                    -> "host", 0 launches
  maybe-copy   reshape/flatten: 0 launches when the input's strides allow a view, else a
               copy kernel (1); clone/contiguous always copy
  linear       aten.linear -> "cublas.gemm" {N, K, bias}, 1 launch; with a bias 2 in the decode
               program, counted at batch 1 like the rest of it: torch uses cuBLASLt's bias
               epilogue only for M > 1, and at M = 1 copies the bias into the output first
               (fuse_add_norm / fuse_activation move most biases into the next kernel)
  dsc ops      the planner the op's kernel file registers (kernels/launch.py: `planner`),
               config from kernels/tuning.json for the target arch
  other aten   one eager torch kernel: "aten.<op>", 1 launch
Launch counts are what a CUDA-graph replay of the step issues, counted honestly (a copy is a
launch). model.notes["kernels"] records the target arch and the launches per program and per
decoder layer (decode at the smallest batch bucket).
Requires: the passes that rewrite ops ran (it is last). Guarantees: every call node has a
  "kernel" entry; no graph change.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import dsc.kernels  # noqa: F401  (registers every dsc op and its planner)
from dsc.compiler.ir import Model
from dsc.compiler.serialize import program_nodes
from dsc.kernels.embedding import vocab_embedding_config
from dsc.kernels.launch import PLANNERS, TARGET_ARCH
from dsc.kernels.norm import norm_config
from dsc.kernels.registry import op_name
from dsc.launch_counts import launches
from dsc.passes._util import aten

VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.t.default,
    aten.alias.default,
    aten.detach.default,
    aten.as_strided.default,
    aten.unflatten.int,
    aten.narrow.default,
    aten.unbind.int,
    aten.chunk.default,
    aten.view_as.default,
    aten.expand_as.default,
    operator.getitem,
}
MAYBE_COPY = {aten.reshape.default, aten.flatten.using_ints}
# fused all-reduces whose planners give the decode program's kernel (prefill programs take NCCL)
ALL_REDUCE_NORM_OPS = ("dsc.all_reduce_add_rmsnorm.default", "dsc.vocab_embedding_all_reduce_rmsnorm.default")


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _is_host(node: fx.Node) -> bool:
    t = node.target
    if t in (aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int):
        return True
    return getattr(t, "__module__", None) in ("_operator", "operator", "math") or t in (
        torch.sym_float,
        torch.sym_int,
        torch.sym_max,
        torch.sym_min,
        torch.sym_not,
    )


def _reshape_is_view(node: fx.Node) -> bool:
    src, out = _val(node.args[0]), _val(node)
    mode = torch._guards.detect_fake_mode([src])
    if mode is None:
        raise TypeError(f"{node.name}: its input's value {src!r} is not a fake tensor")
    try:
        with mode:
            src.view(out.shape)
        return True
    except (RuntimeError, ValueError):  # eager: RuntimeError; fake tensors: ValueError ("Cannot view ...")
        return False


def _plan_all_reduce(program: str) -> dict:
    """The runtime (kernels/collectives.py) reduces decode-sized tensors with torch's one-shot
    symmetric-memory all-reduce on CUDA: one launch that copies and sums. Larger tensors (a
    prefill), CPU runs (gloo) and GPUs without symmetric memory take the functional all-reduce,
    which clones its input and reduces the clone in place: two launches."""
    if program == "decode":
        return {"name": "symm_mem.one_shot_all_reduce", "config": {"fallback": "nccl.all_reduce"}, "launches": 1}
    return {"name": "nccl.all_reduce", "config": {"one_shot_up_to": "the decode size (max_batch rows)"}, "launches": 2}


def _plan_all_reduce_norm(node: fx.Node, arch: str, program: str) -> dict:
    """dsc.all_reduce_add_rmsnorm, dsc.vocab_embedding_all_reduce_rmsnorm: at decode sizes one
    fused kernel (the op's planner); a prefill takes the functional all-reduce (2 launches)
    between the op's other kernels: the add_rmsnorm kernel after it, or the lookup before it and
    the rmsnorm kernel after."""
    name = op_name(node.target)
    if program == "decode":
        return PLANNERS[name](*[_val(a) if isinstance(a, fx.Node) else a for a in node.args], arch=arch)
    hidden = _val(node.args[0]).shape[-1]
    if name == "dsc.all_reduce_add_rmsnorm.default":
        return {
            "name": "nccl.all_reduce + triton.add_rmsnorm",
            "config": norm_config("add_rmsnorm", hidden, arch),
            "launches": 3,
        }
    return {
        "name": "triton.vocab_embedding + nccl.all_reduce + triton.rmsnorm",
        "config": {"embedding": vocab_embedding_config(hidden), "norm": norm_config("rmsnorm", hidden, arch)},
        "launches": 4,
    }


# planners for ops whose kernel files do not register one (yet); a registered planner wins
# (dsc.all_gather's is kernels/collectives.py's now)
FALLBACK_PLANNERS: dict = {}


def plan_node(node: fx.Node, arch: str, program: str = "prefill") -> dict:
    t = node.target
    name = op_name(t)
    if t in VIEWS:
        return {"name": "view", "config": {}, "launches": 0}
    if _is_host(node):
        return {"name": "host", "config": {}, "launches": 0}
    if t in MAYBE_COPY:
        view = _reshape_is_view(node)
        return {"name": "view" if view else "aten.copy", "config": {}, "launches": 0 if view else 1}
    if t is aten.linear.default:
        w = _val(node.args[1])
        bias = len(node.args) > 2 and node.args[2] is not None
        return {
            "name": "cublas.gemm",
            "config": {"N": w.shape[0], "K": w.shape[1], "bias": bias},
            "launches": 2 if bias and program == "decode" else 1,
        }
    if name == "dsc.all_reduce.default" and name not in PLANNERS:
        return _plan_all_reduce(program)
    if name in ALL_REDUCE_NORM_OPS:
        return _plan_all_reduce_norm(node, arch, program)
    plan = PLANNERS.get(name) or FALLBACK_PLANNERS.get(name)
    if plan is not None:
        args = [_val(a) if isinstance(a, fx.Node) else a for a in node.args]
        return plan(*args, arch=arch)
    return {"name": f"aten.{name.split('.')[1]}", "config": {}, "launches": 1}


def plan_kernels(model: Model) -> Model:
    arch = TARGET_ARCH
    for program, graph in model.graphs():
        for n in graph.nodes:
            if n.op == "call_function":
                n.meta["kernel"] = plan_node(n, arch, program)
    summary = {}
    for p, g in model.graphs():
        counts = launches([n for n in program_nodes(g, model.sym_names.get(p, {})) if n["kind"] == "call"])
        summary[p] = {k: counts[k] for k in ("launches", "launches_per_layer", "layers", "launches_outside_layers")}
    model.notes["kernels"] = {"arch": arch, "launches": summary}
    return model
