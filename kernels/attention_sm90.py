"""`dsc::attention`'s prefill on Hopper (sm_90: H100, H200): a warp-specialized Gluon kernel.

kernels/attention.py's `_prefill_kernel` (Triton) runs every warp through the same loop: load a
K/V tile, QK^T on the tensor cores, the softmax on the ALUs, p @ v on the tensor cores.  Its
two warpgroups share the pipeline's buffers through CTA-wide barriers, so they move in step,
and the tensor cores idle while both do their softmax (46-50% of the H200's bf16 rate at 2048
tokens).  Here the work of one program is split by role, FlashAttention-3 style:

- a producer warp only issues TMA copies of K and V tiles into a ring of STAGES shared-memory
  slots (`k_ready` / `v_ready` barriers complete on the copies' bytes);
- two consumer warpgroups of 64 rows each run QK^T, softmax and p @ v on their rows, and hand
  each slot back (`k_empty` after QK^T, `v_empty` after p @ v; both consumers must arrive).
Nothing else synchronizes the consumers, so while one runs its softmax the other's wgmma has
the tensor cores: they settle out of phase.

The rows, the program order and the masking are `_prefill_kernel`'s (see attention.py):
program = (sequence, 128-row tile, kv head), rows = (token, query head of the group), longest
row tiles first.  Keys come from two tensor descriptors:
- the cached prefix, positions [0, n_old), in tiles that end at n_old and go down (the last
  one starts below 0: the copy reads zeros there and the rows mask it), so no tile reads a
  cache slot >= n_old (stale, or being written by another program);
- the new tokens, keys [0, hi), from k / v (a tile past S reads zeros); tiles that reach the
  diagonal (or past the cache's end) are masked.
The producer also loads each warpgroup's queries (one TMA box: the G heads x 64 / G tokens of
its rows, so a warpgroup's row r is token r % T of head r // T, T = 64 / G) and, once its K/V
copies are issued, writes the program's own tokens' k / v into the cache (TMA copies through a
staging buffer, a row a copy, rows past S skipped; no program reads a cache slot >= cache_pos).
The consumers touch global memory only to store their output rows.

Used by attention.prefill_attention on sm_90 for 16-bit q / k / v / caches of one dtype, head_dim
64 or 128, no sliding window, TMA-addressable tensors (`prefill_ws_supported`); the table row
WS_CONFIGS gives the tile.  Gluon has no interpreter: CPU tests build it for sm_90
(tests/test_attention_kernels.py), scripts/check_attention_gpu.py checks it on a GPU and
scripts/bench_attention.py times it.
"""
from __future__ import annotations

import math

import torch

from dsc.kernels.launch import gluon_device, gluon_jit

gl = tl = mma_v2 = None  # gluon's language (and triton's), bound by launch.gluon_jit on first use
hopper = None  # triton.experimental.gluon.language.nvidia.hopper, bound by `_bind`

CHUNK = 32  # rows of the cache write's staging buffers
WS_CONFIGS = {  # head_dim -> keys per tile, ring slots, producer registers
    128: dict(BLOCK_N=128, K_STAGES=3, V_STAGES=2, PRODUCER_REGS=24, CONSUMER_REGS=216, OVERLAP=True, PINGPONG=True),
    64: dict(BLOCK_N=128, K_STAGES=3, V_STAGES=3, PRODUCER_REGS=24, CONSUMER_REGS=216, OVERLAP=True, PINGPONG=True),
}


def _bind():
    global hopper
    if hopper is None:
        from triton.experimental.gluon.language.nvidia import hopper as h

        hopper = h


@gluon_device
def _softmax_step(qk, t, m_i, l_i, qi, cols, free, n_old, n_old_tiles, n_fit, qk_scale, BLOCK_N: gl.constexpr,
                  P_DTYPE: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr):
    # tile t's scores -> (p in the p @ v operand's layout and dtype, alpha in acc's row layout,
    # m, l): the mask where the tile needs one, then the online softmax in base 2
    j0 = (t - n_old_tiles) * BLOCK_N  # new tiles: first key; old tiles: < 0
    if t < n_old_tiles:
        first = n_old - (t + 1) * BLOCK_N  # old tile: positions first + cols; < 0 is no key
        if first < 0:
            qk = gl.where((first + cols >= 0)[None, :], qk, float("-inf"))
    elif j0 + BLOCK_N > free:
        j = j0 + cols
        qk = gl.where((j[None, :] <= qi[:, None]) & (j < n_fit)[None, :], qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    p = gl.exp2(qk * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    p16 = gl.convert_layout(p.to(P_DTYPE), p_layout)
    return p16, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), m_new, l_i


@gluon_device
def _consumer(WG: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, OUT, so_b, so_s, so_h, q_smem, k_bufs,
              v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, turn, b, kvh, pid_m, n_old, n_fit, n_old_tiles, n_tiles, S, qk_scale):
    # one warpgroup's 64 rows: T tokens of each of the G query heads of kv head kvh
    KS: gl.constexpr = k_bufs.shape[0]  # K and V ring slots
    VS: gl.constexpr = v_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    G: gl.constexpr = q_smem.shape[1]
    T: gl.constexpr = q_smem.shape[2]
    ROWS: gl.constexpr = G * T
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    tok0 = pid_m * (2 * T) + WG * T  # this warpgroup's first token; row r is token tok0 + r % T, head r // T
    qi = tok0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) % T
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    free = gl.minimum(tok0 + 1, n_fit)  # new keys < free are visible to every row here
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    qk_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    hopper.mbarrier.wait(q_ready.index(WG), 0)
    q = q_smem.reshape([ROWS, HEAD_DIM])
    if OVERLAP:
        # each tile's p @ v and the next tile's QK^T go to the tensor cores back to back, and
        # one wait covers both (nothing is in flight across the loop's back edge: ptxas would
        # serialize every wgmma if a loop-carried accumulator were still being written there)
        # PINGPONG: the two warpgroups take turns at issuing (`turn` barriers: issue e of
        # warpgroup 1 waits for issue e of warpgroup 0, which waits for issue e - 1 of
        # warpgroup 1), so each one's softmax runs while the tensor cores do the other's wgmmas
        hopper.mbarrier.wait(k_ready.index(0), 0)
        if PINGPONG:
            hopper.mbarrier.wait(turn.index(WG), 1 - WG)
        qk = hopper.warpgroup_mma(q, k_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), qk_zero,
                                  use_acc=False, is_async=True)
        if PINGPONG:
            hopper.mbarrier.arrive(turn.index(1 - WG), count=1)
        qk = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
        for t in range(n_tiles - 1):
            hopper.mbarrier.arrive(k_empty.index(t % KS), count=1)
            p16, alpha, m_i, l_i = _softmax_step(qk, t, m_i, l_i, qi, cols, free, n_old, n_old_tiles, n_fit, qk_scale,
                                                 BLOCK_N, q_smem.dtype, p_layout, o_layout)
            acc = acc * alpha[:, None]
            hopper.mbarrier.wait(v_ready.index(t % VS), (t // VS) & 1)
            hopper.mbarrier.wait(k_ready.index((t + 1) % KS), ((t + 1) // KS) & 1)
            if PINGPONG:
                hopper.mbarrier.wait(turn.index(WG), ((t + 1) & 1) ^ (1 - WG))
            acc = hopper.warpgroup_mma(p16, v_bufs.index(t % VS).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            # (its accumulator input, ignored, is tile t's raw scores: registers a wgmma defined)
            qk = hopper.warpgroup_mma(q, k_bufs.index((t + 1) % KS).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                                      qk, use_acc=False, is_async=True)
            if PINGPONG:
                hopper.mbarrier.arrive(turn.index(1 - WG), count=1)
            qk, acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(qk, acc))
            hopper.mbarrier.arrive(v_empty.index(t % VS), count=1)
        t = n_tiles - 1
        hopper.mbarrier.arrive(k_empty.index(t % KS), count=1)
        p16, alpha, m_i, l_i = _softmax_step(qk, t, m_i, l_i, qi, cols, free, n_old, n_old_tiles, n_fit, qk_scale,
                                             BLOCK_N, q_smem.dtype, p_layout, o_layout)
        acc = acc * alpha[:, None]
        hopper.mbarrier.wait(v_ready.index(t % VS), (t // VS) & 1)
        if PINGPONG:
            hopper.mbarrier.wait(turn.index(WG), ((t + 1) & 1) ^ (1 - WG))
        acc = hopper.warpgroup_mma(p16, v_bufs.index(t % VS).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        if PINGPONG:
            hopper.mbarrier.arrive(turn.index(1 - WG), count=1)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        hopper.mbarrier.arrive(v_empty.index(t % VS), count=1)
    else:
        for t in range(n_tiles):
            hopper.mbarrier.wait(k_ready.index(t % KS), (t // KS) & 1)
            qk = hopper.warpgroup_mma(q, k_bufs.index(t % KS).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), qk_zero,
                                      use_acc=False, is_async=True)
            qk = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
            hopper.mbarrier.arrive(k_empty.index(t % KS), count=1)
            p16, alpha, m_i, l_i = _softmax_step(qk, t, m_i, l_i, qi, cols, free, n_old, n_old_tiles, n_fit, qk_scale,
                                                 BLOCK_N, q_smem.dtype, p_layout, o_layout)
            hopper.mbarrier.wait(v_ready.index(t % VS), (t // VS) & 1)
            acc = hopper.warpgroup_mma(p16, v_bufs.index(t % VS).reshape([BLOCK_N, HEAD_DIM]), acc * alpha[:, None],
                                       is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            hopper.mbarrier.arrive(v_empty.index(t % VS), count=1)

    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    r_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    qi_o = tok0 + r_o % T
    qh_o = kvh * G + r_o // T
    gl.store(OUT + b.to(gl.int64) * so_b + qi_o[:, None] * so_s + qh_o[:, None] * so_h + d_o[None, :],
             out.to(OUT.dtype.element_ty), mask=(qi_o < S)[:, None])


@gluon_device
def _consumer0(OUT, so_b, so_s, so_h, q_smem0, q_smem1, k_bufs, v_bufs, k_stage, v_stage, q_ready, k_ready, v_ready,
               k_empty, v_empty, turn, stage_bar, QD, KD, VD, KCD, VCD, KSD, VSD, KRD, VRD, b, kvh, pid_m, start,
               n_old, n_fit, n_old_tiles, n_tiles, S, qk_scale, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(0, OVERLAP, PINGPONG, OUT, so_b, so_s, so_h, q_smem0, k_bufs, v_bufs, q_ready, k_ready, v_ready,
              k_empty, v_empty, turn, b, kvh, pid_m, n_old, n_fit, n_old_tiles, n_tiles, S, qk_scale)


@gluon_device
def _consumer1(OUT, so_b, so_s, so_h, q_smem0, q_smem1, k_bufs, v_bufs, k_stage, v_stage, q_ready, k_ready, v_ready,
               k_empty, v_empty, turn, stage_bar, QD, KD, VD, KCD, VCD, KSD, VSD, KRD, VRD, b, kvh, pid_m, start,
               n_old, n_fit, n_old_tiles, n_tiles, S, qk_scale, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(1, OVERLAP, PINGPONG, OUT, so_b, so_s, so_h, q_smem1, k_bufs, v_bufs, q_ready, k_ready, v_ready,
              k_empty, v_empty, turn, b, kvh, pid_m, n_old, n_fit, n_old_tiles, n_tiles, S, qk_scale)


@gluon_device
def _producer(OUT, so_b, so_s, so_h, q_smem0, q_smem1, k_bufs, v_bufs, k_stage, v_stage, q_ready, k_ready, v_ready,
              k_empty, v_empty, turn, stage_bar, QD, KD, VD, KCD, VCD, KSD, VSD, KRD, VRD, b, kvh, pid_m, start,
              n_old, n_fit, n_old_tiles, n_tiles, S, qk_scale, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
    KS: gl.constexpr = k_bufs.shape[0]
    VS: gl.constexpr = v_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    G: gl.constexpr = q_smem0.shape[1]
    T: gl.constexpr = q_smem0.shape[2]
    CHUNK: gl.constexpr = k_stage.shape[2]
    tok0 = pid_m * (2 * T)
    # the two warpgroups' queries: G heads x T tokens each (tokens past S read zeros)
    for wg in gl.static_range(2):
        hopper.mbarrier.expect(q_ready.index(wg), QD.block_type.nbytes)
        hopper.tma.async_copy_global_to_shared(QD, [b, kvh * G, tok0 + wg * T, 0], q_ready.index(wg),
                                               q_smem0 if wg == 0 else q_smem1)
    # K / V tiles: t < n_old_tiles: cached positions n_old - (t + 1) * BLOCK_N ..; then new keys from 0
    for t in range(n_tiles):
        slot = t % KS  # (a fresh barrier's previous phase counts as complete: ^ 1)
        hopper.mbarrier.wait(k_empty.index(slot), ((t // KS) & 1) ^ 1)
        hopper.mbarrier.expect(k_ready.index(slot), KD.block_type.nbytes)
        if t < n_old_tiles:
            hopper.tma.async_copy_global_to_shared(KCD, [b, kvh, n_old - (t + 1) * BLOCK_N, 0], k_ready.index(slot),
                                                   k_bufs.index(slot))
        else:
            hopper.tma.async_copy_global_to_shared(KD, [b, kvh, (t - n_old_tiles) * BLOCK_N, 0], k_ready.index(slot),
                                                   k_bufs.index(slot))
        slot = t % VS
        hopper.mbarrier.wait(v_empty.index(slot), ((t // VS) & 1) ^ 1)
        hopper.mbarrier.expect(v_ready.index(slot), VD.block_type.nbytes)
        if t < n_old_tiles:
            hopper.tma.async_copy_global_to_shared(VCD, [b, kvh, n_old - (t + 1) * BLOCK_N, 0], v_ready.index(slot),
                                                   v_bufs.index(slot))
        else:
            hopper.tma.async_copy_global_to_shared(VD, [b, kvh, (t - n_old_tiles) * BLOCK_N, 0], v_ready.index(slot),
                                                   v_bufs.index(slot))
    # this program's own tokens j in [tok0, tok0 + 2 T) to cache slots start + j, CHUNK rows at a
    # time through the staging buffers, one row per copy (rows j >= S are not written; slots past
    # the cache's end drop out of the copy); no program reads a cache slot >= start
    j_end = gl.minimum(tok0 + 2 * T, S)
    for c in range(tok0, j_end, CHUNK):
        phase = ((c - tok0) // CHUNK) & 1
        hopper.mbarrier.expect(stage_bar, 2 * KSD.block_type.nbytes)
        hopper.tma.async_copy_global_to_shared(KSD, [b, kvh, c, 0], stage_bar, k_stage)
        hopper.tma.async_copy_global_to_shared(VSD, [b, kvh, c, 0], stage_bar, v_stage)
        hopper.mbarrier.wait(stage_bar, phase)
        for r in gl.static_range(CHUNK):
            if c + r < j_end:
                hopper.tma.async_copy_shared_to_global(KRD, [b, kvh, start + c + r, 0], k_stage.slice(r, 1, dim=2))
                hopper.tma.async_copy_shared_to_global(VRD, [b, kvh, start + c + r, 0], v_stage.slice(r, 1, dim=2))
        hopper.tma.store_wait(pendings=0)  # the staging buffers are read before the next chunk's copy


def _prefill_ws_kernel(
    OUT, POS, qk_scale, so_b, so_s, so_h, Hkv, S, Smax,
    QD,  # q [B, H, S, D]: blocks [1, G, T, D] (T = 64 / G tokens of the G heads: one warpgroup's rows)
    KD, VD, KCD, VCD,  # k, v, k_cache, v_cache: blocks [1, 1, BLOCK_N, D]
    KSD, VSD,  # k, v again: blocks [1, 1, CHUNK, D], unswizzled (the cache write's staging)
    KRD, VRD,  # k_cache, v_cache again: blocks [1, 1, 1, D], unswizzled (the cache write, a row a copy)
    K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, OVERLAP: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    G: gl.constexpr = QD.block_type.shape[1]
    T: gl.constexpr = QD.block_type.shape[2]
    BLOCK_N: gl.constexpr = KD.block_type.shape[2]
    n_m = gl.cdiv(S, 2 * T)  # programs per (sequence, kv head): 2 T tokens (128 rows) each
    pid = gl.program_id(0)
    b = pid // (n_m * Hkv)
    pid_m = n_m - 1 - (pid % (n_m * Hkv)) // Hkv
    kvh = pid % Hkv
    start = gl.load(POS + b).to(gl.int32)  # cache_pos[b]: position of token 0
    n_old = gl.minimum(start, Smax)
    n_fit = Smax - start  # new tokens j < n_fit have a cache slot
    hi = gl.maximum(gl.minimum(gl.minimum(pid_m * (2 * T) + 2 * T, S), n_fit), 0)  # new keys [0, hi)
    n_old_tiles = gl.cdiv(n_old, BLOCK_N)
    n_tiles = n_old_tiles + gl.cdiv(hi, BLOCK_N)

    q_smem0 = gl.allocate_shared_memory(QD.dtype, QD.block_type.shape, QD.layout)
    q_smem1 = gl.allocate_shared_memory(QD.dtype, QD.block_type.shape, QD.layout)
    k_bufs = gl.allocate_shared_memory(KD.dtype, [K_STAGES] + KD.block_type.shape, KD.layout)
    v_bufs = gl.allocate_shared_memory(VD.dtype, [V_STAGES] + VD.block_type.shape, VD.layout)
    k_stage = gl.allocate_shared_memory(KSD.dtype, KSD.block_type.shape, KSD.layout)
    v_stage = gl.allocate_shared_memory(VSD.dtype, VSD.block_type.shape, VSD.layout)
    bar: gl.constexpr = hopper.mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], bar)
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar)
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], bar)
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar)
    stage_bar = gl.allocate_shared_memory(gl.int64, [1], bar)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    hopper.mbarrier.init(turn.index(0), count=1)
    hopper.mbarrier.init(turn.index(1), count=1)
    hopper.mbarrier.init(q_ready.index(0), count=1)
    hopper.mbarrier.init(q_ready.index(1), count=1)
    hopper.mbarrier.init(stage_bar, count=1)
    for i in gl.static_range(K_STAGES):
        hopper.mbarrier.init(k_ready.index(i), count=1)
        hopper.mbarrier.init(k_empty.index(i), count=2)  # both consumer warpgroups hand each slot back
    for i in gl.static_range(V_STAGES):
        hopper.mbarrier.init(v_ready.index(i), count=1)
        hopper.mbarrier.init(v_empty.index(i), count=2)

    args = (OUT, so_b, so_s, so_h, q_smem0, q_smem1, k_bufs, v_bufs, k_stage, v_stage, q_ready, k_ready, v_ready,
            k_empty, v_empty, turn, stage_bar, QD, KD, VD, KCD, VCD, KSD, VSD, KRD, VRD, b, kvh, pid_m, start, n_old,
            n_fit, n_old_tiles, n_tiles, S, qk_scale, OVERLAP, PINGPONG)
    gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_producer, args)], [4, 1],
                       [CONSUMER_REGS, PRODUCER_REGS])


def ws_descriptors(q, k, v, k_cache, v_cache, block_n: int):
    """The kernel's Gluon TMA descriptors (see `_prefill_ws_kernel`), or None where TMA cannot
    address one of the tensors (a base not 16-byte aligned, or a stride that is not a multiple
    of 16 bytes)."""
    from triton.experimental.gluon import language as gluon_language
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    ts = (q, k, v, k_cache, v_cache)
    if any(t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]) for t in ts):
        return None
    D = q.shape[-1]
    G = q.shape[1] // k.shape[1]
    dtype = {torch.bfloat16: gluon_language.bfloat16, torch.float16: gluon_language.float16}[q.dtype]

    def desc(t, block, swizzled=True):
        layout = (gluon_language.NVMMASharedLayout.get_default_for(block, dtype) if swizzled else
                  gluon_language.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=len(block)))
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    chunk = min(2 * (64 // G), CHUNK)
    return ([desc(q, [1, G, 64 // G, D])] + [desc(t, [1, 1, block_n, D]) for t in (k, v, k_cache, v_cache)]
            + [desc(t, [1, 1, chunk, D], False) for t in (k, v)] + [desc(t, [1, 1, 1, D], False) for t in (k_cache, v_cache)])


def prefill_ws_supported(q, k, v, k_cache, v_cache, window: int) -> bool:
    """Whether `prefill_ws` can run these tensors (the caller has checked the device is sm_90):
    16-bit and one dtype, head_dim in WS_CONFIGS, G = H / Hkv query heads per kv head in 1, 2, 4,
    8 (a warpgroup's 64 rows are 64 / G tokens of each head, a multiple of 8), no sliding window."""
    dtypes = {t.dtype for t in (q, k, v, k_cache, v_cache)}
    return (not window and len(dtypes) == 1 and dtypes <= {torch.float16, torch.bfloat16}
            and q.shape[-1] in WS_CONFIGS and q.shape[1] % k.shape[1] == 0 and q.shape[1] // k.shape[1] in (1, 2, 4, 8))


def prefill_ws(q, k, v, k_cache, v_cache, cache_pos, scale, out, config=None):
    """The warp-specialized prefill into out [B, S, H, D]; None where TMA cannot address the
    tensors (the caller then runs `_prefill_kernel`)."""
    _bind()
    B, H, S, D = q.shape
    Hkv, Smax = k.shape[1], k_cache.shape[2]
    cfg = {**WS_CONFIGS[D], **(config or {})}
    descs = ws_descriptors(q, k, v, k_cache, v_cache, cfg["BLOCK_N"])
    if descs is None:
        return None
    G = H // Hkv
    grid = (-(-S // (2 * (64 // G))) * B * Hkv,)
    gluon_jit(_prefill_ws_kernel)[grid](
        out, cache_pos, scale * math.log2(math.e), out.stride(0), out.stride(1), out.stride(2), Hkv, S, Smax, *descs,
        K_STAGES=cfg["K_STAGES"], V_STAGES=cfg["V_STAGES"], PRODUCER_REGS=cfg["PRODUCER_REGS"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
        OVERLAP=cfg["OVERLAP"], PINGPONG=cfg["PINGPONG"] and cfg["OVERLAP"], num_warps=4,
    )
    return out
