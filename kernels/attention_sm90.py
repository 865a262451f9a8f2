"""`dsc::attention`'s prefill on Hopper (sm_90: H100, H200): a warp-specialized, persistent
Gluon kernel.

kernels/attention.py's `_prefill_kernel` (Triton) runs every warp through the same loop: load a
K/V tile, QK^T on the tensor cores, the softmax on the ALUs, p @ v on the tensor cores.  Its
two warpgroups share the pipeline's buffers through CTA-wide barriers, so they move in step,
and the tensor cores idle while both do their softmax (46-50% of the H200's bf16 rate at 2048
tokens).  Here the work is split by role, FlashAttention-3 style:

- a producer warp takes work items (sequence, 128-row tile, kv head) from a global counter,
  longest row tiles of a sequence first (so the items spread over the SMs as the hardware
  would spread programs, but a CTA goes on to its next item without a relaunch), and only
  issues TMA copies: each item's queries, then its K and V tiles into rings of K_STAGES /
  V_STAGES shared-memory slots (`k_ready` / `v_ready` complete on the copies' bytes);
- two consumer warpgroups of 64 rows each run QK^T, softmax and p @ v on their rows and hand
  each slot back (`k_empty` after QK^T, `v_empty` after p @ v; both must arrive).  Nothing
  else synchronizes them, so while one runs its softmax the other's wgmma has the tensor
  cores.  (Tried on an H200, no faster: issuing a tile's p @ v and the next QK^T back to back,
  the softmax during the previous p @ v (FA3's intra-warpgroup overlap), and turns between the
  consumers (FA3's ping-pong).)
The producer passes each item's index to the consumers through shared memory (`tile_ready` /
`tile_empty`); an index past the last item ends every partition.  The CTA whose producer
finishes last resets the counter (kernels/launch.py `split_counters`: launches on one stream
run one after another).

Rows and masking are `_prefill_kernel`'s (see attention.py), but a warpgroup's 64 rows are the
G query heads x T = 64 / G tokens of one TMA box of q (row r: token r % T, head r // T).  Keys
come from two tensor descriptors:
- the cached prefix, positions [0, n_old), in tiles that end at n_old and go down (the last
  one starts below 0: the copy reads zeros there and the rows mask it), so no tile reads a
  cache slot >= n_old (stale, or being written by another item);
- the new tokens, keys [0, hi), from k / v (a tile past S reads zeros); tiles that reach the
  diagonal (or past the cache's end) are masked.
The producer also writes each item's own tokens' k / v into the cache once its K/V copies are
issued (TMA copies through a staging buffer, a row a copy, rows past S skipped; no item reads
a cache slot >= cache_pos).  The consumers touch global memory only to store their output.

Used by attention.prefill_attention on sm_90 where the launch config has `WS` (the head_dim 128
row; head_dim 64 only as a PREFILL_VARIANTS row: correct, but slower than the Triton kernel at
GPT-2-XL's heads) for 16-bit q / k / v /
caches of one dtype, G in 1, 2, 4, 8, no sliding window, TMA-addressable tensors
(`prefill_ws_supported`); WS_CONFIGS gives the tile.  Gluon has no interpreter: CPU tests build it for sm_90
(tests/test_attention_kernels.py), tests/gpu/test_gpu_attention.py checks it on a GPU and
`scripts/bench_kernels.py attention` times it.
"""

from __future__ import annotations

import functools
import math

import torch

from dsc.kernels.launch import gluon_device, gluon_jit, split_counters

gl = tl = mma_v2 = None  # gluon's language (and triton's), bound by launch.gluon_triton_jit on first use
hopper = None  # triton.experimental.gluon.language.nvidia.hopper, bound by `_bind`
tma_load = tma_store = None  # its TMA copies (triton 3.6: async_copy_*; later: async_load / async_store)

CHUNK = 32  # rows of the cache write's staging buffers
WS_CONFIGS = {  # head_dim -> keys per tile, ring slots, registers per thread of each role
    128: dict(BLOCK_N=128, K_STAGES=2, V_STAGES=2, PRODUCER_REGS=24, CONSUMER_REGS=216),
    64: dict(BLOCK_N=128, K_STAGES=3, V_STAGES=3, PRODUCER_REGS=24, CONSUMER_REGS=216),
}


def _bind():
    global hopper, tma_load, tma_store
    if hopper is None:
        from triton.experimental.gluon.language.nvidia import hopper as h

        hopper = h
        tma_load = getattr(h.tma, "async_load", None) or h.tma.async_copy_global_to_shared
        tma_store = getattr(h.tma, "async_store", None) or h.tma.async_copy_shared_to_global


@gluon_device
def _attend_tile(
    q,
    k_tile,
    v_tile,
    acc,
    m_i,
    l_i,
    t,
    tok0,
    n_old,
    n_old_tiles,
    n_fit,
    free,
    qk_scale,
    k_free,
    v_ready,
    v_phase,
    v_free,
    T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    o_layout: gl.constexpr,
):
    """One warpgroup's rows (q [64, D] in shared memory) against key tile t (k_tile / v_tile
    [BLOCK_N, D] in shared memory): QK^T, the mask where the tile needs one, the online softmax
    in base 2, p @ v.  Hands the K slot back after the QK^T (k_free) and the V slot after the
    p @ v (v_free).  m_i / l_i in the scores' row layout.  Returns (acc, m_i, l_i)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ROWS: gl.constexpr = q.shape[0]
    qk = hopper.warpgroup_mma(
        q, k_tile.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True
    )
    qk = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    hopper.mbarrier.arrive(k_free, count=1)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    j0 = (t - n_old_tiles) * BLOCK_N  # new tiles: first key; old tiles: < 0
    if t < n_old_tiles:
        first = n_old - (t + 1) * BLOCK_N  # old tile: positions first + cols; < 0 is no key
        if first < 0:
            qk = gl.where((first + cols >= 0)[None, :], qk, float("-inf"))
    elif j0 + BLOCK_N > free:
        j = j0 + cols
        qi = tok0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) % T
        qk = gl.where((j[None, :] <= qi[:, None]) & (j < n_fit)[None, :], qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    p = gl.exp2(qk * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    p16 = gl.convert_layout(p.to(q.dtype), p_layout)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    hopper.mbarrier.wait(v_ready, v_phase)
    acc = hopper.warpgroup_mma(p16, v_tile, acc, is_async=True)
    acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    hopper.mbarrier.arrive(v_free, count=1)
    return acc, m_new, l_i


@gluon_device
def _item(w, n_m, Hkv, POS, S, Smax, T: gl.constexpr, BLOCK_N: gl.constexpr):
    # work item w -> (b, pid_m, kvh, start, n_old, n_fit, n_old_tiles, n_tiles): items go sequence
    # by sequence, a sequence's longest (last) row tiles first, every kv head's at once
    b = w // (n_m * Hkv)
    pid_m = n_m - 1 - (w % (n_m * Hkv)) // Hkv
    kvh = w % Hkv
    start = gl.load(POS + b).to(gl.int32)  # cache_pos[b]: position of token 0
    n_old = gl.minimum(start, Smax)
    n_fit = Smax - start  # new tokens j < n_fit have a cache slot
    hi = gl.maximum(gl.minimum(gl.minimum(pid_m * (2 * T) + 2 * T, S), n_fit), 0)  # new keys [0, hi)
    n_old_tiles = gl.cdiv(n_old, BLOCK_N)
    return b, pid_m, kvh, start, n_old, n_fit, n_old_tiles, n_old_tiles + gl.cdiv(hi, BLOCK_N)


@gluon_device
def _next_item(tile_smem, tile_ready, tile_empty, i, layout: gl.constexpr):
    # a consumer's i-th item index, from the producer
    hopper.mbarrier.wait(tile_ready.index(i % 2), (i // 2) & 1)
    w = gl.sum(tile_smem.index(i % 2).load(layout), 0)
    hopper.mbarrier.arrive(tile_empty.index(i % 2), count=1)
    return w


@gluon_device
def _consumer(
    WG: gl.constexpr,
    OUT,
    so_b,
    so_s,
    so_h,
    POS,
    n_m,
    Hkv,
    S,
    Smax,
    n_items,
    qk_scale,
    q_bufs,
    k_bufs,
    v_bufs,
    tile_smem,
    tile_ready,
    tile_empty,
    q_ready,
    q_empty,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
):
    KS: gl.constexpr = k_bufs.shape[0]  # K and V ring slots
    VS: gl.constexpr = v_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    G: gl.constexpr = q_bufs.shape[2]
    T: gl.constexpr = q_bufs.shape[3]
    ROWS: gl.constexpr = G * T
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    r_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))

    i = 0  # items done
    c = 0  # K/V tiles consumed over all items (the rings' slots and phases)
    w = _next_item(tile_smem, tile_ready, tile_empty, i, one)
    while w < n_items:
        b, pid_m, kvh, start, n_old, n_fit, n_old_tiles, n_tiles = _item(w, n_m, Hkv, POS, S, Smax, T, BLOCK_N)
        tok0 = pid_m * (2 * T) + WG * T  # this warpgroup's first token; row r: token tok0 + r % T, head r // T
        free = gl.minimum(tok0 + 1, n_fit)  # new keys < free are visible to every row here
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        hopper.mbarrier.wait(q_ready.index(i % 2), (i // 2) & 1)
        q = q_bufs.index(i % 2).reshape([ROWS, HEAD_DIM])
        for t in range(n_tiles):
            hopper.mbarrier.wait(k_ready.index(c % KS), (c // KS) & 1)
            acc, m_i, l_i = _attend_tile(
                q,
                k_bufs.index(c % KS).reshape([BLOCK_N, HEAD_DIM]),
                v_bufs.index(c % VS).reshape([BLOCK_N, HEAD_DIM]),
                acc,
                m_i,
                l_i,
                t,
                tok0,
                n_old,
                n_old_tiles,
                n_fit,
                free,
                qk_scale,
                k_empty.index(c % KS),
                v_ready.index(c % VS),
                (c // VS) & 1,
                v_empty.index(c % VS),
                T,
                BLOCK_N,
                o_layout,
            )
            c += 1
        hopper.mbarrier.arrive(q_empty.index(i % 2), count=1)  # the item's last QK^T is done

        out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        qi_o = tok0 + r_o % T
        qh_o = kvh * G + r_o // T
        gl.store(
            OUT + b.to(gl.int64) * so_b + qi_o[:, None] * so_s + qh_o[:, None] * so_h + d_o[None, :],
            out.to(OUT.dtype.element_ty),
            mask=(qi_o < S)[:, None],
        )
        i += 1
        w = _next_item(tile_smem, tile_ready, tile_empty, i, one)


@gluon_device
def _copy_tile(bufs, ready, empty, c, new, cached, b, kvh, t, n_old, n_old_tiles):
    # the c-th K (or V) tile copy into its ring slot, once both consumers handed the slot back:
    # tile t < n_old_tiles: cached positions n_old - (t + 1) * BLOCK_N .. (the last one starts
    # below 0 and reads zeros there); then the new keys from 0 (past S: zeros)
    SLOTS: gl.constexpr = bufs.shape[0]
    BLOCK_N: gl.constexpr = bufs.shape[3]
    hopper.mbarrier.wait(empty.index(c % SLOTS), ((c // SLOTS) & 1) ^ 1)  # (a fresh barrier's previous phase
    hopper.mbarrier.expect(ready.index(c % SLOTS), new.block_type.nbytes)  # counts as complete)
    if t < n_old_tiles:
        tma_load(cached, [b, kvh, n_old - (t + 1) * BLOCK_N, 0], ready.index(c % SLOTS), bufs.index(c % SLOTS))
    else:
        tma_load(new, [b, kvh, (t - n_old_tiles) * BLOCK_N, 0], ready.index(c % SLOTS), bufs.index(c % SLOTS))


@gluon_device
def _producer(
    POS,
    CTR,
    n_m,
    Hkv,
    S,
    Smax,
    n_items,
    q_bufs0,
    q_bufs1,
    k_bufs,
    v_bufs,
    k_stage,
    v_stage,
    tile_smem,
    tile_ready,
    tile_empty0,
    tile_empty1,
    q_ready0,
    q_ready1,
    q_empty0,
    q_empty1,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    stage_bar,
    QD,
    KD,
    VD,
    KCD,
    VCD,
    KSD,
    VSD,
    KRD,
    VRD,
):
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    G: gl.constexpr = q_bufs0.shape[2]
    T: gl.constexpr = q_bufs0.shape[3]
    CHUNK: gl.constexpr = k_stage.shape[2]
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    i = 0  # items taken
    c = 0  # K/V tiles issued over all items
    n_chunks = 0  # cache-write chunks over all items (stage_bar's phase)
    w = gl.atomic_add(CTR, 1)
    while w < n_items:
        # hand the item to the consumers (the slot is free once both read the item before last)
        hopper.mbarrier.wait(tile_empty0.index(i % 2), ((i // 2) & 1) ^ 1)  # (a fresh barrier's
        hopper.mbarrier.wait(tile_empty1.index(i % 2), ((i // 2) & 1) ^ 1)  # previous phase is complete)
        tile_smem.index(i % 2).store(gl.full([1], w, gl.int32, layout=one))
        hopper.mbarrier.arrive(tile_ready.index(i % 2), count=1)
        b, pid_m, kvh, start, n_old, n_fit, n_old_tiles, n_tiles = _item(w, n_m, Hkv, POS, S, Smax, T, BLOCK_N)
        tok0 = pid_m * (2 * T)
        # the two warpgroups' queries: G heads x T tokens each (tokens past S read zeros)
        hopper.mbarrier.wait(q_empty0.index(i % 2), ((i // 2) & 1) ^ 1)
        hopper.mbarrier.expect(q_ready0.index(i % 2), QD.block_type.nbytes)
        tma_load(QD, [b, kvh * G, tok0, 0], q_ready0.index(i % 2), q_bufs0.index(i % 2))
        hopper.mbarrier.wait(q_empty1.index(i % 2), ((i // 2) & 1) ^ 1)
        hopper.mbarrier.expect(q_ready1.index(i % 2), QD.block_type.nbytes)
        tma_load(QD, [b, kvh * G, tok0 + T, 0], q_ready1.index(i % 2), q_bufs1.index(i % 2))
        for t in range(n_tiles):  # K and V tiles
            _copy_tile(k_bufs, k_ready, k_empty, c, KD, KCD, b, kvh, t, n_old, n_old_tiles)
            _copy_tile(v_bufs, v_ready, v_empty, c, VD, VCD, b, kvh, t, n_old, n_old_tiles)
            c += 1
        # the item's own tokens j in [tok0, tok0 + 2 T) to cache slots start + j, CHUNK rows at a
        # time through the staging buffers, one row per copy (rows j >= S are not written; slots
        # past the cache's end drop out of the copy); no item reads a cache slot >= start
        j_end = gl.minimum(tok0 + 2 * T, S)
        for j0 in range(tok0, j_end, CHUNK):
            hopper.mbarrier.expect(stage_bar, 2 * KSD.block_type.nbytes)
            tma_load(KSD, [b, kvh, j0, 0], stage_bar, k_stage)
            tma_load(VSD, [b, kvh, j0, 0], stage_bar, v_stage)
            hopper.mbarrier.wait(stage_bar, n_chunks & 1)
            for r in gl.static_range(CHUNK):
                if j0 + r < j_end:
                    tma_store(KRD, [b, kvh, start + j0 + r, 0], k_stage.slice(r, 1, dim=2))
                    tma_store(VRD, [b, kvh, start + j0 + r, 0], v_stage.slice(r, 1, dim=2))
            hopper.tma.store_wait(pendings=0)  # the staging buffers are read before the next chunk's copy
            n_chunks += 1
        i += 1
        w = gl.atomic_add(CTR, 1)
    # no item left: an index past the last ends the consumers
    hopper.mbarrier.wait(tile_empty0.index(i % 2), ((i // 2) & 1) ^ 1)
    hopper.mbarrier.wait(tile_empty1.index(i % 2), ((i // 2) & 1) ^ 1)
    tile_smem.index(i % 2).store(gl.full([1], n_items, gl.int32, layout=one))
    hopper.mbarrier.arrive(tile_ready.index(i % 2), count=1)
    # the last CTA out resets the counters for the next launch (every CTA has taken its last item)
    if gl.atomic_add(CTR + 1, 1) == gl.num_programs(0) - 1:
        gl.store(CTR, 0)
        gl.store(CTR + 1, 0)


def _prefill_ws_kernel(
    OUT,
    POS,
    CTR,
    qk_scale,
    so_b,
    so_s,
    so_h,
    Hkv,
    S,
    Smax,
    n_items,
    QD,  # q [B, H, S, D]: blocks [1, G, T, D] (T = 64 / G tokens of the G heads: one warpgroup's rows)
    KD,
    VD,
    KCD,
    VCD,  # k, v, k_cache, v_cache: blocks [1, 1, BLOCK_N, D]
    KSD,
    VSD,  # k, v again: blocks [1, 1, CHUNK, D], unswizzled (the cache write's staging)
    KRD,
    VRD,  # k_cache, v_cache again: blocks [1, 1, 1, D], unswizzled (the cache write, a row a copy)
    K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    # CTR: two int32 counters at 0 (items taken, CTAs done); grid: at most one CTA per SM
    T: gl.constexpr = QD.block_type.shape[2]
    n_m = gl.cdiv(S, 2 * T)  # items per (sequence, kv head): 2 T tokens (128 rows) each
    q_bufs0 = gl.allocate_shared_memory(QD.dtype, [2] + QD.block_type.shape, QD.layout)  # two items' queries
    q_bufs1 = gl.allocate_shared_memory(QD.dtype, [2] + QD.block_type.shape, QD.layout)  # per warpgroup
    k_bufs = gl.allocate_shared_memory(KD.dtype, [K_STAGES] + KD.block_type.shape, KD.layout)
    v_bufs = gl.allocate_shared_memory(VD.dtype, [V_STAGES] + VD.block_type.shape, VD.layout)
    k_stage = gl.allocate_shared_memory(KSD.dtype, KSD.block_type.shape, KSD.layout)
    v_stage = gl.allocate_shared_memory(VSD.dtype, VSD.block_type.shape, VSD.layout)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bar: gl.constexpr = hopper.mbarrier.MBarrierLayout()
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    tile_empty0 = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    tile_empty1 = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    q_ready0 = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    q_ready1 = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    q_empty0 = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    q_empty1 = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], bar)
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar)
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], bar)
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar)
    stage_bar = gl.allocate_shared_memory(gl.int64, [1], bar)
    hopper.mbarrier.init(stage_bar, count=1)
    for i in gl.static_range(2):
        hopper.mbarrier.init(tile_ready.index(i), count=1)
        hopper.mbarrier.init(tile_empty0.index(i), count=1)
        hopper.mbarrier.init(tile_empty1.index(i), count=1)
        hopper.mbarrier.init(q_ready0.index(i), count=1)
        hopper.mbarrier.init(q_ready1.index(i), count=1)
        hopper.mbarrier.init(q_empty0.index(i), count=1)
        hopper.mbarrier.init(q_empty1.index(i), count=1)
    for i in gl.static_range(K_STAGES):
        hopper.mbarrier.init(k_ready.index(i), count=1)
        hopper.mbarrier.init(k_empty.index(i), count=2)  # both consumer warpgroups hand each slot back
    for i in gl.static_range(V_STAGES):
        hopper.mbarrier.init(v_ready.index(i), count=1)
        hopper.mbarrier.init(v_empty.index(i), count=2)

    consumer0 = (
        0,
        OUT,
        so_b,
        so_s,
        so_h,
        POS,
        n_m,
        Hkv,
        S,
        Smax,
        n_items,
        qk_scale,
        q_bufs0,
        k_bufs,
        v_bufs,
        tile_smem,
        tile_ready,
        tile_empty0,
        q_ready0,
        q_empty0,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
    )
    consumer1 = (
        1,
        OUT,
        so_b,
        so_s,
        so_h,
        POS,
        n_m,
        Hkv,
        S,
        Smax,
        n_items,
        qk_scale,
        q_bufs1,
        k_bufs,
        v_bufs,
        tile_smem,
        tile_ready,
        tile_empty1,
        q_ready1,
        q_empty1,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
    )
    producer = (
        POS,
        CTR,
        n_m,
        Hkv,
        S,
        Smax,
        n_items,
        q_bufs0,
        q_bufs1,
        k_bufs,
        v_bufs,
        k_stage,
        v_stage,
        tile_smem,
        tile_ready,
        tile_empty0,
        tile_empty1,
        q_ready0,
        q_ready1,
        q_empty0,
        q_empty1,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        stage_bar,
        QD,
        KD,
        VD,
        KCD,
        VCD,
        KSD,
        VSD,
        KRD,
        VRD,
    )
    gl.warp_specialize(
        [(_consumer, consumer0), (_consumer, consumer1), (_producer, producer)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS]
    )


DESCRIPTORS = ("QD", "KD", "VD", "KCD", "VCD", "KSD", "VSD", "KRD", "VRD")  # the kernel's, in order


def _boxes(G: int, head_dim: int, block_n: int) -> list[tuple[tuple[int, ...], bool]]:
    """(TMA box, swizzled) of each of DESCRIPTORS: a warpgroup's queries, K / V tiles of new keys
    and of the cache, the cache write's staging chunks and rows (unswizzled: row copies)."""
    chunk = min(2 * (64 // G), CHUNK)
    return (
        [((1, G, 64 // G, head_dim), True)]
        + [((1, 1, block_n, head_dim), True)] * 4
        + [((1, 1, chunk, head_dim), False)] * 2
        + [((1, 1, 1, head_dim), False)] * 2
    )


@functools.cache
def _box_layout(block: tuple[int, ...], dtype: str, swizzled: bool):
    """The shared-memory layout of a TMA box of 16-bit `dtype` ("bf16" | "fp16"): swizzled as
    the wgmma reads it, or plain rows."""
    from triton.experimental.gluon import language as gluon_language

    if not swizzled:
        return gluon_language.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=len(block))
    element = getattr(gluon_language, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
    return gluon_language.NVMMASharedLayout.get_default_for(list(block), element)


def ws_descriptors(q, k, v, k_cache, v_cache, block_n: int):
    """The kernel's Gluon TMA descriptors (DESCRIPTORS), or None where TMA cannot address one of
    the tensors (a base not 16-byte aligned, or a stride that is not a multiple of 16 bytes)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    ts = (q, k, v, k_cache, v_cache)
    if any(t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]) for t in ts):
        return None
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    tensors = (q, k, v, k_cache, v_cache, k, v, k_cache, v_cache)
    boxes = _boxes(q.shape[1] // k.shape[1], q.shape[-1], block_n)
    return [
        TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _box_layout(block, dtype, swizzled))
        for t, (block, swizzled) in zip(tensors, boxes)
    ]


def prefill_ws_supported(q, k, v, k_cache, v_cache, window: int, softcap: float = 0.0, alibi_slopes=None) -> bool:
    """Whether `prefill_ws` can run these tensors (the caller has checked the device is sm_90):
    16-bit and one dtype, head_dim in WS_CONFIGS, G = H / Hkv query heads per kv head in 1, 2, 4,
    8 (a warpgroup's 64 rows are 64 / G tokens of each head, a multiple of 8), no sliding window,
    no soft-capping and no ALiBi (the generic Triton kernel runs those)."""
    dtypes = {t.dtype for t in (q, k, v, k_cache, v_cache)}
    return (
        not window
        and not softcap
        and alibi_slopes is None
        and len(dtypes) == 1
        and dtypes <= {torch.float16, torch.bfloat16}
        and q.shape[-1] in WS_CONFIGS
        and q.shape[1] % k.shape[1] == 0
        and q.shape[1] // k.shape[1] in (1, 2, 4, 8)
    )


def prefill_ws(q, k, v, k_cache, v_cache, cache_pos, scale, out, config=None):
    """The warp-specialized prefill into out [B, S, H, D]; None where TMA cannot address the
    tensors (the caller then runs `_prefill_kernel`)."""
    from dsc.kernels.launch import sm_count

    _bind()
    B, H, S, D = q.shape
    Hkv, Smax = k.shape[1], k_cache.shape[2]
    cfg = {**WS_CONFIGS[D], **(config or {})}
    descs = ws_descriptors(q, k, v, k_cache, v_cache, cfg["BLOCK_N"])
    if descs is None:
        return None
    G = H // Hkv
    n_items = -(-S // (2 * (64 // G))) * B * Hkv
    grid = (min(n_items, sm_count(q.device)),)
    gluon_jit(_prefill_ws_kernel)[grid](
        out,
        cache_pos,
        split_counters(q.device, 2),
        scale * math.log2(math.e),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        Hkv,
        S,
        Smax,
        n_items,
        *descs,
        K_STAGES=cfg["K_STAGES"],
        V_STAGES=cfg["V_STAGES"],
        PRODUCER_REGS=cfg["PRODUCER_REGS"],
        CONSUMER_REGS=cfg["CONSUMER_REGS"],
        num_warps=4,
    )
    return out


def compile_for_sm90(dtype: str = "bf16", G: int = 4, head_dim: int = 128, config: dict | None = None):
    """`_prefill_ws_kernel` built for sm_90 without a GPU (launch.compile_for_arch), with the
    argument types a launch at these shapes gives it (dtype "bf16" | "fp16"; G query heads per
    kv head; config: WS_CONFIGS overrides); tests check the build (spills, register split)."""
    from dsc.kernels.launch import compile_for_arch

    _bind()
    cfg = {**WS_CONFIGS[head_dim], **(config or {})}
    types = {
        "OUT": f"*{dtype}",
        "POS": "*i64",
        "CTR": "*i32",
        "qk_scale": "fp32",
        **{n: "i32" for n in ("so_b", "so_s", "so_h", "Hkv", "S", "Smax", "n_items")},
        **{
            name: f"tensordesc<{dtype}[{', '.join(map(str, block))}],{_box_layout(block, dtype, swizzled)!r}>"
            for name, (block, swizzled) in zip(DESCRIPTORS, _boxes(G, head_dim, cfg["BLOCK_N"]))
        },
    }
    constexprs = {k: cfg[k] for k in ("K_STAGES", "V_STAGES", "PRODUCER_REGS", "CONSUMER_REGS")}
    return compile_for_arch(
        _prefill_ws_kernel,
        types,
        constexprs,
        num_warps=4,
        aligned=("OUT", "POS", "CTR", "so_b", "so_s", "so_h"),
        gluon=True,
    )
