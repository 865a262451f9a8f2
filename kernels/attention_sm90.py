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
Each program writes its own tokens' k / v into the cache with plain stores (no program reads a
cache slot >= cache_pos), like `_prefill_kernel`.

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

BLOCK_M = 128  # rows per program: two consumer warpgroups of 64 (wgmma's M per warpgroup)
WS_CONFIGS = {  # head_dim -> keys per tile, ring slots, producer registers
    128: dict(BLOCK_N=128, STAGES=2, PRODUCER_REGS=24, CONSUMER_REGS=216, OVERLAP=True),
    64: dict(BLOCK_N=128, STAGES=3, PRODUCER_REGS=24, CONSUMER_REGS=216, OVERLAP=True),
}


def _bind():
    global hopper
    if hopper is None:
        from triton.experimental.gluon.language.nvidia import hopper as h

        hopper = h


@gluon_device
def _store_own_kv(SRC, DST, s_s, d_s, j_lo, j_hi, start, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    # rows j in [j_lo, j_hi) of SRC (row stride s_s) to rows start + j of DST (stride d_s), 32 at a time
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    for j0 in range(j_lo, j_hi, 32):
        j = j0 + gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
        ok = (j < j_hi)[:, None]
        x = gl.load(SRC + j[:, None].to(gl.int64) * s_s + offs_d[None, :], mask=ok, other=0.0)
        gl.store(DST + (start + j)[:, None].to(gl.int64) * d_s + offs_d[None, :], x.to(DST.dtype.element_ty), mask=ok)


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
def _consumer(WG: gl.constexpr, OVERLAP: gl.constexpr, Q, K, V, KC, VC, OUT, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
              b, kvh, pid_m, start, n_old, n_fit, hi, n_old_tiles, n_tiles, S, qk_scale,
              sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
              so_b, so_s, so_h, G):
    # G (query heads per kv head) is a runtime value: constexprs do not cross gl.warp_specialize
    STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [rows, HEAD_DIM] loads, 16 B a thread

    BLOCK_M: gl.constexpr = 128
    ROWS: gl.constexpr = 64
    row0 = pid_m * BLOCK_M + WG * ROWS
    b = b.to(gl.int64)  # (an int32 for the producer's TMA coordinates)
    # this warpgroup's query rows into shared memory (the wgmma's A operand)
    r_io = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io))
    d_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))
    qi_io = r_io // G
    q = gl.load(Q + b * sq_b + (kvh * G + r_io % G)[:, None] * sq_h + qi_io[:, None] * sq_s + d_io[None, :],
                mask=(qi_io < S)[:, None], other=0.0)
    q_smem.store(q)

    # the new tokens this program owns, j * G in its rows, go to cache slots start + j (K by
    # warpgroup 0, V by warpgroup 1); tokens past the cache's end are not written
    j_lo = gl.cdiv(pid_m * BLOCK_M, G)
    j_hi = gl.minimum(gl.minimum(gl.cdiv((pid_m + 1) * BLOCK_M, G), S), n_fit)
    if WG == 0:
        _store_own_kv(K + b * sk_b + kvh * sk_h, KC + b * skc_b + kvh * skc_h, sk_s, skc_s, j_lo, j_hi, start,
                      HEAD_DIM, io)
    else:
        _store_own_kv(V + b * sv_b + kvh * sv_h, VC + b * svc_b + kvh * svc_h, sv_s, svc_s, j_lo, j_hi, start,
                      HEAD_DIM, io)
    hopper.fence_async_shared()

    # rows' tokens and key columns in the scores' layout
    qi = (row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))) // G
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    free = gl.minimum(row0 // G + 1, n_fit)  # new keys < free are visible to every row here
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    qk_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    if OVERLAP:
        # each tile's p @ v and the next tile's QK^T go to the tensor cores back to back, and
        # one wait covers both (nothing is in flight across the loop's back edge: ptxas would
        # serialize every wgmma if a loop-carried accumulator were still being written there)
        hopper.mbarrier.wait(k_ready.index(0), 0)
        qk = hopper.warpgroup_mma(q_smem, k_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), qk_zero,
                                  use_acc=False, is_async=True)
        qk = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
        for t in range(n_tiles - 1):
            slot = t % STAGES
            hopper.mbarrier.arrive(k_empty.index(slot), count=1)
            p16, alpha, m_i, l_i = _softmax_step(qk, t, m_i, l_i, qi, cols, free, n_old, n_old_tiles, n_fit, qk_scale,
                                                 BLOCK_N, Q.dtype.element_ty, p_layout, o_layout)
            hopper.mbarrier.wait(v_ready.index(slot), (t // STAGES) & 1)
            acc = hopper.warpgroup_mma(p16, v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]), acc * alpha[:, None],
                                       is_async=True)
            hopper.mbarrier.wait(k_ready.index((t + 1) % STAGES), ((t + 1) // STAGES) & 1)
            # (its accumulator input, ignored, is tile t's raw scores: registers a wgmma defined)
            qk = hopper.warpgroup_mma(q_smem, k_bufs.index((t + 1) % STAGES).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                                      qk, use_acc=False, is_async=True)
            qk, acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(qk, acc))
            hopper.mbarrier.arrive(v_empty.index(slot), count=1)
        t = n_tiles - 1
        slot = t % STAGES
        hopper.mbarrier.arrive(k_empty.index(slot), count=1)
        p16, alpha, m_i, l_i = _softmax_step(qk, t, m_i, l_i, qi, cols, free, n_old, n_old_tiles, n_fit, qk_scale,
                                             BLOCK_N, Q.dtype.element_ty, p_layout, o_layout)
        hopper.mbarrier.wait(v_ready.index(slot), (t // STAGES) & 1)
        acc = hopper.warpgroup_mma(p16, v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]), acc * alpha[:, None],
                                   is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        hopper.mbarrier.arrive(v_empty.index(slot), count=1)
    else:
        for t in range(n_tiles):
            slot = t % STAGES
            phase = (t // STAGES) & 1
            hopper.mbarrier.wait(k_ready.index(slot), phase)
            qk = hopper.warpgroup_mma(q_smem, k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), qk_zero,
                                      use_acc=False, is_async=True)
            qk = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
            hopper.mbarrier.arrive(k_empty.index(slot), count=1)
            p16, alpha, m_i, l_i = _softmax_step(qk, t, m_i, l_i, qi, cols, free, n_old, n_old_tiles, n_fit, qk_scale,
                                                 BLOCK_N, Q.dtype.element_ty, p_layout, o_layout)
            hopper.mbarrier.wait(v_ready.index(slot), phase)
            acc = hopper.warpgroup_mma(p16, v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]), acc * alpha[:, None],
                                       is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            hopper.mbarrier.arrive(v_empty.index(slot), count=1)

    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    r_o = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    qi_o = r_o // G
    gl.store(OUT + b * so_b + qi_o[:, None] * so_s + (kvh * G + r_o % G)[:, None] * so_h + d_o[None, :],
             out.to(OUT.dtype.element_ty), mask=(qi_o < S)[:, None])


@gluon_device
def _consumer0(Q, K, V, KC, VC, OUT, q_smem0, q_smem1, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
               b, kvh, pid_m, start, n_old, n_fit, hi, n_old_tiles, n_tiles, S, qk_scale,
               sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
               so_b, so_s, so_h, KD, VD, KCD, VCD, G, OVERLAP: gl.constexpr):
    _consumer(0, OVERLAP, Q, K, V, KC, VC, OUT, q_smem0, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
              b, kvh, pid_m, start, n_old, n_fit, hi, n_old_tiles, n_tiles, S, qk_scale,
              sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
              so_b, so_s, so_h, G)


@gluon_device
def _consumer1(Q, K, V, KC, VC, OUT, q_smem0, q_smem1, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
               b, kvh, pid_m, start, n_old, n_fit, hi, n_old_tiles, n_tiles, S, qk_scale,
               sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
               so_b, so_s, so_h, KD, VD, KCD, VCD, G, OVERLAP: gl.constexpr):
    _consumer(1, OVERLAP, Q, K, V, KC, VC, OUT, q_smem1, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
              b, kvh, pid_m, start, n_old, n_fit, hi, n_old_tiles, n_tiles, S, qk_scale,
              sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
              so_b, so_s, so_h, G)


@gluon_device
def _producer(Q, K, V, KC, VC, OUT, q_smem0, q_smem1, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
              b, kvh, pid_m, start, n_old, n_fit, hi, n_old_tiles, n_tiles, S, qk_scale,
              sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
              so_b, so_s, so_h, KD, VD, KCD, VCD, G, OVERLAP: gl.constexpr):
    STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    # tile t < n_old_tiles: cached positions n_old - (t + 1) * BLOCK_N ..; then new keys from 0
    for t in range(n_tiles):
        slot = t % STAGES
        phase = ((t // STAGES) & 1) ^ 1  # a fresh barrier's previous phase counts as complete
        hopper.mbarrier.wait(k_empty.index(slot), phase)
        hopper.mbarrier.expect(k_ready.index(slot), KD.block_type.nbytes)
        if t < n_old_tiles:
            hopper.tma.async_copy_global_to_shared(KCD, [b, kvh, n_old - (t + 1) * BLOCK_N, 0], k_ready.index(slot),
                                                   k_bufs.index(slot))
        else:
            hopper.tma.async_copy_global_to_shared(KD, [b, kvh, (t - n_old_tiles) * BLOCK_N, 0], k_ready.index(slot),
                                                   k_bufs.index(slot))
        hopper.mbarrier.wait(v_empty.index(slot), phase)
        hopper.mbarrier.expect(v_ready.index(slot), VD.block_type.nbytes)
        if t < n_old_tiles:
            hopper.tma.async_copy_global_to_shared(VCD, [b, kvh, n_old - (t + 1) * BLOCK_N, 0], v_ready.index(slot),
                                                   v_bufs.index(slot))
        else:
            hopper.tma.async_copy_global_to_shared(VD, [b, kvh, (t - n_old_tiles) * BLOCK_N, 0], v_ready.index(slot),
                                                   v_bufs.index(slot))


def _prefill_ws_kernel(
    Q, K, V, KC, VC, POS, OUT, qk_scale,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
    skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, so_b, so_s, so_h,
    Hkv, S, Smax,
    KD, VD, KCD, VCD,  # tensor descriptors of k, v, k_cache, v_cache: blocks [1, 1, BLOCK_N, HEAD_DIM]
    G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, OVERLAP: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 128  # two consumer warpgroups of ROWS
    ROWS: gl.constexpr = 64
    n_m = gl.cdiv(S * G, BLOCK_M)
    pid = gl.program_id(0)
    b = pid // (n_m * Hkv)
    pid_m = n_m - 1 - (pid % (n_m * Hkv)) // Hkv
    kvh = pid % Hkv
    start = gl.load(POS + b).to(gl.int32)  # cache_pos[b]: position of token 0
    n_old = gl.minimum(start, Smax)
    n_fit = Smax - start  # new tokens j < n_fit have a cache slot
    hi = gl.maximum(gl.minimum(gl.minimum(((pid_m + 1) * BLOCK_M - 1) // G, S - 1) + 1, n_fit), 0)
    n_old_tiles = gl.cdiv(n_old, BLOCK_N)
    n_tiles = n_old_tiles + gl.cdiv(hi, BLOCK_N)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], Q.dtype.element_ty)
    q_smem0 = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, HEAD_DIM], q_layout)
    q_smem1 = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, HEAD_DIM], q_layout)
    k_bufs = gl.allocate_shared_memory(KD.dtype, [STAGES] + KD.block_type.shape, KD.layout)
    v_bufs = gl.allocate_shared_memory(VD.dtype, [STAGES] + VD.block_type.shape, VD.layout)
    bar: gl.constexpr = hopper.mbarrier.MBarrierLayout()
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    for i in gl.static_range(STAGES):
        hopper.mbarrier.init(k_ready.index(i), count=1)
        hopper.mbarrier.init(v_ready.index(i), count=1)
        hopper.mbarrier.init(k_empty.index(i), count=2)
        hopper.mbarrier.init(v_empty.index(i), count=2)

    args = (Q, K, V, KC, VC, OUT, q_smem0, q_smem1, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
            b, kvh, pid_m, start, n_old, n_fit, hi, n_old_tiles, n_tiles, S, qk_scale,
            sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
            so_b, so_s, so_h, KD, VD, KCD, VCD, G, OVERLAP)
    gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_producer, args)], [4, 1],
                       [CONSUMER_REGS, PRODUCER_REGS])


def ws_descriptors(k, v, k_cache, v_cache, block_n: int):
    """Gluon TMA descriptors of k, v, k_cache, v_cache (blocks [1, 1, block_n, D], NVMMA-swizzled
    as the kernel's shared-memory ring), or None where TMA cannot address one of them."""
    from triton.experimental.gluon import language as gluon_language
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    ts = (k, v, k_cache, v_cache)
    if any(t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]) for t in ts):
        return None
    block = [1, 1, block_n, k.shape[-1]]
    dtype = {torch.bfloat16: gluon_language.bfloat16, torch.float16: gluon_language.float16}[k.dtype]
    layout = gluon_language.NVMMASharedLayout.get_default_for(block, dtype)
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout) for t in ts]


def prefill_ws_supported(q, k, v, k_cache, v_cache, window: int) -> bool:
    """Whether `prefill_ws` can run these tensors (the caller has checked the device is sm_90)."""
    dtypes = {t.dtype for t in (q, k, v, k_cache, v_cache)}
    return (not window and len(dtypes) == 1 and dtypes <= {torch.float16, torch.bfloat16}
            and q.shape[-1] in WS_CONFIGS and q.shape[1] % k.shape[1] == 0)


def prefill_ws(q, k, v, k_cache, v_cache, cache_pos, scale, out, config=None):
    """The warp-specialized prefill (q/k/v last dims contiguous); None where the tensors cannot
    be addressed by TMA (the caller then runs `_prefill_kernel`)."""
    _bind()
    B, H, S, D = q.shape
    Hkv, Smax = k.shape[1], k_cache.shape[2]
    cfg = {**WS_CONFIGS[D], **(config or {})}
    descs = ws_descriptors(k, v, k_cache, v_cache, cfg["BLOCK_N"])
    if descs is None:
        return None
    G = H // Hkv
    grid = (-(-S * G // BLOCK_M) * B * Hkv,)
    gluon_jit(_prefill_ws_kernel)[grid](
        q, k, v, k_cache, v_cache, cache_pos, out, scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        Hkv, S, Smax, *descs,
        G=G, HEAD_DIM=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
        CONSUMER_REGS=cfg["CONSUMER_REGS"], OVERLAP=cfg["OVERLAP"], num_warps=4,
    )
    return out
