"""Mixture-of-experts FFN as one op: `dsc::moe`.

    moe(x, topk_ids, topk_weights, gate_up, down, first_expert, gate_up_scale=None, down_scale=None)
        x             [T, H]            the tokens (flat: the programs' batch and sequence dims merged)
        topk_ids      [T, K] int64      each token's routed experts (global ids), from the router
        topk_weights  [T, K]            their weights, as the model's router normalized them
        gate_up       [E * 2I, H]       expert e's gate rows then its up rows at [e*2I, (e+1)*2I)
        down          [E * H, I]        expert e's down matrix at rows [e*H, (e+1)*H)
        first_expert  int               the id of the op's expert 0 among topk_ids. 0 in dsc's
                                        programs: under expert parallelism the graph subtracts the
                                        rank's first expert from the ids (a per-rank constant,
                                        passes/shard_tensor_parallel.py), since one plan serves
                                        every rank; ids outside [0, E) are other ranks' experts
        *_scale       [rows, 1] fp32    int8 weights (W8A16): row r is w[r] * scale[r]
    -> [T, H] in x's dtype:  sum over k of topk_weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t)
       over the k whose expert is on this rank (others contribute nothing: under expert or
       tensor parallelism each rank's output is its part of a sum, all-reduced after).

The router (a linear, softmax, top-k, each model's renormalization) stays in the graph as the
model's own code computes it; only the experts, the part whose work depends on the routing,
are one op. The weights are 2-D so that sharding and int8 rows are those of plain linears:
tensor parallelism splits each expert's gate and up rows and its down columns
(Shard blocks of I), expert parallelism whole experts (rows of E*2I and E*H).

Numerics: the reference computes each expert in the input dtype, as transformers' eager
experts do, and sums the weighted expert outputs in fp32, rounding once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc.kernels.launch import planner
from dsc.kernels.registry import cuda_kernel, declare


def _dequant(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w.to(dtype)
    return (w.float() * scale.float().reshape(-1, 1)).to(dtype)


def moe_reference(x, topk_ids, topk_weights, gate_up, down, first_expert: int = 0, gate_up_scale=None, down_scale=None):
    T, H = x.shape
    inter = down.shape[1]
    experts = gate_up.shape[0] // (2 * inter)
    gu = _dequant(gate_up, gate_up_scale, x.dtype).view(experts, 2 * inter, H)
    dn = _dequant(down, down_scale, x.dtype).view(experts, H, inter)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    local = topk_ids - first_expert
    for e in range(experts):
        hit = local == e  # [T, K]: an expert appears at most once in a token's top k
        tokens = hit.any(dim=1).nonzero().flatten()
        if tokens.numel() == 0:
            continue
        weight = (topk_weights.float() * hit).sum(dim=1)[tokens]
        gate, up = F.linear(x[tokens], gu[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, dn[e])
        out.index_add_(0, tokens, y.float() * weight[:, None])
    return out.to(x.dtype)


def moe_dense(x, topk_ids, topk_weights, gate_up, down, first_expert: int = 0, gate_up_scale=None, down_scale=None):
    """The same sum with every expert run on every token, weighted by zero where it was not
    routed: static shapes (no per-expert token lists), for graphs that cannot hold
    data-dependent sizes (the ONNX export's stand-in for dsc::moe)."""
    T, H = x.shape
    inter = down.shape[1]
    experts = gate_up.shape[0] // (2 * inter)
    gu = _dequant(gate_up, gate_up_scale, x.dtype).view(experts, 2 * inter, H)
    dn = _dequant(down, down_scale, x.dtype).view(experts, H, inter)
    gate, up = torch.einsum("th,eoh->eto", x, gu).chunk(2, dim=-1)  # [E, T, I] each
    y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, dn)  # [E, T, H]
    hit = (topk_ids - first_expert)[None] == torch.arange(experts, device=x.device)[:, None, None]  # [E, T, K]
    weight = (topk_weights.float()[None] * hit).sum(dim=-1)  # [E, T]
    return (y.float() * weight[..., None]).sum(dim=0).to(x.dtype)


@torch.library.custom_op("dsc::moe", mutates_args=())
def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first_expert: int,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return moe_reference(x, topk_ids, topk_weights, gate_up, down, first_expert, gate_up_scale, down_scale)


declare("dsc.moe.default", onnx=moe_dense)


@cuda_kernel(moe)
def _(x, topk_ids, topk_weights, gate_up, down, first_expert, gate_up_scale=None, down_scale=None):
    from dsc.kernels.fused_moe import fused_moe_triton

    flat = lambda s: None if s is None else s.reshape(-1)  # noqa: E731  ([rows, 1] -> [rows])
    return fused_moe_triton(
        x, topk_ids, topk_weights, gate_up, down, first_expert, flat(gate_up_scale), flat(down_scale)
    )


@moe.register_fake
def _(x, topk_ids, topk_weights, gate_up, down, first_expert, gate_up_scale=None, down_scale=None):
    return x.new_empty(x.shape)


@planner("dsc.moe.default")
def _plan_moe(x, topk_ids, topk_weights, gate_up, down, first_expert, gate_up_scale=None, down_scale=None, *, arch):
    from dsc.kernels.fused_moe import plan_moe

    return plan_moe(x, topk_ids, gate_up, down, gate_up_scale is not None, arch=arch)
