"""Varlen attention over a paged KV cache: the attention of the ragged program.

A ragged step runs T new tokens of N sequences as one flat batch (SplitFuse: some sequences
bring a chunk of their prompt, the others one decode token). Sequence i's new tokens are rows
query_start[i] .. query_start[i] + query_lens[i] - 1 of q, k and v; its first new token sits at
position cache_lens[i] (the tokens already in the cache before this step).

The cache is a pool of fixed-size blocks per layer, shared by every sequence:
    k_pool, v_pool  [num_blocks, kv_heads, block_size, head_dim]
Sequence i's token at position p lives in block block_tables[i, p // block_size], row
p % block_size. The step first writes its new keys and values at slot_mapping[t] (block *
block_size + row; a negative slot, a padding token, is not written), then every new token
attends causally to its sequence's cached and new tokens (positions p - window + 1 .. p with a
sliding window), grouped-query heads reading kv head h // (H / kv_heads). Rows of q beyond
the sequences (padding up to a CUDA-graph bucket) give zeros.

Ops:
  dsc::ragged_attention(q, k, v, slot_mapping, query_start, query_lens, cache_lens, block_tables,
                        scale[, window])  what tracing records (compiler/trace.py); no cache yet
  dsc::paged_attention(q, k, v, k_pool, v_pool, slot_mapping, query_start, query_lens,
                       cache_lens, block_tables, scale[, window])
                                          after passes/bind_kv_cache.py gives it its layer's pool
Shapes: q [1, H, T, D], k/v [1, Hkv, T, D] (the traced batch of one) -> out [1, T, H, D];
slot_mapping [T], query_start/query_lens/cache_lens [N], block_tables [N, max_blocks], int32.
The CPU implementation is the plain-torch reference below, one sequence at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc.kernels.registry import declare


def write_paged_kv_reference(k, v, k_pool, v_pool, slot_mapping):
    """k, v [1, Hkv, T, D] -> the pools' rows slot_mapping[t] (those >= 0)."""
    bs = k_pool.shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0
    s = slots[keep]
    k_pool[s // bs, :, s % bs] = k[0][:, keep].transpose(0, 1).to(k_pool.dtype)  # [n, Hkv, D]
    v_pool[s // bs, :, s % bs] = v[0][:, keep].transpose(0, 1).to(v_pool.dtype)


def _attend_sequence(q, kc, vc, first_pos, scale, window):
    """q [H, L, D] at positions first_pos.., kc/vc [Hkv, n_ctx, D] -> [L, H, D]."""
    L, n_ctx = q.shape[1], kc.shape[1]
    q_pos = first_pos + torch.arange(L, device=q.device)
    k_pos = torch.arange(n_ctx, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(q[None], kc[None].to(q.dtype), vc[None].to(q.dtype), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention_reference(q, k, v, k_pool, v_pool, slot_mapping, query_start, query_lens, cache_lens,
                              block_tables, scale, window=0):
    write_paged_kv_reference(k, v, k_pool, v_pool, slot_mapping)
    _, H, T, D = q.shape
    Hkv, bs = k_pool.shape[1], k_pool.shape[2]
    out = q.new_zeros(1, T, H, D)
    for i, (a, n, c) in enumerate(zip(query_start.tolist(), query_lens.tolist(), cache_lens.tolist())):
        if n <= 0:
            continue
        n_ctx = c + n
        blocks = block_tables[i, : -(-n_ctx // bs)].long()
        kc = k_pool[blocks].transpose(0, 1).reshape(Hkv, -1, D)[:, :n_ctx]
        vc = v_pool[blocks].transpose(0, 1).reshape(Hkv, -1, D)[:, :n_ctx]
        out[0, a: a + n] = _attend_sequence(q[0, :, a: a + n], kc, vc, c, scale, window)
    return out


def ragged_attention_reference(q, k, v, slot_mapping, query_start, query_lens, cache_lens, block_tables,
                               scale, window=0):
    """Without a cache: each sequence's new tokens attend causally among themselves (what a
    step computes when every cache_lens is 0)."""
    _, H, T, D = q.shape
    out = q.new_zeros(1, T, H, D)
    for a, n in zip(query_start.tolist(), query_lens.tolist()):
        if n > 0:
            out[0, a: a + n] = _attend_sequence(q[0, :, a: a + n], k[0, :, a: a + n], v[0, :, a: a + n], 0,
                                                scale, window)
    return out


def _out_like(q):
    _, H, T, D = q.shape
    return q.new_empty(1, T, H, D)


@torch.library.custom_op("dsc::ragged_attention", mutates_args=())
def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     query_start: torch.Tensor, query_lens: torch.Tensor, cache_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    return ragged_attention_reference(q, k, v, slot_mapping, query_start, query_lens, cache_lens, block_tables,
                                      scale, window)


@ragged_attention.register_fake
def _(q, k, v, slot_mapping, query_start, query_lens, cache_lens, block_tables, scale, window=0):
    return _out_like(q)


declare("dsc.ragged_attention.default")


@torch.library.custom_op("dsc::paged_attention", mutates_args=("k_pool", "v_pool"))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    slot_mapping: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                    cache_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    window: int = 0) -> torch.Tensor:
    return paged_attention_reference(q, k, v, k_pool, v_pool, slot_mapping, query_start, query_lens, cache_lens,
                                     block_tables, scale, window)


@paged_attention.register_fake
def _(q, k, v, k_pool, v_pool, slot_mapping, query_start, query_lens, cache_lens, block_tables, scale, window=0):
    return _out_like(q)


declare("dsc.paged_attention.default", attention=True)
