"""Attention with a static KV cache: `dsc::attention` and its trace-time twin `dsc::causal_attention`.

Layouts
    q:        [B, H, S, D]     queries of the S new tokens of each sequence
    k, v:     [B, Hkv, S, D]   keys/values of the new tokens (after rotary)
    k_cache:  [Bmax, Hkv, Smax, D]  the layer's cache; rows 0..B-1 belong to this batch
    cache_pos:[B] int64        tokens already in the cache for each sequence
    out:      [B, S, H, D]     (the layout Hugging Face attention functions return)

Token i of sequence b sits at position cache_pos[b] + i; it attends to every cached key at a
position <= its own.  Sequences in one prefill batch are right-padded: padded queries
compute garbage that nothing reads, and their cache slots are overwritten by later decode
steps before any valid query can see them.

`causal_attention` is what tracing records (no cache: the model is traced functionally); the
`bind_kv_cache` pass turns every such node into `attention` with the layer's cache tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention_reference(q, k, v, cache_pos, scale):
    # q: [B, H, S, D]; k, v: [B, Hkv, S, D] -> [B, S, H, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def write_kv_cache_reference(k, v, k_cache, v_cache, cache_pos):
    """Scatter the new keys/values of each sequence to positions cache_pos[b] + i."""
    B, Hkv, S, D = k.shape
    idx = cache_pos[:, None] + torch.arange(S, device=k.device)  # idx: [B, S]
    idx = idx.clamp_(max=k_cache.shape[2] - 1)[:, None, :, None].expand(B, Hkv, S, D)
    k_cache[:B].scatter_(2, idx, k.to(k_cache.dtype))
    v_cache[:B].scatter_(2, idx, v.to(v_cache.dtype))


def attention_reference(q, k, v, k_cache, v_cache, cache_pos, scale):
    B, H, S, D = q.shape
    write_kv_cache_reference(k, v, k_cache, v_cache, cache_pos)
    kc, vc = k_cache[:B], v_cache[:B]  # [B, Hkv, Smax, D]
    q_pos = cache_pos[:, None] + torch.arange(S, device=q.device)  # [B, S]
    k_pos = torch.arange(kc.shape[2], device=q.device)  # [Smax]
    mask = k_pos[None, None, None, :] <= q_pos[:, None, :, None]  # [B, 1, S, Smax]
    out = F.scaled_dot_product_attention(
        q, kc.to(q.dtype), vc.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


@torch.library.custom_op("dsc::causal_attention", mutates_args=())
def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    return causal_attention_reference(q, k, v, cache_pos, scale)


@causal_attention.register_fake
def _(q, k, v, cache_pos, scale):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D)


@torch.library.custom_op("dsc::attention", mutates_args=("k_cache", "v_cache"))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return attention_reference(q, k, v, k_cache, v_cache, cache_pos, scale)


@attention.register_fake
def _(q, k, v, k_cache, v_cache, cache_pos, scale):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D)
