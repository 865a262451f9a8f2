"""Bidirectional attention over right-padded sequences: the attention of encoder programs.

An encoder program runs a batch of B sequences padded on the right to a common length S;
sequence b's tokens are rows 0 .. lengths[b] - 1. Every query attends to every real key of its
sequence (no causal mask, no cache); padding keys are never visible. Padding queries attend to
the real keys too (their rows are finite and ignored by pooling), so a program needs no branch
on the lengths.

Op:
  dsc::encoder_attention(q, k, v, lengths, scale)   q [B, H, S, D], k/v [B, Hkv, S, D],
                                                    lengths [B] int64 -> out [B, S, H, D]
Query head h reads kv head h // (H / Hkv). The implementation is torch's scaled_dot_product_attention
with a key-padding mask, on every device (on CUDA its fused memory-efficient kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc.kernels.launch import planner
from dsc.kernels.registry import declare


def key_mask(lengths: torch.Tensor, seq: int) -> torch.Tensor:
    """[B, 1, 1, S] bool: key j of sequence b is visible when j < lengths[b]."""
    return (torch.arange(seq, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def encoder_attention_reference(q, k, v, lengths, scale):
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=key_mask(lengths, q.shape[2]), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2).contiguous()


@torch.library.custom_op("dsc::encoder_attention", mutates_args=())
def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    return encoder_attention_reference(q, k, v, lengths, scale)


@encoder_attention.register_fake
def _(q, k, v, lengths, scale):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D)


declare("dsc.encoder_attention.default")


@planner("dsc.encoder_attention.default")
def _plan_encoder_attention(q, k, v, lengths, scale, *, arch):
    return {"name": "torch.sdpa", "config": {"mask": "key padding"}, "launches": 1}
