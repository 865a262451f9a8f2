"""Triton kernels of `dsc::moe`, the experts of a mixture-of-experts FFN (kernels/moe.py has the
op's contract and its plain-torch reference, the CPU implementation and the test oracle).

A call routes the T * K (token, k) *slots* of topk_ids to this rank's E experts and runs four
launches, all of static shape (no host sync, nothing sized by the routing), so that a CUDA
graph captured once replays with any routing:

    _route_kernel     grid (E,): program e counts the slots routed to local experts below e
                      (its expert's first row in the sorted order, offs[e]), then writes the
                      slot index of each of its own slots, in slot order, to sorted[offs[e] + r]
                      and that row back to slot_row[slot]; slots whose global id is outside
                      [first_expert, first_expert + E) get slot_row -1 and no row (another
                      rank's experts: they contribute nothing). A counting sort, stable, with no
                      atomics: the same routing gives the same order every time.
    _gate_up_kernel   grouped GEMM 1: a tile is BLOCK_M consecutive sorted rows of one expert
                      (an expert's rows split into ceil(count / BLOCK_M) tiles). Each program
                      finds its tile's expert and rows from offs (the experts' tile counts,
                      summed in registers), gathers the tokens' rows of x, and computes gate
                      and up over H with tl.dot in fp32 for BLOCK_N of the I columns, then
                      silu(gate) * up rounded as the reference rounds it (gate and up to x's
                      dtype, silu to x's dtype, the product to x's dtype) into act [T*K, I]
                      at the sorted rows.
    _down_kernel      grouped GEMM 2: the same tiles, act rows times down_e^T over I in fp32 for
                      BLOCK_N of the H columns, into y [SPLIT_K, T*K, H] at the sorted rows:
                      rounded to x's dtype at SPLIT_K 1 (the reference's expert output), fp32
                      partials over SPLIT_K shares of I otherwise (grid axis 1).
    _combine_kernel   out[t] = sum over k of topk_weights[t, k] * y[slot_row[t*K + k]], the
                      split partials summed and rounded to x's dtype first, the k summed in
                      order in fp32, rounded once: no atomics, so results are bit-identical
                      from run to run.

Tiles: the GEMM grids hold the static bound min(T*K, cdiv(T*K, BLOCK_M) + min(E, T*K)) of
tiles (times the column blocks); programs past the routing's real tile count exit at once.
Programs are ordered in groups of GROUP_M tiles, the tiles fastest, so that the programs in
flight share both their experts' weight blocks and their x rows in L2 (prefill).

Decode: with few tokens only experts that received slots have tiles, so a step reads only the
active experts' weights, each once per tile (one tile per expert at BLOCK_M 16 up to 16 slots).
`moe_config` picks BLOCK_M by the token count (16 while an active expert averages at most 16
slots, then 32, 64, and 128 from 256) and, for decode, narrows BLOCK_N or splits the down GEMM's
I until the grid has work for every SM. kernels/tuning.json rows "moe_gate_up" / "moe_down"
(shape class `shape_class`) override the defaults. The token count is dynamic at compile time:
the planner records the configs at the token counts of PLAN_BUCKETS for the static dims (H, I,
E, K), and the wrapper takes the config of its call's bucket (T rounded up to a power of two)
at run time; a captured graph keeps the config of the T it was captured at.

Memory: per call, act [T*K, I] in x's dtype, y [SPLIT_K, T*K, H] (x's dtype, or fp32 when
split) and three int32 vectors of T*K or E + 1 entries, from torch's allocator.

int8 weights (W8A16): gate_up and down int8 with one fp32 scale per row; the kernels load int8
tiles, convert them in registers (the ALU conversion of kernels/int8.py, FAST_CVT, on CUDA),
multiply in x's dtype (exact for integers up to 127) and scale the fp32 accumulator by each
output column's row scale. Activations fp16, bf16 or fp32 (fp32 with IEEE fp32 products).
"""

from __future__ import annotations

import torch

from dsc.kernels.activation import _silu_mul
from dsc.kernels.int8 import I8X4_TO_F32
from dsc.kernels.launch import arch_of, cdiv, device, jit, next_power_of_2, tuned

tl = None  # triton.language, bound by launch.triton_jit on first launch

MAX_BUCKET = 4096  # token buckets (`token_bucket`): powers of two up to this
PLAN_BUCKETS = (1, 8, 16, 64, 256, 1024, 4096)  # the buckets plan.json records
LAUNCHES = 4  # route, gate_up, down, combine
SMS = {"sm_90": 132, "default": 1}  # SMs the default configs fill (H100 SXM / H200; the interpreter: 1)
SMEM = {"sm_90": 180 * 1024}  # bytes of pipelined tiles a config may take (an H200 block may opt into 227 KiB)
SMEM_OTHER = 96 * 1024  # other GPUs (an A100 block may take 163 KiB, consumer parts 99 KiB)


# -- Triton kernels -------------------------------------------------------------------------
def _route_kernel(IDS, SORTED, SLOT_ROW, OFFS, N, first_expert, E, BLOCK: tl.constexpr):
    # program e: offs[e] = #slots of local experts < e; sorted[offs[e] + r] = the r-th slot of
    # expert e (slot order), slot_row[that slot] = offs[e] + r; program 0 also marks the slots of
    # other ranks' experts (slot_row -1); program E - 1 writes offs[E], the routed slots' count
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    below = e * 0  # int32
    for start in range(0, N, BLOCK):
        i = start + offs
        loc = tl.load(IDS + i, mask=i < N, other=-1) - first_expert
        below += tl.sum(((loc >= 0) & (loc < e)).to(tl.int32), axis=0)
    row = below
    for start in range(0, N, BLOCK):
        i = start + offs
        live = i < N
        loc = tl.load(IDS + i, mask=live, other=-1) - first_expert
        hit = (live & (loc == e)).to(tl.int32)
        at = row + tl.cumsum(hit, axis=0) - hit  # this expert's rows, in slot order
        tl.store(SORTED + at, i, mask=hit != 0)
        tl.store(SLOT_ROW + i, at, mask=hit != 0)
        if e == 0:
            tl.store(SLOT_ROW + i, tl.full((BLOCK,), -1, tl.int32), mask=live & ((loc < 0) | (loc >= E)))
        row += tl.sum(hit, axis=0)
    tl.store(OFFS + e, below)
    if e == E - 1:
        tl.store(OFFS + E, row)


@device
def _tile(OFFS, pid, n_tiles, n_blocks, E, E_P: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    # program pid of a grouped GEMM -> (tile, column block, expert, first row, end row); expert
    # >= E: no such tile (the program exits). Programs run in groups of GROUP_M tiles, the tiles
    # fastest; expert e owns tiles [ends[e] - nt[e], ends[e]), nt[e] = ceil(rows of e / BLOCK_M)
    per_group = GROUP_M * n_blocks
    first_tile = (pid // per_group) * GROUP_M
    size = tl.minimum(n_tiles - first_tile, GROUP_M)
    tile = first_tile + (pid % per_group) % size
    block = (pid % per_group) // size
    e = tl.arange(0, E_P)
    lo = tl.load(OFFS + e, mask=e < E, other=0)
    hi = tl.load(OFFS + e + 1, mask=e < E, other=0)
    nt = (hi - lo + BLOCK_M - 1) // BLOCK_M  # 0 past E
    ends = tl.cumsum(nt, axis=0)
    expert = tl.sum((ends <= tile).to(tl.int32), axis=0)  # experts whose tiles all come before: E_P if none
    before = tl.sum(tl.where(e < expert, nt, 0), axis=0)  # tiles of the experts before it
    at = tl.minimum(expert, E - 1)
    row0 = tl.load(OFFS + at) + (tile - before) * BLOCK_M
    return tile, block, expert, row0, tl.load(OFFS + at + 1)


@device
def _int8_to(w, DT: tl.constexpr, CVT: tl.constexpr):
    # an int8 weight tile as dtype DT for tl.dot, exactly: on the ALU where CVT is kernels/int8.py's
    # asm (CUDA), else through fp32
    if CVT != "":
        w = tl.inline_asm_elementwise(CVT, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4)
    return w.to(tl.float32).to(DT)


def _gate_up_kernel(
    X,
    W,
    S,
    SORTED,
    OFFS,
    ACT,
    n_tiles,
    E,
    H,
    I,
    K_TOP,
    stride_x,
    INT8: tl.constexpr,
    CVT: tl.constexpr,
    PRECISION: tl.constexpr,
    E_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVICT: tl.constexpr,
):
    # act[rows] = silu(x[tokens] @ gate_e^T) * (x[tokens] @ up_e^T), BLOCK_N columns of I
    #   x: [T, H], w: [E * 2I, H] (expert e: gate rows e*2I + n, up rows e*2I + I + n), act: [T*K, I]
    n_blocks = (I + BLOCK_N - 1) // BLOCK_N
    tile, block, expert, row0, row_end = _tile(OFFS, tl.program_id(0), n_tiles, n_blocks, E, E_P, BLOCK_M, GROUP_M)
    if expert >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    mask_m = rows < row_end
    token = tl.load(SORTED + rows, mask=mask_m, other=0) // K_TOP
    x_rows = X + token.to(tl.int64)[:, None] * stride_x
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = n < I
    g_row = expert.to(tl.int64) * 2 * I + n  # [BLOCK_N] weight rows of gate; up's are I further
    u_row = g_row + I
    g_rows = W + g_row[None, :] * H
    u_rows = W + u_row[None, :] * H
    cols = tl.arange(0, BLOCK_K)
    dt = X.dtype.element_ty
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + cols
        mask_k = k < H
        a = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        wg = tl.load(g_rows + k[:, None], mask=w_mask, other=0, eviction_policy=EVICT)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(u_rows + k[:, None], mask=w_mask, other=0, eviction_policy=EVICT)
        if INT8:
            wg, wu = _int8_to(wg, dt, CVT), _int8_to(wu, dt, CVT)
        acc_g = tl.dot(a, wg.to(dt), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu.to(dt), acc_u, input_precision=PRECISION)
    if INT8:  # per-row scales of the weight: per output column here
        acc_g *= tl.load(S + g_row, mask=mask_n, other=0.0)[None, :]
        acc_u *= tl.load(S + u_row, mask=mask_n, other=0.0)[None, :]
    y = _silu_mul(acc_g.to(dt).to(tl.float32), acc_u.to(dt).to(tl.float32), dt)
    tl.store(ACT + rows.to(tl.int64)[:, None] * I + n[None, :], y, mask=mask_m[:, None] & mask_n[None, :])


def _down_kernel(
    ACT,
    W,
    S,
    OFFS,
    Y,
    n_tiles,
    E,
    H,
    I,
    NP,
    INT8: tl.constexpr,
    CVT: tl.constexpr,
    PRECISION: tl.constexpr,
    E_P: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVICT: tl.constexpr,
):
    # y[split, rows] = act[rows] @ down_e^T over this split's share of I, BLOCK_N columns of H
    #   act: [NP, I] (NP = T*K rows), w: [E * H, I], y: [SPLIT_K, NP, H]
    n_blocks = (H + BLOCK_N - 1) // BLOCK_N
    tile, block, expert, row0, row_end = _tile(OFFS, tl.program_id(0), n_tiles, n_blocks, E, E_P, BLOCK_M, GROUP_M)
    if expert >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    mask_m = rows < row_end
    a_rows = ACT + rows.to(tl.int64)[:, None] * I
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = n < H
    w_row = expert.to(tl.int64) * H + n
    w_rows = W + w_row[None, :] * I
    cols = tl.arange(0, BLOCK_K)
    k_len = ((I + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # whole K-blocks per split
    k_lo = tl.program_id(1) * k_len
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_len, I), BLOCK_K):
        k = k0 + cols
        mask_k = k < I
        a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0, eviction_policy=EVICT)
        if INT8:
            w = _int8_to(w, ACT.dtype.element_ty, CVT)
        acc = tl.dot(a, w.to(ACT.dtype.element_ty), acc, input_precision=PRECISION)
    if INT8:
        acc *= tl.load(S + w_row, mask=mask_n, other=0.0)[None, :]
    out = Y + (tl.program_id(1).to(tl.int64) * NP + rows)[:, None] * H + n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _combine_kernel(
    Y,
    SLOT_ROW,
    TW,
    OUT,
    T,
    H,
    K_TOP,
    stride_split,
    stride_out,
    SPLIT_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # out[t] = sum_k w[t, k] * round(sum_s y[s, slot_row[t*K + k]]), k in order, fp32, for BLOCK_T
    # tokens and BLOCK_H columns; a slot without a row (another rank's expert) adds nothing
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_t = t < T
    mask_h = cols < H
    slot = t.to(tl.int64) * K_TOP
    dt = OUT.dtype.element_ty
    acc = tl.full((BLOCK_T, BLOCK_H), 0.0, tl.float32)
    for k in range(0, K_TOP):
        row = tl.load(SLOT_ROW + slot + k, mask=mask_t, other=-1)
        live = row >= 0
        w = tl.where(live, tl.load(TW + slot + k, mask=mask_t, other=0.0).to(tl.float32), 0.0)
        at = Y + tl.maximum(row, 0).to(tl.int64)[:, None] * H + cols[None, :]
        mask = live[:, None] & mask_h[None, :]
        y = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLIT_K):
            y += tl.load(at + s * stride_split, mask=mask, other=0.0).to(tl.float32)
        acc += y.to(dt).to(tl.float32) * w[:, None]
    tl.store(
        OUT + t.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(dt), mask=mask_t[:, None] & mask_h[None, :]
    )


# -- configs ----------------------------------------------------------------------------------
def token_bucket(tokens: int) -> int:
    """Shape-class bucket of the token count T: the power of two at or above it, at most MAX_BUCKET."""
    return min(MAX_BUCKET, next_power_of_2(max(int(tokens), 1)))


def shape_class(tokens: int, hidden: int, inter: int, experts: int, top_k: int, int8: bool) -> str:
    """kernels/tuning.json's key of the moe kernels' rows: T<bucket>_H<H>_I<I>_E<E>_K<K>[_int8]."""
    return f"T{token_bucket(tokens)}_H{hidden}_I{inter}_E{experts}_K{top_k}" + ("_int8" if int8 else "")


def _fit_stages(cfg: dict, x_bytes: int, w_bytes: int, w_tiles: int, budget: int) -> dict:
    """cfg with BLOCK_K / num_stages lowered until its pipelined tiles (x [BLOCK_M, BLOCK_K] and
    w_tiles weight tiles [BLOCK_K, BLOCK_N] per stage) fit `budget` bytes, at least 2 stages."""
    cfg = dict(cfg)
    while True:
        stage = cfg["BLOCK_K"] * (cfg["BLOCK_M"] * x_bytes + w_tiles * cfg["BLOCK_N"] * w_bytes)
        stages = min(cfg["num_stages"], budget // stage)
        if stages >= 2 or cfg["BLOCK_K"] <= 16:
            cfg["num_stages"] = max(1, stages)
            return cfg
        cfg["BLOCK_K"] //= 2


def _defaults(tokens: int, hidden: int, inter: int, experts: int, top_k: int, sms: int) -> tuple[dict, dict]:
    slots = tokens * top_k
    active = max(1, min(experts, slots))  # experts with slots, at most
    per_expert = cdiv(slots, active)  # slots of an active expert under balanced routing
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert < 256 else 128
    tiles = active * cdiv(per_expert, bm)
    if bm >= 64:  # prefill: compute-bound tiles; a weight block serves the GROUP_M tiles in flight from L2
        warps = 4 if bm == 64 else 8
        return (
            {
                "BLOCK_M": bm,
                "BLOCK_N": 64,
                "BLOCK_K": 64,
                "GROUP_M": 8,
                "STREAM_W": False,
                "num_warps": warps,
                "num_stages": 4,
            },
            {
                "BLOCK_M": bm,
                "BLOCK_N": 128,
                "BLOCK_K": 64,
                "GROUP_M": 8,
                "SPLIT_K": 1,
                "STREAM_W": False,
                "num_warps": warps,
                "num_stages": 4,
            },
        )
    # decode: the weights are the traffic (streamed past L2: STREAM_W); enough programs to keep
    # every SM's loads in flight
    bn1 = next((bn for bn in (64, 32) if tiles * cdiv(inter, bn) >= 2 * sms), 16)
    bn2 = next((bn for bn in (64, 32) if tiles * cdiv(hidden, bn) >= 2 * sms), 32)
    programs = tiles * cdiv(hidden, bn2)
    split = 1
    if programs < 2 * sms:  # split I, keeping at least 4 K-blocks of 128 per split
        split = max(1, min(8, cdiv(2 * sms, programs), inter // 512))
    return (
        {"BLOCK_M": bm, "BLOCK_N": bn1, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        {
            "BLOCK_M": bm,
            "BLOCK_N": bn2,
            "BLOCK_K": 128,
            "GROUP_M": 8,
            "SPLIT_K": split,
            "num_warps": 4,
            "num_stages": 4,
        },
    )


def moe_config(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, arch: str, x_bytes: int = 2, w_bytes: int = 2
) -> dict:
    """{"gate_up": {...}, "down": {...}, "combine": {...}}: each kernel's constexprs and launch
    options at T = tokens (its bucket, `token_bucket`) for x [T, hidden], top_k experts of
    `experts` per token, inter the experts' intermediate size; w_bytes 1 for int8 weights.
    Built-in defaults (`_defaults`, sized for `SMS[arch]` SMs), under kernels/tuning.json's
    "moe_gate_up" / "moe_down" rows for `shape_class`; BLOCK_K and num_stages are then fitted
    to the arch's shared memory (`SMEM`). "FAST_CVT" (int8 -> fp32 on the ALU) is on for int8 on
    sm_90."""
    g, d = _defaults(token_bucket(tokens), hidden, inter, experts, top_k, SMS.get(arch, 128))
    if w_bytes == 1:
        g, d = ({**c, "FAST_CVT": arch == "sm_90"} for c in (g, d))
    cls = shape_class(tokens, hidden, inter, experts, top_k, w_bytes == 1)
    budget = SMEM.get(arch, SMEM_OTHER)
    g = _fit_stages(tuned("moe_gate_up", cls, arch, g), x_bytes, w_bytes, 2, budget)
    d = _fit_stages(tuned("moe_down", cls, arch, d), x_bytes, w_bytes, 1, budget)
    bh = min(1024, next_power_of_2(hidden))
    bt = min(token_bucket(tokens), max(1, 4096 // bh))  # programs of up to 4096 outputs
    return {"gate_up": g, "down": d, "combine": {"BLOCK_T": bt, "BLOCK_H": bh, "num_warps": 4 if bt * bh >= 512 else 1}}


def experts_padded(experts: int) -> int:
    """E_P, the length of the GEMMs' vector of expert offsets: a power of two >= experts, >= 16."""
    return max(16, next_power_of_2(experts))


def route_config(slots: int) -> dict:
    """The routing kernel's {"BLOCK", "num_warps"}: slots read BLOCK at a time (up to 1024)."""
    block = min(1024, max(32, next_power_of_2(slots)))
    return {"BLOCK": block, "num_warps": 4 if block >= 512 else 1}


def max_tiles(slots: int, block_m: int, experts: int) -> int:
    """Tiles of BLOCK_M rows the routing of `slots` slots to `experts` experts can make, at most:
    an expert's last tile may be partial, and every tile holds a slot."""
    return min(slots, cdiv(slots, block_m) + min(experts, slots))


def _options(cfg: dict, device: torch.device) -> tuple[dict, dict]:
    """(constexprs, launch options) of a GEMM kernel's config: FAST_CVT becomes the CVT asm on
    CUDA ("" elsewhere), STREAM_W (default on) the weight loads' eviction policy evict_first."""
    opts = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    const = {k: v for k, v in cfg.items() if k not in opts and k not in ("FAST_CVT", "STREAM_W")}
    const["CVT"] = I8X4_TO_F32 if cfg.get("FAST_CVT") and device.type == "cuda" else ""
    const["EVICT"] = "evict_first" if cfg.get("STREAM_W", True) else ""
    return const, opts


# -- wrapper ------------------------------------------------------------------------------------
def _check(x, topk_ids, topk_weights, gate_up, down, gate_up_scale, down_scale) -> tuple[int, int, int, int, int]:
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"moe: x [T, H], topk_ids and topk_weights [T, K]; got {list(x.shape)}, "
            f"{list(topk_ids.shape)}, {list(topk_weights.shape)}"
        )
    t, h = x.shape
    k = topk_ids.shape[1]
    if down.dim() != 2 or gate_up.dim() != 2 or gate_up.shape[1] != h or down.shape[1] == 0:
        raise ValueError(f"moe: gate_up [E*2I, {h}] and down [E*{h}, I]; got {list(gate_up.shape)}, {list(down.shape)}")
    inter = down.shape[1]
    e = gate_up.shape[0] // (2 * inter)
    if gate_up.shape[0] != e * 2 * inter or down.shape[0] != e * h:
        raise ValueError(
            f"moe: gate_up {list(gate_up.shape)} and down {list(down.shape)} do not hold the same "
            f"experts of hidden size {h}"
        )
    int8 = gate_up.dtype == torch.int8
    if int8 != (down.dtype == torch.int8) or int8 != (gate_up_scale is not None) or int8 != (down_scale is not None):
        raise ValueError("moe: int8 gate_up and down take a scale each (W8A16); 16/32-bit weights none")
    if int8 and (gate_up_scale.numel() != gate_up.shape[0] or down_scale.numel() != down.shape[0]):
        raise ValueError(
            f"moe: scales [rows]: gate_up_scale {list(gate_up_scale.shape)}, down_scale "
            f"{list(down_scale.shape)} for {gate_up.shape[0]} and {down.shape[0]} rows"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"moe: topk_ids must be integers, got {topk_ids.dtype}")
    return t, h, inter, e, k


def fused_moe_triton(
    x,
    topk_ids,
    topk_weights,
    gate_up,
    down,
    first_expert,
    gate_up_scale=None,
    down_scale=None,
    *,
    config: dict | None = None,
):
    """dsc::moe on the Triton kernels (CUDA, or CPU tensors in the Triton interpreter): [T, H] in
    x's dtype. config: pin `moe_config`'s result (tests, benchmarks)."""
    t, h, inter, e, k = _check(x, topk_ids, topk_weights, gate_up, down, gate_up_scale, down_scale)
    dev = x.device
    out = torch.empty(t, h, dtype=x.dtype, device=dev)
    slots = t * k
    if slots == 0 or h == 0:
        return out.zero_()
    if e == 0:  # no experts on this rank: nothing routed here
        return out.zero_()
    int8 = gate_up_scale is not None
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("moe: gate_up and down must be contiguous")
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous().view(-1)
    tw = topk_weights.contiguous()
    gs = gate_up_scale.reshape(-1).contiguous() if int8 else gate_up
    ds = down_scale.reshape(-1).contiguous() if int8 else down
    cfg = config or moe_config(t, h, inter, e, k, arch_of(dev), x.element_size(), gate_up.element_size())
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    e_p = experts_padded(e)

    sorted_slots = torch.empty(slots, dtype=torch.int32, device=dev)
    slot_row = torch.empty(slots, dtype=torch.int32, device=dev)
    offs = torch.empty(e + 1, dtype=torch.int32, device=dev)
    jit(_route_kernel)[(e,)](ids, sorted_slots, slot_row, offs, slots, int(first_expert), e, **route_config(slots))

    act = torch.empty(slots, inter, dtype=x.dtype, device=dev)
    const, opts = _options(cfg["gate_up"], dev)
    tiles = max_tiles(slots, const["BLOCK_M"], e)
    jit(_gate_up_kernel)[(tiles * cdiv(inter, const["BLOCK_N"]),)](
        x,
        gate_up,
        gs,
        sorted_slots,
        offs,
        act,
        tiles,
        e,
        h,
        inter,
        k,
        x.stride(0),
        INT8=int8,
        PRECISION=precision,
        E_P=e_p,
        **const,
        **opts,
    )

    const, opts = _options(cfg["down"], dev)
    split = const["SPLIT_K"]
    if split < 1:
        raise ValueError(f"moe: SPLIT_K must be >= 1, got {split}")
    y = torch.empty(split, slots, h, dtype=torch.float32 if split > 1 else x.dtype, device=dev)
    tiles = max_tiles(slots, const["BLOCK_M"], e)
    jit(_down_kernel)[(tiles * cdiv(h, const["BLOCK_N"]), split)](
        act, down, ds, offs, y, tiles, e, h, inter, slots, INT8=int8, PRECISION=precision, E_P=e_p, **const, **opts
    )

    comb = cfg["combine"]
    jit(_combine_kernel)[(cdiv(t, comb["BLOCK_T"]), cdiv(h, comb["BLOCK_H"]))](
        y,
        slot_row,
        tw,
        out,
        t,
        h,
        k,
        y.stride(0),
        out.stride(0),
        SPLIT_K=split,
        BLOCK_T=comb["BLOCK_T"],
        BLOCK_H=comb["BLOCK_H"],
        num_warps=comb["num_warps"],
    )
    return out


# -- planner (plan_kernels, via kernels/moe.py) -----------------------------------------------
def plan_moe(x, topk_ids, gate_up, down, int8: bool, *, arch: str) -> dict:
    """The configs at the token counts of PLAN_BUCKETS (T is dynamic at compile time; the wrapper
    takes its call's bucket at run time) for the static dims H, I, E, K; 4 launches per call."""
    h, k, inter = int(x.shape[1]), int(topk_ids.shape[1]), int(down.shape[1])
    e = int(gate_up.shape[0]) // (2 * inter)
    xb, wb = x.dtype.itemsize, gate_up.dtype.itemsize
    cfg = {
        "H": h,
        "I": inter,
        "E": e,
        "K": k,
        "int8": bool(int8),
        **{f"T{b}": moe_config(b, h, inter, e, k, arch, xb, wb) for b in PLAN_BUCKETS},
    }
    return {"name": "triton.fused_moe", "config": cfg, "launches": LAUNCHES}
