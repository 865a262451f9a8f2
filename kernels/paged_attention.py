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
                        scale[, window[, softcap[, alibi_slopes]]])
                                          what tracing records (compiler/trace.py); no cache yet
  dsc::paged_attention(q, k, v, k_pool, v_pool, slot_mapping, query_start, query_lens,
                       cache_lens, block_tables, scale[, window[, softcap[, alibi_slopes]]])
                                          after passes/bind_kv_cache.py gives it its layer's pool
  softcap and alibi_slopes change the scores as in kernels/attention.py (soft-capping, ALiBi).
Shapes: q [1, H, T, D], k/v [1, Hkv, T, D] (the traced batch of one) -> out [1, T, H, D];
slot_mapping [T], query_start/query_lens/cache_lens [N], block_tables [N, max_blocks], int32.
The CPU implementation is the plain-torch reference below, one sequence at a time.

On CUDA, `paged_attention` runs Triton kernels (`paged_attention_triton`) chosen by shapes
alone, so that every (T, N) bucket of a step can be captured in a CUDA graph (no host
synchronisation; grids from T, N and max_blocks):
- T == N, a decode step: `_paged_decode_kernel` alone (one launch). Every sequence brings one
  token, or none (a padding sequence; the R real sequences take rows 0..R-1 in any order, rows
  R.. are padding). kernels/attention.py's flash-decoding adapted to the pool: one program per
  (sequence, kv head, split of the context); the group's G query heads are the rows of one
  tile; keys are read through the block table (a gather of one block id per key row); the
  split that holds the new token writes its k/v to slot_mapping[t] and attends to it from
  registers; splits combine in the last split to finish (a per-(sequence, kv head) counter),
  as the static decode kernel does. The split count comes from N, kv heads and max_blocks *
  block_size (`paged_decode_splits`), never from the lengths. Padding sequences' programs
  write the zeros of the padding rows. A sequence with more than one token breaks the decode
  contract: its first row is NaN, loudly.
- otherwise, a mixed step (three launches): the output is zeroed (a memset: rows outside the
  sequences are zeros), `_paged_prefill_kernel` runs the sequences of 2+ tokens and the decode
  kernel the single-token ones (its programs for the others exit), so that a decode token does
  not take a prefill row tile of its own. The varlen kernel packs a sequence's rows as (token,
  query head) pairs of one kv head's group in tiles of BLOCK_M, as the static prefill kernel
  does; its grid is cdiv(T * G, BLOCK_M) + N tiles (a bound on the sequences' tiles) x kv
  heads, and each program finds its sequence from the running sum of the sequences' tiles
  (tiles past the last exit; a sequence's longest tiles first). Keys come in two phases: the
  cached positions [0, cache_lens[i]) through the block table (visible to every row; with a
  window from the tile's first row's window on), then the new tokens from k and v directly
  (causal), rounded through the pool's dtype as if read back. The program that holds a
  token's first query head writes its k/v to the pool first; no program reads a slot a new
  token is written to (a step's new tokens are read from k and v), so there is no race.
Both kernels assume what the scheduler guarantees: slot_mapping[t] is the slot of token t's
position in its sequence's block table, and a step does not write a slot another sequence
reads as cached.
"""

from __future__ import annotations

import functools

import torch

from dsc.kernels import attention as A
from dsc.kernels.attention import (
    _attend_new,
    _attend_tile,
    _combine_splits,
    _load_rows,
    _new_key_scores,
    _split_len,
    _store_rows,
)
from dsc.kernels.launch import (
    SM_COUNT,
    arch_of,
    cdiv,
    jit,
    next_power_of_2,
    pdl_options,
    planner,
    sm_count,
    split_counters,
    triton_jit,
    tuned,
)
from dsc.kernels.registry import cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch


def write_paged_kv_reference(k, v, k_pool, v_pool, slot_mapping):
    """k, v [1, Hkv, T, D] -> the pools' rows slot_mapping[t] (those >= 0)."""
    bs = k_pool.shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0
    s = slots[keep]
    k_pool[s // bs, :, s % bs] = k[0][:, keep].transpose(0, 1).to(k_pool.dtype)  # [n, Hkv, D]
    v_pool[s // bs, :, s % bs] = v[0][:, keep].transpose(0, 1).to(v_pool.dtype)


def _attend_sequence(q, kc, vc, first_pos, scale, window, softcap=0.0, alibi_slopes=None):
    """q [H, L, D] at positions first_pos.., kc/vc [Hkv, n_ctx, D] -> [L, H, D]."""
    L, n_ctx = q.shape[1], kc.shape[1]
    q_pos = first_pos + torch.arange(L, device=q.device)
    k_pos = torch.arange(n_ctx, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    out = A.attend_reference(
        q[None], kc[None].to(q.dtype), vc[None].to(q.dtype), mask, scale, softcap, alibi_slopes, q_pos[None], k_pos
    )
    return out[0].transpose(0, 1)


def paged_attention_reference(
    q,
    k,
    v,
    k_pool,
    v_pool,
    slot_mapping,
    query_start,
    query_lens,
    cache_lens,
    block_tables,
    scale,
    window=0,
    softcap=0.0,
    alibi_slopes=None,
):
    write_paged_kv_reference(k, v, k_pool, v_pool, slot_mapping)
    _, H, T, D = q.shape
    Hkv, bs = k_pool.shape[1], k_pool.shape[2]
    out = q.new_zeros(1, T, H, D)
    for i, (a, n, c) in enumerate(zip(query_start.tolist(), query_lens.tolist(), cache_lens.tolist())):
        if n <= 0:
            continue
        n_ctx = c + n
        blocks = block_tables[i, : cdiv(n_ctx, bs)].long()
        kc = k_pool[blocks].transpose(0, 1).reshape(Hkv, -1, D)[:, :n_ctx]
        vc = v_pool[blocks].transpose(0, 1).reshape(Hkv, -1, D)[:, :n_ctx]
        out[0, a : a + n] = _attend_sequence(q[0, :, a : a + n], kc, vc, c, scale, window, softcap, alibi_slopes)
    return out


def ragged_attention_reference(
    q,
    k,
    v,
    slot_mapping,
    query_start,
    query_lens,
    cache_lens,
    block_tables,
    scale,
    window=0,
    softcap=0.0,
    alibi_slopes=None,
):
    """Without a cache: each sequence's new tokens attend causally among themselves (what a
    step computes when every cache_lens is 0)."""
    _, H, T, D = q.shape
    out = q.new_zeros(1, T, H, D)
    for a, n in zip(query_start.tolist(), query_lens.tolist()):
        if n > 0:
            out[0, a : a + n] = _attend_sequence(
                q[0, :, a : a + n], k[0, :, a : a + n], v[0, :, a : a + n], 0, scale, window, softcap, alibi_slopes
            )
    return out


# ---------------------------------------------------------------------------------------------
# Launch configurations: the static attention kernels' rows (kernels/attention.py
# `attention_config`: the tiles and split heuristics fit the same shared memory and registers),
# without the keys of what the paged kernels do not have (TMA, warp specialization, the decode
# kernel's preloaded tile); kernels/tuning.json "paged_attention_prefill" / "paged_attention_decode"
# rows (shape class "D<head_dim>") override them. BLOCK_S: sequences per chunk of the scans over
# query_lens (the varlen kernel's tile lookup, the decode kernel's padding rows).
PAGED_KEYS = {
    "prefill": ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
    "decode": ("BLOCK_N", "num_warps", "num_stages", "PROGRAMS_PER_SM", "MIN_SPLIT", "SPLIT_FLOOR"),
}
MAX_BLOCK_S = 128


def paged_attention_config(kind: str, head_dim: int, arch: str, itemsize: int = 2) -> dict:
    """Launch config of the paged `kind` ("prefill": the varlen kernel | "decode") kernel."""
    row = A.attention_config(kind, head_dim, arch, itemsize)
    cfg = {key: value for key, value in row.items() if key in PAGED_KEYS[kind]}
    return tuned(f"paged_attention_{kind}", f"D{next_power_of_2(head_dim)}", arch, cfg)


def paged_decode_splits(num_seqs: int, kv_heads: int, max_context: int, cfg: dict, n_sm: int) -> int:
    """Splits per (sequence, kv head) of a decode step, from shapes only (max_context: the
    block table's max_blocks * block_size)."""
    return A.decode_num_splits(num_seqs, kv_heads, max_context, cfg, n_sm)


def _block_s(num_seqs: int) -> int:
    return min(MAX_BLOCK_S, max(16, next_power_of_2(num_seqs)))


# ---------------------------------------------------------------------------------------------
# Triton kernels (plain functions until `_kernels()`; kernels/launch.py `jit`). They reuse
# kernels/attention.py's device functions (row loads and stores, the online-softmax step, the
# split length), bound here in their jitted form by `_kernels()`.
def _pool_rows(pool, bt_row, offs_j, ok, sp_b, sp_s, BS: tl.constexpr, MASKED: tl.constexpr):
    """Row pointers [N, 1] of positions offs_j of one sequence (block table row bt_row) in one
    kv head's pool (pool: its head's base): block bt_row[j // BS], row j % BS."""
    if MASKED:
        blk = tl.load(bt_row + offs_j // BS, mask=ok, other=0)
    else:
        blk = tl.load(bt_row + offs_j // BS)
    return pool + (blk.to(tl.int64) * sp_b + (offs_j % BS) * sp_s)[:, None]


def _attend_pool(
    acc,
    m_i,
    l_i,
    q,
    kp,
    vp,
    skp_b,
    skp_s,
    svp_b,
    svp_s,
    bt_row,
    offs_j,
    ok,
    offs_d,
    visible,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    MASKED: tl.constexpr,
    cap=None,
    slope=None,
    q_idx=None,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    """Attend to cached positions offs_j read from the pool through the block table (if MASKED,
    rows with ok false read 0 and `visible` [M, N] masks the scores; else all are read and seen).
    The variant (kernels/attention.py `_variant_scores`): q_idx, the rows' positions."""
    k = _load_rows(
        _pool_rows(kp, bt_row, offs_j, ok, skp_b, skp_s, BS, MASKED) + offs_d[None, :],
        ok,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        MASKED,
    )
    v = _load_rows(
        _pool_rows(vp, bt_row, offs_j, ok, svp_b, svp_s, BS, MASKED) + offs_d[None, :],
        ok,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        MASKED,
    )
    return _attend_tile(
        acc,
        m_i,
        l_i,
        q,
        k.to(q.dtype),
        v.to(q.dtype),
        visible,
        qk_scale,
        MASKED,
        cap,
        slope,
        q_idx,
        offs_j,
        SOFTCAP,
        ALIBI,
    )


def _write_pool(
    src,
    s_t,
    pool,
    sp_b,
    sp_s,
    slots,
    ok,
    offs_j,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
):
    """Rows offs_j of one kv head of k (or v) -> that head's pool rows at `slots` (ok rows with
    slots >= 0), in the pool's dtype."""
    w = ok & (slots >= 0)
    x = _load_rows(src + offs_j[:, None] * s_t + offs_d[None, :], w, offs_d, HEAD_DIM, BLOCK_D)
    dst = pool + ((slots // BS).to(tl.int64) * sp_b + (slots % BS) * sp_s)[:, None] + offs_d[None, :]
    _store_rows(dst, x.to(pool.dtype.element_ty), w, offs_d, HEAD_DIM, BLOCK_D)


def _tiles(n, G: tl.constexpr, BLOCK_M: tl.constexpr, SINGLES: tl.constexpr):
    """Row tiles of sequences of n tokens (none for a single token unless SINGLES)."""
    tiles = (tl.maximum(n, 0) * G + BLOCK_M - 1) // BLOCK_M
    if not SINGLES:
        tiles = tl.where(n == 1, 0, tiles)
    return tiles


def _find_tile(QLEN, N, p, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, SINGLES: tl.constexpr):
    """The sequence i whose row tiles hold tile p of the step, and p's tile m within it, from
    the running sum of the sequences' tiles (`_tiles`); i == N past them all.
    A sequence's tiles run last tile first: its longest (causal) ones start before the short
    ones, which fill the schedule's tail (as the static prefill kernel orders them)."""
    i = 0
    start = 0  # the first tile of sequence i
    base = 0  # tiles of the sequences before the chunk
    for s0 in range(0, N, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        n = tl.load(QLEN + offs, mask=offs < N, other=0).to(tl.int32)
        tiles = _tiles(n, G, BLOCK_M, SINGLES)
        ends = base + tl.cumsum(tiles, 0)  # [BLOCK_S]: one past each sequence's last tile
        before = (ends <= p) & (offs < N)  # sequences that end at or before tile p
        i += tl.sum(before.to(tl.int32), 0)
        start = tl.maximum(start, tl.max(tl.where(before, ends, 0), 0))
        base += tl.sum(tiles, 0)
    n_i = tl.load(QLEN + i, mask=i < N, other=0).to(tl.int32)
    return i, _tiles(n_i, G, BLOCK_M, SINGLES) - 1 - (p - start)


def _padding_row(QLEN, N, i, BLOCK_S: tl.constexpr):
    """The row a decode step's padding sequence i zeroes: R + (the padding sequences before i),
    where R real sequences take rows 0..R-1."""
    real = 0
    pad_before = 0
    for s0 in range(0, N, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        n = tl.load(QLEN + offs, mask=offs < N, other=0)
        real += tl.sum((n > 0).to(tl.int32), 0)
        pad_before += tl.sum(((n <= 0) & (offs < i)).to(tl.int32), 0)
    return real + pad_before


def _paged_decode_kernel(
    Q,
    K,
    V,
    KP,
    VP,
    SLOTS,
    QSTART,
    QLEN,
    CLEN,
    BT,
    OUT,
    PART_O,
    PART_LSE,
    LOCK,
    qk_scale,
    sq_h,
    sq_t,  # q [1, H, T, D]; the last stride of every tensor is 1
    sk_h,
    sk_t,  # k [1, Hkv, T, D]
    sv_h,
    sv_t,
    skp_b,
    skp_h,
    skp_s,  # k_pool [num_blocks, Hkv, BS, D]
    svp_b,
    svp_h,
    svp_s,
    sbt,  # block_tables [N, max_blocks]
    so_t,
    so_h,  # out [1, T, H, D]
    sp_b,
    sp_h,
    sp_s,  # part_o [N, H, splits, D] fp32
    sl_b,
    sl_h,  # part_lse [N, H, splits] fp32
    T,
    N,
    Hkv,
    split_floor,
    window,
    SLOPES,
    cap,  # ALIBI: slopes [H] fp32; SOFTCAP: softcap * log2(e) (qk_scale is then scale / softcap)
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BS: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOWED: tl.constexpr,
    MIXED: tl.constexpr = False,
    PDL: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    # MIXED: a mixed step's single-token sequences (the varlen kernel runs the others, and the
    # output was zeroed); else a decode step (every sequence one token or none)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    i = bh // Hkv
    kvh = bh % Hkv
    if PDL:  # kernels/launch.py: everything this kernel reads may be the previous kernel's output
        tl.extra.cuda.gdc_wait()
    heads = kvh * G + tl.arange(0, BLOCK_H)  # the group's query heads, padded to BLOCK_H rows
    head_ok = tl.arange(0, BLOCK_H) < G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    qlen = tl.load(QLEN + i)
    if qlen != 1:
        if not MIXED:
            # a padding sequence (0 tokens): its split 0 zeroes a padding row's group heads; more
            # than one token breaks the decode contract: NaN in its first row
            broken = qlen > 1
            row = tl.where(broken, tl.load(QSTART + i), _padding_row(QLEN, N, i, BLOCK_S)).to(tl.int64)
            val = tl.zeros([BLOCK_H, BLOCK_D], tl.float32) + tl.where(broken, float("nan"), 0.0)
            _store_rows(
                OUT + row * so_t + heads[:, None] * so_h + offs_d[None, :],
                val.to(OUT.dtype.element_ty),
                tl.arange(0, BLOCK_H) < tl.where((row < T) & (split == 0), G, 0),
                offs_d,
                HEAD_DIM,
                BLOCK_D,
            )
        return
    t = tl.load(QSTART + i).to(tl.int64)  # the token's row
    pos = tl.load(CLEN + i).to(tl.int32)  # its position: the keys cached before it
    n_keys = pos + 1
    if WINDOWED:
        first = tl.maximum(pos + 1 - window, 0)
    else:
        first = 0
    split_len = _split_len(n_keys - first, tl.num_programs(1), split_floor, BLOCK_N)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, pos)  # cached keys of this split: [lo, hi)
    if lo >= n_keys:  # this split is past the sequence's end
        return
    n_written = tl.cdiv(n_keys - first, split_len)  # splits that did not return early

    q = _load_rows(Q + heads[:, None] * sq_h + t * sq_t + offs_d[None, :], head_ok, offs_d, HEAD_DIM, BLOCK_D)
    if ALIBI:  # each query head's slope, in base 2
        slope = tl.load(SLOPES + heads, mask=head_ok, other=0.0) * 1.4426950408889634  # [BLOCK_H]
        q_pos = tl.zeros([BLOCK_H], tl.int32) + pos  # every row's position (the variant's query index)
    else:
        slope, q_pos = 0.0, 0
    kp = KP + kvh * skp_h
    vp = VP + kvh * svp_h
    bt_row = BT + i.to(tl.int64) * sbt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        ok = offs_j < hi
        acc, m_i, l_i = _attend_pool(
            acc,
            m_i,
            l_i,
            q,
            kp,
            vp,
            skp_b,
            skp_s,
            svp_b,
            svp_s,
            bt_row,
            offs_j,
            ok,
            offs_d,
            ok[None, :],
            qk_scale,
            HEAD_DIM,
            BLOCK_D,
            BS,
            True,
            cap,
            slope,
            q_pos,
            SOFTCAP,
            ALIBI,
        )
    if PDL:  # the next kernel may start (it waits for this one's end before reading its output)
        tl.extra.cuda.gdc_launch_dependents()

    if pos < lo + split_len:  # the new token is in this split: write it to the pool, attend from registers
        pool_ty = KP.dtype.element_ty
        kn = tl.load(K + kvh * sk_h + t * sk_t + offs_d, mask=d_ok, other=0.0).to(pool_ty)
        vn = tl.load(V + kvh * sv_h + t * sv_t + offs_d, mask=d_ok, other=0.0).to(pool_ty)
        slot = tl.load(SLOTS + t)
        if slot >= 0:
            blk = (slot // BS).to(tl.int64)
            tl.store(kp + blk * skp_b + (slot % BS) * skp_s + offs_d, kn, mask=d_ok)
            tl.store(vp + blk * svp_b + (slot % BS) * svp_s + offs_d, vn, mask=d_ok)
        s = _new_key_scores(
            tl.sum(q.to(tl.float32) * kn.to(q.dtype).to(tl.float32)[None, :], 1), qk_scale, cap, SOFTCAP
        )  # [BLOCK_H]
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vn.to(q.dtype).to(tl.float32)[None, :]
        m_i = m_new

    out = acc / l_i[:, None]
    out_rows = OUT + t * so_t + heads[:, None] * so_h + offs_d[None, :]
    if SPLIT:
        single = n_written == 1  # all its keys in one split: it writes out itself, no counter
    else:
        single = True
    if single:
        _store_rows(out_rows, out.to(OUT.dtype.element_ty), head_ok, offs_d, HEAD_DIM, BLOCK_D)
    else:
        # as kernels/attention.py's `_decode_kernel`: partials, then the last split to finish
        # combines them (the barrier orders the stores before the counter's release)
        part_o = PART_O + i.to(tl.int64) * sp_b + heads[:, None] * sp_h + offs_d[None, :]
        part_lse = PART_LSE + i.to(tl.int64) * sl_b + heads * sl_h
        _store_rows(part_o + split * sp_s, out, head_ok, offs_d, HEAD_DIM, BLOCK_D)
        tl.store(part_lse + split, m_i + tl.log2(l_i), mask=head_ok)
        tl.debug_barrier()
        done = tl.atomic_add(LOCK + bh, 1, sem="acq_rel", scope="gpu")
        if done == n_written - 1:
            o = _combine_splits(part_o, part_lse, sp_s, n_written, head_ok, d_ok, BLOCK_H, BLOCK_D)
            _store_rows(out_rows, o.to(OUT.dtype.element_ty), head_ok, offs_d, HEAD_DIM, BLOCK_D)
            tl.store(LOCK + bh, 0)  # ready for the next step (and the next graph replay)


def _paged_prefill_kernel(
    Q,
    K,
    V,
    KP,
    VP,
    SLOTS,
    QSTART,
    QLEN,
    CLEN,
    BT,
    OUT,
    qk_scale,
    sq_h,
    sq_t,
    sk_h,
    sk_t,
    sv_h,
    sv_t,  # q [1, H, T, D], k, v [1, Hkv, T, D]
    skp_b,
    skp_h,
    skp_s,
    svp_b,
    svp_h,
    svp_s,  # pools [num_blocks, Hkv, BS, D]
    sbt,
    so_t,
    so_h,  # block_tables [N, max_blocks], out [1, T, H, D]
    N,
    window,
    SLOPES,
    cap,  # ALIBI: slopes [H] fp32; SOFTCAP: softcap * log2(e) (qk_scale is then scale / softcap)
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SINGLES: tl.constexpr = True,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    # SINGLES: every sequence's tokens; else those of 2+ tokens (the decode kernel runs the others)
    kvh = tl.program_id(1)
    i, m = _find_tile(QLEN, N, tl.program_id(0), G, BLOCK_M, BLOCK_S, SINGLES)
    if i >= N:  # a spare tile of the grid's bound
        return
    qs = tl.load(QSTART + i).to(tl.int64)  # the sequence's first row
    qlen = tl.load(QLEN + i).to(tl.int32)
    c = tl.load(CLEN + i).to(tl.int32)  # its cached tokens: token j sits at position c + j
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    # rows of this tile: (token qi, query head qh) packed, G heads of kv head kvh per token
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    qh = kvh * G + rows % G
    row_ok = qi < qlen
    q = _load_rows(
        Q + qh[:, None] * sq_h + (qs + qi)[:, None] * sq_t + offs_d[None, :], row_ok, offs_d, HEAD_DIM, BLOCK_D
    )  # [BLOCK_M, BLOCK_D]
    k_new = K + kvh * sk_h + qs * sk_t  # the sequence's new keys / values: rows j at + j * sk_t
    v_new = V + kvh * sv_h + qs * sv_t
    kp = KP + kvh * skp_h
    vp = VP + kvh * svp_h
    bt_row = BT + i.to(tl.int64) * sbt

    # the tokens whose first query head is a row of this tile go to the pool (nothing this step
    # reads those slots: the new tokens are read from k and v below)
    j_lo = tl.cdiv(m * BLOCK_M, G)
    j_hi = tl.minimum(tl.cdiv((m + 1) * BLOCK_M, G), qlen)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        offs_j = j0 + offs_n
        ok = offs_j < j_hi
        slots = tl.load(SLOTS + qs + offs_j, mask=ok, other=-1)
        _write_pool(k_new, sk_t, kp, skp_b, skp_s, slots, ok, offs_j, offs_d, HEAD_DIM, BLOCK_D, BS)
        _write_pool(v_new, sv_t, vp, svp_b, svp_s, slots, ok, offs_j, offs_d, HEAD_DIM, BLOCK_D, BS)

    i_min = (m * BLOCK_M) // G
    hi = tl.minimum(((m + 1) * BLOCK_M - 1) // G, qlen - 1) + 1  # no row of this tile sees a new key >= hi
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pool_ty = KP.dtype.element_ty
    if ALIBI:  # each row's head's slope, in base 2
        slope = tl.load(SLOPES + qh) * 1.4426950408889634  # [BLOCK_M]
        q_pos = c + qi  # the rows' positions: the variant's query index for cached keys (new keys: qi)
    else:
        slope, q_pos = 0.0, 0
    if WINDOWED:
        # row qi (position c + qi) sees positions (c + qi - window, c + qi]; nothing below the
        # first row's window is loaded
        lo_pos = tl.maximum(c + i_min - window + 1, 0)
        for j0 in range(tl.minimum(lo_pos, c), c, BLOCK_N):
            offs_j = j0 + offs_n
            ok = offs_j < c
            visible = ok[None, :] & (offs_j[None, :] > (c + qi - window)[:, None])
            acc, m_i, l_i = _attend_pool(
                acc,
                m_i,
                l_i,
                q,
                kp,
                vp,
                skp_b,
                skp_s,
                svp_b,
                svp_s,
                bt_row,
                offs_j,
                ok,
                offs_d,
                visible,
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                BS,
                True,
                cap,
                slope,
                q_pos,
                SOFTCAP,
                ALIBI,
            )
        for j0 in range(tl.maximum(lo_pos - c, 0), hi, BLOCK_N):
            offs_j = j0 + offs_n
            ok = offs_j < hi
            visible = (offs_j[None, :] <= qi[:, None]) & (offs_j[None, :] > qi[:, None] - window) & ok[None, :]
            acc, m_i, l_i = _attend_new(
                acc,
                m_i,
                l_i,
                q,
                k_new,
                v_new,
                sk_t,
                sv_t,
                offs_j,
                ok,
                offs_d,
                visible,
                qk_scale,
                pool_ty,
                HEAD_DIM,
                BLOCK_D,
                True,
                cap,
                slope,
                qi,
                SOFTCAP,
                ALIBI,
            )
    else:
        # phase 1: the cached positions [0, c), visible to every row: full tiles unmasked
        c_full = (c // BLOCK_N) * BLOCK_N
        for j0 in range(0, c_full, BLOCK_N):
            offs_j = j0 + offs_n
            acc, m_i, l_i = _attend_pool(
                acc,
                m_i,
                l_i,
                q,
                kp,
                vp,
                skp_b,
                skp_s,
                svp_b,
                svp_s,
                bt_row,
                offs_j,
                None,
                offs_d,
                None,
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                BS,
                False,
                cap,
                slope,
                q_pos,
                SOFTCAP,
                ALIBI,
            )
        for j0 in range(c_full, c, BLOCK_N):
            offs_j = j0 + offs_n
            ok = offs_j < c
            acc, m_i, l_i = _attend_pool(
                acc,
                m_i,
                l_i,
                q,
                kp,
                vp,
                skp_b,
                skp_s,
                svp_b,
                svp_s,
                bt_row,
                offs_j,
                ok,
                offs_d,
                ok[None, :],
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                BS,
                True,
                cap,
                slope,
                q_pos,
                SOFTCAP,
                ALIBI,
            )
        # phase 2: the new tokens, causal; keys < free (<= i_min + 1) are seen by every row
        free = ((i_min + 1) // BLOCK_N) * BLOCK_N
        for j0 in range(0, free, BLOCK_N):
            offs_j = j0 + offs_n
            acc, m_i, l_i = _attend_new(
                acc,
                m_i,
                l_i,
                q,
                k_new,
                v_new,
                sk_t,
                sv_t,
                offs_j,
                None,
                offs_d,
                None,
                qk_scale,
                pool_ty,
                HEAD_DIM,
                BLOCK_D,
                False,
                cap,
                slope,
                qi,
                SOFTCAP,
                ALIBI,
            )
        for j0 in range(free, hi, BLOCK_N):
            offs_j = j0 + offs_n
            ok = offs_j < hi
            visible = (offs_j[None, :] <= qi[:, None]) & ok[None, :]
            acc, m_i, l_i = _attend_new(
                acc,
                m_i,
                l_i,
                q,
                k_new,
                v_new,
                sk_t,
                sv_t,
                offs_j,
                ok,
                offs_d,
                visible,
                qk_scale,
                pool_ty,
                HEAD_DIM,
                BLOCK_D,
                True,
                cap,
                slope,
                qi,
                SOFTCAP,
                ALIBI,
            )

    out = acc / l_i[:, None]
    _store_rows(
        OUT + (qs + qi)[:, None] * so_t + qh[:, None] * so_h + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        row_ok,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
    )


@functools.cache
def _kernels():
    """(decode kernel, varlen kernel), jitted; kernels/attention.py's device functions they
    call are bound here in their jitted form first."""
    A._triton()
    module = globals()
    for name in A._JIT_FUNCTIONS:  # those imported above
        if name in module:
            module[name] = getattr(A, name)
    for fn in (_pool_rows, _attend_pool, _write_pool, _tiles, _find_tile, _padding_row):
        module[fn.__name__] = triton_jit(fn)
    return jit(_paged_decode_kernel), jit(_paged_prefill_kernel)


# ---------------------------------------------------------------------------------------------
# Wrapper: check shapes, allocate, launch.
def _check_paged(q, k, v, k_pool, v_pool, slot_mapping, query_start, query_lens, cache_lens, block_tables):
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"paged_attention: q must be [1, H, T, D], got {tuple(q.shape)}")
    _, H, T, D = q.shape
    Hkv = k.shape[1]
    if k.shape != (1, Hkv, T, D) or v.shape != k.shape:
        raise ValueError(f"paged_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"paged_attention: {H} query heads are not a multiple of {Hkv} kv heads")
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape or k_pool.shape[1] != Hkv or k_pool.shape[3] != D:
        raise ValueError(
            f"paged_attention: pools {tuple(k_pool.shape)} / {tuple(v_pool.shape)} do not fit k {tuple(k.shape)}"
        )
    if k_pool.dtype != v_pool.dtype or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("paged_attention: the pools must share a dtype and be contiguous in head_dim")
    N = query_lens.shape[0] if query_lens.dim() == 1 else -1
    for name, t, shape in (
        ("slot_mapping", slot_mapping, (T,)),
        ("query_start", query_start, (N,)),
        ("query_lens", query_lens, (N,)),
        ("cache_lens", cache_lens, (N,)),
    ):
        if t.shape != shape or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"paged_attention: {name} must be an int tensor of shape {shape}, got {tuple(t.shape)} {t.dtype}"
            )
    if block_tables.dim() != 2 or block_tables.shape[0] != N or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"paged_attention: block_tables must be an int tensor [{N}, max_blocks], got "
            f"{tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if not 1 <= D <= 256:
        raise ValueError(f"paged_attention: head_dim {D} is outside the Triton kernels' range 1..256")


PATHS = ("decode", "mixed", "varlen")


def paged_attention_triton(
    q,
    k,
    v,
    k_pool,
    v_pool,
    slot_mapping,
    query_start,
    query_lens,
    cache_lens,
    block_tables,
    scale,
    window=0,
    softcap=0.0,
    alibi_slopes=None,
    *,
    out=None,
    path=None,
    config=None,
    decode_config=None,
    num_splits=None,
):
    """`paged_attention` on the Triton kernels. path: "decode" (the decode kernel alone: every
    sequence brings one token or none), "mixed" (the output zeroed, the varlen kernel for the
    sequences of 2+ tokens, the decode kernel for those of one), "varlen" (the output zeroed, the
    varlen kernel for every sequence); None: "decode" where T == N, else "mixed". config /
    decode_config: the varlen / decode kernel's launch config (None: the table's); num_splits:
    the decode kernel's (None: from shapes). out [1, T, H, D] may be given."""
    _check_paged(q, k, v, k_pool, v_pool, slot_mapping, query_start, query_lens, cache_lens, block_tables)
    A.check_variant("paged_attention", softcap, alibi_slopes, q.shape[1])
    decode_kernel, varlen_kernel = _kernels()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    query_start, query_lens, cache_lens, slot_mapping, block_tables = (
        t if t.is_contiguous() else t.contiguous()
        for t in (query_start, query_lens, cache_lens, slot_mapping, block_tables)
    )
    _, H, T, D = q.shape
    Hkv, BS = k_pool.shape[1], k_pool.shape[2]
    N = query_lens.shape[0]
    G = H // Hkv
    path = path or ("decode" if T == N else "mixed")
    if path not in PATHS:
        raise ValueError(f"paged_attention: path {path!r} is not one of {', '.join(PATHS)}")
    if out is None:
        out = (torch.empty if path == "decode" else torch.zeros)(1, T, H, D, dtype=q.dtype, device=q.device)
    elif path != "decode":
        out.zero_()
    if T == 0 or N == 0:
        return out
    arch = arch_of(q.device)
    BLOCK_D = max(16, next_power_of_2(D))
    pools = (k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2))
    common = (
        q.stride(1),
        q.stride(2),
        k.stride(1),
        k.stride(2),
        v.stride(1),
        v.stride(2),
        *pools,
        block_tables.stride(0),
        out.stride(1),
        out.stride(2),
    )
    args = (q, k, v, k_pool, v_pool, slot_mapping, query_start, query_lens, cache_lens, block_tables, out)
    qk_scale, slopes, cap, variant = A.variant_launch(scale, softcap, alibi_slopes)
    if path != "decode":
        cfg = config or paged_attention_config("prefill", D, arch, q.element_size())
        grid = (cdiv(T * G, cfg["BLOCK_M"]) + N, Hkv)  # a bound on the sequences' row tiles (see `_find_tile`)
        varlen_kernel[grid](
            *args,
            qk_scale,
            *common,
            N,
            window,
            slopes,
            cap,
            G=G,
            HEAD_DIM=D,
            BLOCK_D=BLOCK_D,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_S=cfg.get("BLOCK_S", _block_s(N)),
            BS=BS,
            WINDOWED=window > 0,
            SINGLES=path == "varlen",
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **variant,
        )
    if path == "varlen":
        return out
    cfg = decode_config or paged_attention_config("decode", D, arch, q.element_size())
    splits = num_splits or paged_decode_splits(N, Hkv, block_tables.shape[1] * BS, cfg, sm_count(q.device))
    if splits > A.MAX_SPLITS:
        raise ValueError(f"paged_attention: {splits} splits exceed MAX_SPLITS={A.MAX_SPLITS}")
    part_o = torch.empty(N, H, splits, D, dtype=torch.float32, device=q.device) if splits > 1 else out
    part_lse = torch.empty(N, H, splits, dtype=torch.float32, device=q.device) if splits > 1 else out
    lock = split_counters(q.device, N * Hkv) if splits > 1 else out
    parts = (
        (part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1))
        if splits > 1
        else (0,) * 5
    )
    decode_kernel[(N * Hkv, splits)](
        *args,
        part_o,
        part_lse,
        lock,
        qk_scale,
        *common,
        *parts,
        T,
        N,
        Hkv,
        cfg.get("SPLIT_FLOOR", cfg["MIN_SPLIT"]),
        window,
        slopes,
        cap,
        G=G,
        HEAD_DIM=D,
        BLOCK_D=BLOCK_D,
        BLOCK_H=max(16, next_power_of_2(G)),
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_S=cfg.get("BLOCK_S", _block_s(N)),
        BS=BS,
        SPLIT=splits > 1,
        WINDOWED=window > 0,
        MIXED=path == "mixed",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_options(q.device),
        **variant,
    )
    return out


def _out_like(q):
    _, H, T, D = q.shape
    return q.new_empty(1, T, H, D)


@torch.library.custom_op("dsc::ragged_attention", mutates_args=())
def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    cache_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """softcap, alibi_slopes: as dsc::attention's (kernels/attention.py `attend_reference`)."""
    return ragged_attention_reference(
        q, k, v, slot_mapping, query_start, query_lens, cache_lens, block_tables, scale, window, softcap, alibi_slopes
    )


@ragged_attention.register_fake
def _(
    q,
    k,
    v,
    slot_mapping,
    query_start,
    query_lens,
    cache_lens,
    block_tables,
    scale,
    window=0,
    softcap=0.0,
    alibi_slopes=None,
):
    return _out_like(q)


declare("dsc.ragged_attention.default")


@torch.library.custom_op("dsc::paged_attention", mutates_args=("k_pool", "v_pool"))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    cache_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_attention_reference(
        q,
        k,
        v,
        k_pool,
        v_pool,
        slot_mapping,
        query_start,
        query_lens,
        cache_lens,
        block_tables,
        scale,
        window,
        softcap,
        alibi_slopes,
    )


@paged_attention.register_fake
def _(
    q,
    k,
    v,
    k_pool,
    v_pool,
    slot_mapping,
    query_start,
    query_lens,
    cache_lens,
    block_tables,
    scale,
    window=0,
    softcap=0.0,
    alibi_slopes=None,
):
    return _out_like(q)


declare("dsc.paged_attention.default", attention=True)


@cuda_kernel(paged_attention)
def _(
    q,
    k,
    v,
    k_pool,
    v_pool,
    slot_mapping,
    query_start,
    query_lens,
    cache_lens,
    block_tables,
    scale,
    window=0,
    softcap=0.0,
    alibi_slopes=None,
):
    return paged_attention_triton(
        q,
        k,
        v,
        k_pool,
        v_pool,
        slot_mapping,
        query_start,
        query_lens,
        cache_lens,
        block_tables,
        scale,
        window,
        softcap,
        alibi_slopes,
    )


@planner("dsc.paged_attention.default")
def _plan_paged_attention(
    q,
    k,
    v,
    k_pool,
    v_pool,
    slot_mapping,
    query_start,
    query_lens,
    cache_lens,
    block_tables,
    scale,
    window=0,
    softcap=0.0,
    alibi_slopes=None,
    *,
    arch,
):
    """The kernels the CUDA implementation launches: the decode kernel where T == N (one launch),
    else the output's memset, the varlen kernel and the decode kernel (three). The ragged
    program's T and N are symbolic at compile time: then both configs and a mixed step's
    launches (the most); decode splits are counted at N = 1 (the most splits) where N is symbolic."""
    _, H, T, D = q.shape
    N, max_blocks = block_tables.shape
    Hkv, BS = k_pool.shape[1], k_pool.shape[2]
    extra = {"group": H // Hkv, "block_size": BS, **A.variant_config(window, softcap, alibi_slopes)}
    seqs = N if isinstance(N, int) else 1
    dec = paged_attention_config("decode", D, arch, q.element_size())
    max_context = max_blocks * BS if isinstance(max_blocks, int) else A.MAX_SPLITS * dec["MIN_SPLIT"]
    splits = paged_decode_splits(seqs, Hkv, max_context, dec, SM_COUNT.get(arch, SM_COUNT["sm_90"]))
    dec = {**dec, "splits": splits, "splits_at_seqs": seqs, **extra}
    if isinstance(T, int) and isinstance(N, int) and T == N:
        return {"name": "triton.paged_attention_decode", "config": dec, "launches": 1}
    varlen = {**paged_attention_config("prefill", D, arch, q.element_size()), **extra}
    name = "triton.paged_attention_mixed" if isinstance(T, int) and isinstance(N, int) else "triton.paged_attention"
    return {"name": name, "config": {"decode": dec, "varlen": varlen}, "launches": 3}
