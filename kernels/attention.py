"""Attention with a static KV cache: `dsc::attention`, its trace-time twin `dsc::causal_attention`,
and `dsc::rotary_attention` (the rotary embedding of q and k, then `attention`).

Layouts
    q:        [B, H, S, D]     queries of the S new tokens of each sequence
    k, v:     [B, Hkv, S, D]   keys/values of the new tokens (after rotary)
    k_cache:  [Bmax, Hkv, Smax, D]  the layer's cache; rows 0..B-1 belong to this batch
    cache_pos:[B] int64        tokens already in the cache for each sequence
    out:      [B, S, H, D]     (the layout Hugging Face attention functions return)

Token i of sequence b sits at position cache_pos[b] + i; it attends to every cached key at a
position <= its own, and with a sliding window W > 0 (Mistral, Qwen2's sliding layers) only to
the W latest of those: key position j is visible to query position p iff p - W < j <= p (the
rule transformers' masks use). The cache keeps every position; the window only masks.  Sequences in one prefill batch
are right-padded: padded queries
compute garbage that nothing reads, and their cache slots are overwritten by later decode
steps before any valid query can see them.  Keys/values of tokens at positions >= Smax are
not written (they do not fit); such a token attends to the whole cache.

Scores are q.k * scale; two optional arguments after `window` change them (`attend_reference`):
softcap > 0 caps them to softcap * tanh(score / softcap) before the mask (gemma2), and
alibi_slopes [H] (fp32, this rank's query heads) adds slope_h * (key position - query position)
(bloom's ALiBi). The kernels take them as the constexprs SOFTCAP / ALIBI (`_variant_scores`).

`causal_attention` is what tracing records (no cache: the model is traced functionally); the
`bind_kv_cache` pass turns every such node into `attention` with the layer's cache tensors.

On CUDA, `attention` runs Triton kernels that also write the cache (no separate write kernel):
- prefill (S > 1) on Hopper, 16-bit, no window, head_dim 128 (the sm_90 row's `WS`):
  kernels/attention_sm90.py's warp-specialized persistent Gluon kernel (same rows, masks and
  cache write; see there).  Everything else:
- prefill (S > 1), `_prefill_kernel`: flash attention (online softmax over BLOCK_N-key tiles).
  One program owns BLOCK_M rows of one (sequence, kv head); the rows are the G = H / Hkv query
  heads of the group packed together, row r = (token r // G, head r % G), so each K/V tile is
  loaded once for the whole group.  Keys come in two phases: the cached prefix (positions
  < cache_pos, visible to every row, read from the cache) and the new tokens (causal, read from
  k/v directly).  Each program also writes its own tokens' k/v into the cache, from the
  diagonal (masked) tiles it loads anyway (with a sliding window, or when those tiles can be
  more than 2, e.g. G = 1: in a loop of its own, as the fused write is unsafe in a longer
  pipelined loop, see the kernel); no program reads cache slots >= cache_pos, so there is no
  race.  Programs run sequence by sequence, the longest (last) row tiles first; full key tiles
  load unmasked and skip the mask math; the softmax works in base 2 with the scale in one FMA
  and divides by the row sum once, at the end.  Launch-config keys for Hopper change only the
  loops over those full tiles: `TMA` (on in the sm_90 / head_dim 128 row: +7% on an H200) loads
  them through tensor descriptors instead of per-thread loads; `DEFER_PV` (off: slower there)
  issues each tile's p @ v after the next tile's QK^T, so that it runs on the tensor cores
  during that tile's softmax.
- decode (S == 1), `_decode_kernel`: flash-decoding in one launch.  One program
  per (sequence, kv head, split of the cache); the group's query heads are the rows of one tile
  (padded to 16 for tl.dot).  The number of splits comes from shapes only (B, Hkv, Smax, SM
  count), never from cache_pos, so a decode step can be captured in a CUDA graph; each program
  reads its sequence's position on the device and divides that sequence's keys evenly, in
  whole tiles, among as many splits as its key count over SPLIT_FLOOR rounds to (MIN_SPLIT when
  a row has no SPLIT_FLOOR; no sliver of a split whose combine costs more than its keys; splits
  past the end return at once).  The split that holds position cache_pos writes the new k/v
  to the cache and attends to it from registers.  With PDL each program loads the position
  and its split's first PRE_N cached keys and values before it waits for the qkv projection
  (written in earlier steps: see the kernel), so at a short context only q and the new token's
  k/v load after the wait.  With one split, or when all of a sequence's keys fall in its first split
  (a short context: every program can tell before its loop), that split writes `out` itself;
  otherwise each split writes its (output, log-sum-exp) pair and counts itself done on a
  per-(sequence, kv head) counter, and the split that finishes last combines the pairs and
  writes `out` (one launch per decode step; the separate reduce kernel this replaced cost a
  launch per layer, 1.7-2.2 us each at batch 1 on an H200).
- `rotary_attention(q, k, v, cos, sin, k_cache, ...)`, made in the decode program by
  passes/fuse_rotary_attention.py: q, k are dsc.rotary's inputs.  At S == 1 the decode kernel
  with ROTARY rotates the group's query rows right after loading them and the new token's key
  before writing it to the cache, each rounded to its dtype where dsc.rotary stores it (then k
  to the cache's): the rotary kernel's arithmetic (bit-equal to it followed by the plain decode
  kernel, in the interpreter and on an H200: both kernels build without FP contraction,
  rotary.ROTATE_OPTIONS), one launch fewer.  Other S run those two kernels (kernels/rotary.py,
  then prefill).
Launch configurations: PREFILL_CONFIGS / DECODE_CONFIGS below, shared with the plan_kernels
pass through `attention_config` and the registered planner (scripts/bench_kernels.py attention --sweep
measures the candidates on a GPU).  The CPU implementation is the plain-torch reference.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from dsc.kernels.launch import (
    SM_COUNT,
    arch_of,
    cdiv,
    launched,
    next_power_of_2,
    pdl_options,
    planner,
    sm_count,
    split_counters,
    triton_jit,
    tuned,
)
from dsc.kernels.registry import cuda_kernel, declare
from dsc.kernels.rotary import (
    ROTATE_OPTIONS,
    check_rotary,
    check_rotary_tables,
    rotary_config,
    rotary_reference,
    rotary_rows,
    rotary_triton,
    rotate,
)


def attend_reference(q, k, v, visible, scale, softcap=0.0, alibi_slopes=None, q_pos=None, k_pos=None):
    """softmax(scores) @ v over the visible keys: q [B, H, S, D], k/v [B, Hkv, L, D] (query head h
    reads kv head h // (H / Hkv)), visible: bool, broadcastable to [B, H, S, L] -> [B, H, S, D].
    scores = q.k * scale, then softcap * tanh(scores / softcap) where softcap > 0 (gemma2), then
    + alibi_slopes[h] * (k_pos - q_pos) where slopes [H] are given (bloom's ALiBi; q_pos [B, S],
    k_pos [L]). Without either it is SDPA's arithmetic; with one, fp32 scores, output in q's dtype."""
    if not softcap and alibi_slopes is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    G = q.shape[1] // k.shape[1]
    s = q.float() @ k.float().repeat_interleave(G, 1).transpose(-1, -2) * scale  # [B, H, S, L]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        rel = (k_pos[None, None, :] - q_pos[:, :, None]).float()  # [B, S, L]
        s = s + alibi_slopes.float()[None, :, None, None] * rel[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return (p @ v.float().repeat_interleave(G, 1)).to(q.dtype)


def causal_attention_reference(q, k, v, cache_pos, scale, window=0, softcap=0.0, alibi_slopes=None):
    # q: [B, H, S, D]; k, v: [B, Hkv, S, D] -> [B, S, H, D]
    S = q.shape[2]
    if not (window or softcap or alibi_slopes is not None):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    i = torch.arange(S, device=q.device)
    mask = i[None, :] <= i[:, None]  # [S, S]
    if window:
        mask &= i[None, :] > i[:, None] - window
    out = attend_reference(q, k, v, mask, scale, softcap, alibi_slopes, i[None, :], i)
    return out.transpose(1, 2).contiguous()


def write_kv_cache_reference(k, v, k_cache, v_cache, cache_pos):
    """Write the new keys/values of each sequence at positions cache_pos[b] + i (those < Smax)."""
    B, Hkv, S, D = k.shape
    pos = cache_pos[:, None] + torch.arange(S, device=k.device)  # pos: [B, S]
    b, i = (pos < k_cache.shape[2]).nonzero(as_tuple=True)  # the tokens that fit: [N], [N]
    k_cache[b, :, pos[b, i]] = k[b, :, i].to(k_cache.dtype)  # [N, Hkv, D]
    v_cache[b, :, pos[b, i]] = v[b, :, i].to(v_cache.dtype)


def attention_reference(q, k, v, k_cache, v_cache, cache_pos, scale, window=0, softcap=0.0, alibi_slopes=None):
    B, H, S, D = q.shape
    write_kv_cache_reference(k, v, k_cache, v_cache, cache_pos)
    kc, vc = k_cache[:B], v_cache[:B]  # [B, Hkv, Smax, D]
    q_pos = cache_pos[:, None] + torch.arange(S, device=q.device)  # [B, S]
    k_pos = torch.arange(kc.shape[2], device=q.device)  # [Smax]
    mask = k_pos[None, None, None, :] <= q_pos[:, None, :, None]  # [B, 1, S, Smax]
    if window:
        mask &= k_pos[None, None, None, :] > q_pos[:, None, :, None] - window
    out = attend_reference(q, kc.to(q.dtype), vc.to(q.dtype), mask, scale, softcap, alibi_slopes, q_pos, k_pos)
    return out.transpose(1, 2).contiguous()


def rotary_attention_reference(
    q, k, v, cos, sin, k_cache, v_cache, cache_pos, scale, window=0, rot_pos=None, softcap=0.0, alibi_slopes=None
):
    """dsc.rotary of q and k, then attention: the pair `fuse_rotary_attention` makes one op.
    With rot_pos, cos and sin are tables [P, D] and dsc.rotary's cos, sin their rows rot_pos."""
    if rot_pos is not None:
        cos, sin = rotary_rows(cos, sin, rot_pos)
    q, k = rotary_reference(q, k, cos, sin)
    return attention_reference(q, k, v, k_cache, v_cache, cache_pos, scale, window, softcap, alibi_slopes)


# ---------------------------------------------------------------------------------------------
# Launch configurations, by (arch as kernels/launch.py names it, head_dim).  `attention_config`
# takes the row with the smallest head_dim >= the model's, this arch's before "default" (which
# interpreter runs on CPU use); kernels/tuning.json entries ("attention_prefill" /
# "attention_decode", shape class "D<head_dim>") override it.  sm_90 rows (H100/H200): starting
# points from the Triton fused-attention tutorial's Hopper configs, to be refreshed from
# `scripts/bench_kernels.py attention --sweep`; sm_80 rows: untested guesses.
#   prefill: BLOCK_M packed (token, head) rows x BLOCK_N keys per tile.
#   decode:  BLOCK_N keys per tile; enough splits per (sequence, kv head) for about
#            PROGRAMS_PER_SM programs per SM and max_seq / MIN_SPLIT (the grid), and each
#            sequence's keys shared among as many of them as its key count over SPLIT_FLOOR
#            (default MIN_SPLIT) rounds to (`_split_len`: 129-191 keys at a floor of 128 take
#            one split, not 128 keys and a sliver).  A short context thus spreads over a few
#            programs instead of one walking it all, while a long one keeps MIN_SPLIT-key splits.
# Why each sm_90 row and variant is what it is, with the H200 timings behind it:
# docs/performance.md, "Attention launch configurations".
PREFILL_CONFIGS = {
    ("sm_90", 64): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    # TMA: K/V tiles of the full key loops through tensor descriptors (faster than plain loads).
    # WS: 16-bit prefills without a window run the warp-specialized Gluon kernel
    # (kernels/attention_sm90.py, its own tile), faster than the Triton kernel at this row; the
    # other keys are the Triton kernel's, which runs the rest.
    ("sm_90", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=True, WS=True),
    ("sm_90", 256): dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    ("sm_80", 64): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    ("sm_80", 128): dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2),
    ("default", 16): dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    ("default", 128): dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    ("default", 256): dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
}
# PRE_N (decode): keys of each split's first tile loaded before the PDL wait, so that at a short
# context (a split's keys: 128-191 at SPLIT_FLOOR 128) the cache reads overlap the qkv projection
# (`_decode_kernel`). sm_90 / 128: 128 at 8 warps (at 4 the build spills; 64 keys gain nothing).
DECODE_CONFIGS = {
    ("sm_90", 128): dict(
        BLOCK_N=64, num_warps=8, num_stages=3, PROGRAMS_PER_SM=2, MIN_SPLIT=256, SPLIT_FLOOR=128, PRE_N=128
    ),
    ("sm_90", 256): dict(BLOCK_N=32, num_warps=4, num_stages=2, PROGRAMS_PER_SM=2, MIN_SPLIT=256),
    ("default", 128): dict(BLOCK_N=64, num_warps=4, num_stages=2, PROGRAMS_PER_SM=2, MIN_SPLIT=256),
    ("default", 256): dict(BLOCK_N=32, num_warps=4, num_stages=2, PROGRAMS_PER_SM=2, MIN_SPLIT=256),
}
# The prefill variant (`TMA`, `DEFER_PV`: see `_attend_full_tiles`) is on in a row above only
# where a GPU run found it correct and faster (TMA at sm_90 / 128; DEFER_PV is slower on the H200
# at every candidate); these are its candidate rows.
# scripts/bench_kernels.py attention --sweep times them next to the default, tests/gpu/test_gpu_attention.py
# checks each one, tests/test_attention_kernels.py builds them for sm_90 (no register spills, no
# serialized wgmma).  To switch one on: make it the PREFILL_CONFIGS row, or put its keys in
# kernels/tuning.json "sm_90" / "attention_prefill" / "D128".
# DEFER_PV without TMA is legal but ptxas serializes that build's wgmmas (no candidate has it).
PREFILL_VARIANTS = {
    ("sm_90", 128): [  # the Triton kernel at the table's row (first: the bench's table times it
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=True),  # next to the row), then
        # TMA at other tilings
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4, TMA=True),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, TMA=True),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, TMA=True),  # 2 programs per SM
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, TMA=True),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, TMA=True, DEFER_PV=True),
        # the warp-specialized kernel at 64-key tiles (4 slots each)
        dict(
            BLOCK_M=128,
            BLOCK_N=64,
            num_warps=8,
            num_stages=3,
            TMA=True,
            WS=True,
            WS_BLOCK_N=64,
            WS_K_STAGES=4,
            WS_V_STAGES=4,
        ),
    ],  # (TMA at 128 x 128 / 8 warps / 2 stages builds without spills but is slower than the row)
    ("sm_90", 64): [
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=True, DEFER_PV=True),  # 4 warps spill
        # the warp-specialized kernel: slower than the row at head_dim 64
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=True, WS=True),
    ],
}
MAX_SPLITS = 64  # splits per (sequence, kv head): bounds the partials the last split combines


SMEM_BUDGET = 160 * 1024  # bytes of q and pipelined k/v tiles a table row may stage (H100/H200: 227 KiB per
#                          block; the rest for triton's own buffers)


def staged_bytes(kind: str, cfg: dict, head_dim: int, itemsize: int) -> int:
    """Shared memory a config's tiles take: q [BLOCK_M (decode: <= 16 query heads), D] and
    num_stages buffers of a k and a v tile [BLOCK_N, D] (what triton's pipeliner allocates)."""
    d = next_power_of_2(head_dim)
    rows = cfg["BLOCK_M"] if kind == "prefill" else 16
    return (rows + 2 * cfg["num_stages"] * cfg["BLOCK_N"]) * d * itemsize


def attention_config(kind: str, head_dim: int, arch: str, itemsize: int = 2) -> dict:
    """Launch config of the `kind` ("prefill" | "decode") kernel at this head_dim on `arch` for
    q/k/v elements of `itemsize` bytes. The rows are measured for 16-bit tensors; fp32 tiles
    take twice the shared memory (sm_90's head_dim-128 prefill row would need 256 KiB), so a
    row over SMEM_BUDGET loses pipeline stages (down to 2), then rows (BLOCK_M to 64), then
    keys per tile, then the last stage, until it fits."""
    table = PREFILL_CONFIGS if kind == "prefill" else DECODE_CONFIGS
    keys = [key for key in table if key[0] in (arch, "default")]
    fits = [key for key in keys if key[1] >= head_dim] or [max(keys, key=lambda key: key[1])]
    row = table[min(fits, key=lambda key: (key[1], key[0] == "default"))]
    cfg = tuned(f"attention_{kind}", f"D{next_power_of_2(head_dim)}", arch, dict(row))
    while staged_bytes(kind, cfg, head_dim, itemsize) > SMEM_BUDGET:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif kind == "prefill" and cfg["BLOCK_M"] > 64:
            cfg["BLOCK_M"] //= 2
        elif cfg["BLOCK_N"] > 32:
            cfg["BLOCK_N"] //= 2
        elif cfg["num_stages"] > 1:
            cfg["num_stages"] -= 1
        else:
            break
    return cfg


def decode_preload(cfg: dict) -> dict:
    """The decode kernel's PRE_N (keys of each split's first tile loaded before the PDL wait; 0:
    none) and num_warps, from its config."""
    return {"PRE_N": cfg.get("PRE_N", 0), "num_warps": cfg["num_warps"]}


def decode_num_splits(batch: int, kv_heads: int, max_seq: int, cfg: dict, n_sm: int) -> int:
    """Splits per (sequence, kv head) of a decode step: from shapes only (CUDA-graph safe)."""
    want = cdiv(cfg["PROGRAMS_PER_SM"] * n_sm, batch * kv_heads)
    return max(1, min(want, MAX_SPLITS, cdiv(max_seq, cfg["MIN_SPLIT"])))


# ---------------------------------------------------------------------------------------------
# Triton kernels.  Triton is imported on first use (`_triton()`), so CPU-only machines never
# need it: the functions below are plain Python until `_triton()` applies `triton.jit` to them
# in this module's namespace (where kernels find each other and `tl`).
_JIT_FUNCTIONS: list[str] = []
tl = None  # triton.language, bound by _triton()


def _jit_on_first_use(fn):
    _JIT_FUNCTIONS.append(fn.__name__)
    return fn


@functools.cache
def _triton():
    import triton
    import triton.language as tl

    module = globals()
    module["tl"] = tl
    for name in _JIT_FUNCTIONS:
        module[name] = triton.jit(module[name])
    module["rotate"] = triton_jit(rotate)  # kernels/rotary.py's device function (triton_jit binds its `tl`)
    return triton


@_jit_on_first_use
def _load_rows(ptrs, row_ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr = True):
    # ptrs: [R, BLOCK_D] -> [R, BLOCK_D]; rows with row_ok false (if MASKED) and padded columns read 0
    if BLOCK_D == HEAD_DIM:
        if MASKED:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            return tl.load(ptrs)
    else:
        if MASKED:
            return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            return tl.load(ptrs, mask=(offs_d[None, :] < HEAD_DIM), other=0.0)


@_jit_on_first_use
def _store_rows(ptrs, x, row_ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, x, mask=row_ok[:, None])
    else:
        tl.store(ptrs, x, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@_jit_on_first_use
def _combine_splits(part_o, part_lse, sp_s, n_written, head_ok, d_ok, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The decode kernels' last split: the n_written splits' partial outputs [BLOCK_H, BLOCK_D]
    (at part_o + s * sp_s) merged by their base-2 log-sum-exps (part_lse + s) -> the output, fp32."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    o = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    o_ok = head_ok[:, None] & d_ok[None, :]
    for s in range(0, n_written):  # online log-sum-exp over the splits' partials
        lse_s = tl.load(part_lse + s, mask=head_ok, other=0.0, cache_modifier=".cg")
        o_s = tl.load(part_o + s * sp_s, mask=o_ok, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse_s)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse_s - m_new)
        o = o * alpha[:, None] + w[:, None] * o_s
        l = l * alpha + w
        m = m_new
    return o / l[:, None]


@_jit_on_first_use
def _rotated(x, x_half, cos, sin):
    """dsc.rotary of x (any shape; fp32 cos / sin broadcast to it) in x's dtype, rotary.py's
    arithmetic (`rotate`): x_half[d] = x[(d + D/2) mod D], sin negated below D/2 (rotate_half's
    sign).  A second load of x at the shifted columns (cache hits) instead of register shuffles."""
    return rotate(x.to(tl.float32), cos, x_half.to(tl.float32), sin, x.dtype).to(x.dtype)


@_jit_on_first_use
def _tanh(x):
    # tanh from one exp2 (no libdevice: the interpreter runs it too): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@_jit_on_first_use
def _variant_scores(qk, qk_scale, cap, slope, q_idx, k_idx, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Base-2 scores of raw q.k products qk [M, N] under the variant: SOFTCAP: cap * tanh(qk *
    qk_scale), where the wrapper passes qk_scale = scale / softcap and cap = softcap * log2(e)
    (the tanh takes the natural-scale score / softcap); else qk * qk_scale (scale * log2(e)).
    ALIBI: + slope [M] (slope * log2(e)) * (k_idx [N] - q_idx [M]), positions of one numbering."""
    if SOFTCAP:
        s = _tanh(qk * qk_scale) * cap
    else:
        s = qk * qk_scale
    if ALIBI:
        s += slope[:, None] * (k_idx[None, :] - q_idx[:, None]).to(tl.float32)
    return s


@_jit_on_first_use
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    visible,
    qk_scale,
    MASKED: tl.constexpr,
    cap=None,
    slope=None,
    q_idx=None,
    k_idx=None,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    """One online-softmax step. q: [M, D]; k, v: [N, D]; visible: [M, N] (used if MASKED);
    acc: [M, D] fp32 (unnormalized output); m_i, l_i: [M] running max / sum, base 2.
    qk_scale (> 0) is log2(e) / sqrt(d): one FMA per score on unmasked tiles. fp32 inputs
    multiply in full fp32 ("ieee"), not Triton's default TF32: an fp32 model computes in fp32.
    SOFTCAP / ALIBI: the scores of `_variant_scores` (cap, slope, q_idx, k_idx as there)."""
    if q.dtype == tl.float32:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, N]
    else:
        qk = tl.dot(q, tl.trans(k))  # [M, N]
    if SOFTCAP or ALIBI:
        qk = _variant_scores(qk, qk_scale, cap, slope, q_idx, k_idx, SOFTCAP, ALIBI)
        if MASKED:
            qk = tl.where(visible, qk, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
    elif MASKED:
        qk = tl.where(visible, qk * qk_scale, -1.0e30)  # finite: a row with nothing visible yet stays NaN-free
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if v.dtype == tl.float32:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # accumulates in place (wgmma's accumulator)
    return acc, m_new, l_i


@_jit_on_first_use
def _attend_cached(
    acc,
    m_i,
    l_i,
    q,
    k_cache,
    v_cache,
    skc_s,
    svc_s,
    offs_j,
    ok,
    offs_d,
    visible,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    cap=None,
    slope=None,
    q_idx=None,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    """Attend to cache slots offs_j (if MASKED, rows with ok false read 0; else all are read).
    The variant's q_idx: the rows' positions (cache slots are positions)."""
    k = _load_rows(k_cache + offs_j[:, None] * skc_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    v = _load_rows(v_cache + offs_j[:, None] * svc_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D, MASKED)
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


@_jit_on_first_use
def _attend_new(
    acc,
    m_i,
    l_i,
    q,
    k_new,
    v_new,
    sk_s,
    sv_s,
    offs_j,
    ok,
    offs_d,
    visible,
    qk_scale,
    cache_ty,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    cap=None,
    slope=None,
    q_idx=None,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    """Attend to new tokens offs_j, rounded through the cache dtype as if read back from it.
    The variant's q_idx: the rows' token indices among the new tokens (offs_j's numbering)."""
    k = _load_rows(k_new + offs_j[:, None] * sk_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    v = _load_rows(v_new + offs_j[:, None] * sv_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    return _attend_tile(
        acc,
        m_i,
        l_i,
        q,
        k.to(cache_ty).to(q.dtype),
        v.to(cache_ty).to(q.dtype),
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


@_jit_on_first_use
def _attend_new_and_write(
    acc,
    m_i,
    l_i,
    q,
    k_new,
    v_new,
    sk_s,
    sv_s,
    k_cache,
    v_cache,
    skc_s,
    svc_s,
    start,
    offs_j,
    ok,
    own,
    offs_d,
    visible,
    qk_scale,
    cache_ty,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    cap=None,
    slope=None,
    q_idx=None,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    """`_attend_new` on a masked tile that also writes the tokens this program owns (own: [N])
    to their cache slots start + offs_j: the cache write costs no second read of k/v."""
    k = _load_rows(k_new + offs_j[:, None] * sk_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D).to(cache_ty)
    v = _load_rows(v_new + offs_j[:, None] * sv_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D).to(cache_ty)
    slots = (start + offs_j)[:, None]
    _store_rows(k_cache + slots * skc_s + offs_d[None, :], k, own, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(v_cache + slots * svc_s + offs_d[None, :], v, own, offs_d, HEAD_DIM, BLOCK_D)
    return _attend_tile(
        acc,
        m_i,
        l_i,
        q,
        k.to(q.dtype),
        v.to(q.dtype),
        visible,
        qk_scale,
        True,
        cap,
        slope,
        q_idx,
        offs_j,
        SOFTCAP,
        ALIBI,
    )


@_jit_on_first_use
def _full_tile(
    ptrs,
    desc,
    b,
    kvh,
    j0,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    # keys (or values) j0 .. j0 + BLOCK_N - 1 of sequence b, kv head kvh, all in range -> [BLOCK_N, BLOCK_D].
    # TMA: one bulk copy through the [B, Hkv, S, D] descriptor (columns >= HEAD_DIM read 0; no
    # per-thread addresses, so fewer registers and issue slots); else ptrs: [BLOCK_N, BLOCK_D]
    if TMA:
        return desc.load([b.to(tl.int32), kvh, j0, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        return _load_rows(ptrs, None, offs_d, HEAD_DIM, BLOCK_D, False)


@_jit_on_first_use
def _softmax_unmasked(qk, m_i, l_i, qk_scale):
    """`_attend_tile`'s softmax on an unmasked tile, split from its p @ v: (p, m, l, alpha); the
    caller rescales acc by alpha as the p @ v's accumulator input (in the dot's layout)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + tl.sum(p, 1), alpha


@_jit_on_first_use
def _attend_full_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_rows,
    v_rows,
    sk,
    sv,
    k_desc,
    v_desc,
    b,
    kvh,
    lo,
    hi,
    offs_n,
    offs_d,
    qk_scale,
    via_ty,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    DEFER_PV: tl.constexpr,
):
    """Attend to the keys [lo, hi) of one (sequence, kv head), whole tiles (hi - lo a multiple of
    BLOCK_N) that every row sees: no masks.  k_rows / v_rows: row 0 (row j at + j * sk / sv), or
    k_desc / v_desc with TMA; k/v are rounded through via_ty (the cache dtype) like `_attend_new`.
    DEFER_PV: the p @ v of tile t is issued after the QK^T of tile t + 1 has completed, so the
    tensor cores run it while this warpgroup computes tile t + 1's softmax (exp2 and the row
    max / sum).  In the plain loop the p @ v only overlaps the next tile's loads, and every
    softmax runs with this warpgroup's tensor-core work finished.  Triton keeps that wgmma in
    flight because its result is only carried to the next iteration and read there after the
    QK^T's wait; p and alpha are carried in fp32 so that no register an in-flight wgmma reads
    or writes is copied at the loop's back edge (ptxas serializes every wgmma if one is: the
    reason QK^T of tile t + 1 is not the dot issued ahead instead)."""
    if DEFER_PV:
        if lo < hi:
            k = _full_tile(
                k_rows + (lo + offs_n)[:, None] * sk + offs_d[None, :],
                k_desc,
                b,
                kvh,
                lo,
                offs_d,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                TMA,
            )
            qk = tl.dot(q, tl.trans(k.to(via_ty).to(q.dtype)))  # [M, N]: scores of tile lo
            p, m_i, l_i, alpha = _softmax_unmasked(qk, m_i, l_i, qk_scale)
            for j0 in range(lo + BLOCK_N, hi, BLOCK_N):
                # here p, alpha: probabilities and rescale of tile j0 - BLOCK_N, not yet in acc
                k = _full_tile(
                    k_rows + (j0 + offs_n)[:, None] * sk + offs_d[None, :],
                    k_desc,
                    b,
                    kvh,
                    j0,
                    offs_d,
                    HEAD_DIM,
                    BLOCK_D,
                    BLOCK_N,
                    TMA,
                )
                qk = tl.dot(q, tl.trans(k.to(via_ty).to(q.dtype)))
                jv = j0 - BLOCK_N
                v = _full_tile(
                    v_rows + (jv + offs_n)[:, None] * sv + offs_d[None, :],
                    v_desc,
                    b,
                    kvh,
                    jv,
                    offs_d,
                    HEAD_DIM,
                    BLOCK_D,
                    BLOCK_N,
                    TMA,
                )
                acc = tl.dot(p.to(q.dtype), v.to(via_ty).to(q.dtype), acc * alpha[:, None])  # in flight during:
                p, m_i, l_i, alpha = _softmax_unmasked(qk, m_i, l_i, qk_scale)
            last = hi - BLOCK_N
            v = _full_tile(
                v_rows + (last + offs_n)[:, None] * sv + offs_d[None, :],
                v_desc,
                b,
                kvh,
                last,
                offs_d,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                TMA,
            )
            acc = tl.dot(p.to(q.dtype), v.to(via_ty).to(q.dtype), acc * alpha[:, None])
    else:
        for j0 in range(lo, hi, BLOCK_N):
            offs_j = j0 + offs_n
            k = _full_tile(
                k_rows + offs_j[:, None] * sk + offs_d[None, :],
                k_desc,
                b,
                kvh,
                j0,
                offs_d,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                TMA,
            )
            v = _full_tile(
                v_rows + offs_j[:, None] * sv + offs_d[None, :],
                v_desc,
                b,
                kvh,
                j0,
                offs_d,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                TMA,
            )
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k.to(via_ty).to(q.dtype), v.to(via_ty).to(q.dtype), None, qk_scale, False
            )
    return acc, m_i, l_i


@_jit_on_first_use
def _prefill_kernel(
    Q,
    K,
    V,
    KC,
    VC,
    POS,
    OUT,
    qk_scale,
    sq_b,
    sq_h,
    sq_s,  # q [B, H, S, D]; the last stride of every tensor is 1
    sk_b,
    sk_h,
    sk_s,  # k [B, Hkv, S, D]
    sv_b,
    sv_h,
    sv_s,
    skc_b,
    skc_h,
    skc_s,  # k_cache [Bmax, Hkv, Smax, D]
    svc_b,
    svc_h,
    svc_s,
    so_b,
    so_s,
    so_h,  # out [B, S, H, D]
    Hkv,
    S,
    Smax,
    window,
    KD,
    VD,
    KCD,
    VCD,  # TMA: descriptors of k, v, k_cache, v_cache (blocks [1, 1, BLOCK_N, BLOCK_D]); else None
    SLOPES,
    cap,  # ALIBI: slopes [H] fp32; SOFTCAP: softcap * log2(e) (qk_scale is then scale / softcap)
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    TMA: tl.constexpr = False,
    DEFER_PV: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    # one program per (sequence b, row tile pid_m, kv head kvh), launched sequence by sequence,
    # and within a sequence the longest (causal: last) row tiles first, every kv head's at once:
    # the short tiles fill the tail of the schedule, and the programs running together share
    # one sequence's k/v in L2
    n_m = tl.cdiv(S * G, BLOCK_M)
    pid = tl.program_id(0)
    b = (pid // (n_m * Hkv)).to(tl.int64)
    pid_m = n_m - 1 - (pid % (n_m * Hkv)) // Hkv
    kvh = pid % Hkv
    start = tl.load(POS + b).to(tl.int32)  # cache_pos[b]: position of token 0
    offs_d = tl.arange(0, BLOCK_D)

    # rows of this tile: (token qi, query head qh) packed, G heads of kv head kvh per token
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    qh = kvh * G + rows % G
    row_ok = qi < S
    q = _load_rows(
        Q + b * sq_b + qh[:, None] * sq_h + qi[:, None] * sq_s + offs_d[None, :], row_ok, offs_d, HEAD_DIM, BLOCK_D
    )  # [BLOCK_M, BLOCK_D]
    k_new = K + b * sk_b + kvh * sk_h
    v_new = V + b * sv_b + kvh * sv_h
    k_cache = KC + b * skc_b + kvh * skc_h
    v_cache = VC + b * svc_b + kvh * svc_h
    cache_ty = KC.dtype.element_ty
    if ALIBI:  # each row's head's slope, in base 2 (`_variant_scores`)
        slope = tl.load(SLOPES + qh) * 1.4426950408889634  # [BLOCK_M]
        q_pos = start + qi  # the rows' positions: the variant's query index for cached keys (new keys: qi)
    else:
        slope, q_pos = 0.0, 0
    n_fit = Smax - start  # new tokens j < n_fit have a cache slot
    i_min = (pid_m * BLOCK_M) // G
    i_max = tl.minimum(((pid_m + 1) * BLOCK_M - 1) // G, S - 1)
    hi = tl.minimum(i_max + 1, n_fit)  # no row of this tile sees a new key >= hi
    # the new tokens this tile owns, j with j * G in its rows, are [j_lo, hi) (none when a
    # token's G rows straddle tiles and j_lo > i_max): they go to cache slots start + j; no
    # program reads cache slots >= cache_pos, so there is no race
    j_lo = tl.cdiv(pid_m * BLOCK_M, G)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    n_old = tl.minimum(start, Smax)
    # The cache write goes into phase 2's masked loop below when that loop is at most 2 tiles
    # long (cdiv(BLOCK_M, G) <= BLOCK_N: Llama's G = 4 and G = 2 at the table's configs), and
    # into a loop of its own otherwise (sliding windows; G = 1, e.g. GPT-2). A loaded K/V tile
    # with a second (store) use gets one shared-memory buffer too few from Triton's pipeliner
    # (sm_90: 2 buffers for 2 tiles in flight at num_stages=3), so the copy of tile i + 2 would
    # overwrite V of tile i while the async p @ v wgmma still reads it once such a loop runs
    # past 2 tiles, as the windowed loop (window / BLOCK_N tiles) does
    if WINDOWED or (BLOCK_M + G - 1) // G > BLOCK_N:
        for j0 in range(j_lo, hi, BLOCK_N):
            offs_j = j0 + offs_n
            ok = offs_j < hi
            slots = (start + offs_j)[:, None]
            kt = _load_rows(k_new + offs_j[:, None] * sk_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D)
            _store_rows(k_cache + slots * skc_s + offs_d[None, :], kt.to(cache_ty), ok, offs_d, HEAD_DIM, BLOCK_D)
            vt = _load_rows(v_new + offs_j[:, None] * sv_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D)
            _store_rows(v_cache + slots * svc_s + offs_d[None, :], vt.to(cache_ty), ok, offs_d, HEAD_DIM, BLOCK_D)
    if WINDOWED:
        # row qi (position start + qi) sees positions (start + qi - window, start + qi]: every
        # tile is masked, and tiles below the first row's window are skipped
        lo_pos = tl.maximum(start + i_min - window + 1, 0)
        lo_old = (tl.minimum(lo_pos, n_old) // BLOCK_N) * BLOCK_N
        for j0 in range(lo_old, n_old, BLOCK_N):
            offs_j = j0 + offs_n
            ok = (offs_j < n_old) & (offs_j >= lo_pos)  # no row reads below lo_pos: not loaded
            visible = ok[None, :] & (offs_j[None, :] > (start + qi - window)[:, None])
            acc, m_i, l_i = _attend_cached(
                acc,
                m_i,
                l_i,
                q,
                k_cache,
                v_cache,
                skc_s,
                svc_s,
                offs_j,
                ok,
                offs_d,
                visible,
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                True,
                cap,
                slope,
                q_pos,
                SOFTCAP,
                ALIBI,
            )
        lo_new = (tl.minimum(tl.maximum(lo_pos - start, 0), hi) // BLOCK_N) * BLOCK_N
        for j0 in range(lo_new, hi, BLOCK_N):
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
                sk_s,
                sv_s,
                offs_j,
                ok,
                offs_d,
                visible,
                qk_scale,
                cache_ty,
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
        # phase 1: the cached prefix, positions [0, n_old), visible to every row; full tiles
        # unmasked, then the partial last tile, if any
        n_old_full = (n_old // BLOCK_N) * BLOCK_N
        if TMA or DEFER_PV:  # see `_attend_full_tiles` (never with the variant: the wrapper turns them
            # off); the loop below is the pointer-load path
            acc, m_i, l_i = _attend_full_tiles(
                acc,
                m_i,
                l_i,
                q,
                k_cache,
                v_cache,
                skc_s,
                svc_s,
                KCD,
                VCD,
                b,
                kvh,
                0,
                n_old_full,
                offs_n,
                offs_d,
                qk_scale,
                cache_ty,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                TMA,
                DEFER_PV,
            )
        else:
            for j0 in range(0, n_old_full, BLOCK_N):
                offs_j = j0 + offs_n
                acc, m_i, l_i = _attend_cached(
                    acc,
                    m_i,
                    l_i,
                    q,
                    k_cache,
                    v_cache,
                    skc_s,
                    svc_s,
                    offs_j,
                    None,
                    offs_d,
                    None,
                    qk_scale,
                    HEAD_DIM,
                    BLOCK_D,
                    False,
                    cap,
                    slope,
                    q_pos,
                    SOFTCAP,
                    ALIBI,
                )
        for j0 in range(n_old_full, n_old, BLOCK_N):
            offs_j = j0 + offs_n
            ok = offs_j < n_old
            acc, m_i, l_i = _attend_cached(
                acc,
                m_i,
                l_i,
                q,
                k_cache,
                v_cache,
                skc_s,
                svc_s,
                offs_j,
                ok,
                offs_d,
                ok[None, :],
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                True,
                cap,
                slope,
                q_pos,
                SOFTCAP,
                ALIBI,
            )

        # phase 2: the new tokens, causal (j <= qi) and only those with a cache slot (j < n_fit);
        # keys < free are visible to every row (free <= j_lo <= i_min + 1): unmasked tiles.  The
        # masked tiles from free on write the owned tokens [j_lo, hi) to the cache as they load
        # them (free must not pass j_lo: with G > BLOCK_M a token's rows straddle row tiles,
        # j_lo = i_min, and i_min + 1 may be a multiple of BLOCK_N).  They span at most
        # cdiv(BLOCK_M, G) + BLOCK_N - 1 keys: 2 tiles when cdiv(BLOCK_M, G) <= BLOCK_N, else
        # the write took its own loop above
        free = (tl.minimum(j_lo, hi) // BLOCK_N) * BLOCK_N
        if TMA or DEFER_PV:
            acc, m_i, l_i = _attend_full_tiles(
                acc,
                m_i,
                l_i,
                q,
                k_new,
                v_new,
                sk_s,
                sv_s,
                KD,
                VD,
                b,
                kvh,
                0,
                free,
                offs_n,
                offs_d,
                qk_scale,
                cache_ty,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                TMA,
                DEFER_PV,
            )
        else:
            for j0 in range(0, free, BLOCK_N):
                offs_j = j0 + offs_n
                acc, m_i, l_i = _attend_new(
                    acc,
                    m_i,
                    l_i,
                    q,
                    k_new,
                    v_new,
                    sk_s,
                    sv_s,
                    offs_j,
                    None,
                    offs_d,
                    None,
                    qk_scale,
                    cache_ty,
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
            if (BLOCK_M + G - 1) // G > BLOCK_N:
                acc, m_i, l_i = _attend_new(
                    acc,
                    m_i,
                    l_i,
                    q,
                    k_new,
                    v_new,
                    sk_s,
                    sv_s,
                    offs_j,
                    ok,
                    offs_d,
                    visible,
                    qk_scale,
                    cache_ty,
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
                acc, m_i, l_i = _attend_new_and_write(
                    acc,
                    m_i,
                    l_i,
                    q,
                    k_new,
                    v_new,
                    sk_s,
                    sv_s,
                    k_cache,
                    v_cache,
                    skc_s,
                    svc_s,
                    start,
                    offs_j,
                    ok,
                    ok & (offs_j >= j_lo),
                    offs_d,
                    visible,
                    qk_scale,
                    cache_ty,
                    HEAD_DIM,
                    BLOCK_D,
                    cap,
                    slope,
                    qi,
                    SOFTCAP,
                    ALIBI,
                )

    out = acc / l_i[:, None]  # the softmax's normalisation, once
    _store_rows(
        OUT + b * so_b + qi[:, None] * so_s + qh[:, None] * so_h + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        row_ok,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
    )


@_jit_on_first_use
def _new_kv(k_new, v_new, offs_d, d_ok, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr):
    """The new token's k and v rows [BLOCK_D] and, with ROTARY, k at rotate_half's partner
    columns (else k again, unused)."""
    k = tl.load(k_new + offs_d, mask=d_ok)
    v = tl.load(v_new + offs_d, mask=d_ok)
    if ROTARY:
        k_half = tl.load(k_new + (offs_d + HEAD_DIM // 2) % HEAD_DIM, mask=d_ok)
    else:
        k_half = k
    return k, v, k_half


@_jit_on_first_use
def _new_key_scores(qk, qk_scale, cap, SOFTCAP: tl.constexpr):
    """Base-2 scores of the new token's key (qk [R]: its raw q.k per row): `_variant_scores` at
    key position = query position, where ALiBi adds 0."""
    if SOFTCAP:
        return _tanh(qk * qk_scale) * cap
    else:
        return qk * qk_scale


@_jit_on_first_use
def _split_len(n_keys, num_splits, floor, BLOCK_N: tl.constexpr):
    # keys per split for a sequence with n_keys keys: an even share in whole tiles among as
    # many splits as n_keys / floor rounds to (at least 1, at most num_splits), so that no split
    # is left a sliver: 129-191 keys at a floor of 128 take one split, not 128 + a few keys
    # whose combine costs more than walking them
    active = tl.minimum(tl.maximum((2 * n_keys + floor) // (2 * floor), 1), num_splits)
    return tl.cdiv(tl.cdiv(n_keys, active), BLOCK_N) * BLOCK_N


@_jit_on_first_use
def _decode_kernel(
    Q,
    K,
    V,
    KC,
    VC,
    POS,
    OUT,
    PART_O,
    PART_LSE,
    LOCK,
    qk_scale,
    sq_b,
    sq_h,  # q [B, H, 1, D]
    sk_b,
    sk_h,  # k [B, Hkv, 1, D]
    sv_b,
    sv_h,
    skc_b,
    skc_h,
    skc_s,  # k_cache [Bmax, Hkv, Smax, D]
    svc_b,
    svc_h,
    svc_s,
    so_b,
    so_h,  # out [B, 1, H, D]
    sp_b,
    sp_h,
    sp_s,  # part_o [B, H, splits, D] fp32
    sl_b,
    sl_h,  # part_lse [B, H, splits] fp32
    Hkv,
    Smax,
    split_floor,
    window,
    COS,
    SIN,
    sc_b,
    ss_b,  # ROTARY: cos, sin [B, 1, D] (dsc.rotary's inputs); else None
    RPOS,
    srp_b,  # ROT_TABLE: COS / SIN are tables [P, D] and RPOS [B, 1] the rows to read; else None
    SLOPES,
    cap,  # ALIBI: slopes [H] fp32; SOFTCAP: softcap * log2(e) (qk_scale is then scale / softcap)
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOWED: tl.constexpr,
    ROTARY: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PRE_N: tl.constexpr = 0,
    ROT_TABLE: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv
    # the split's key range [lo, hi) comes from the position alone, and so does its first PRE_N
    # keys' tile (PRE_N > 0), loaded here: with PDL before the wait, while the previous kernel
    # (the qkv projection) still runs. What this reads was written before that kernel started:
    # POS by the runtime before the step (a copy that is not a PDL launch, so it finished before
    # any later kernel began), and cache slots below the position by this layer's attention in an
    # earlier step or by the prefill. Those finished before this kernel starts: the previous
    # layer's decode attention lets its dependents launch only after its own wait, and that wait
    # returns only once every kernel before it has finished (every PDL kernel waits before it
    # exits). At a short context the kernel is a chain of dependent loads (position, keys,
    # output); this takes the first two off the chain after the wait.
    pos = tl.load(POS + b).to(tl.int32)  # the new token's position
    n_keys = tl.minimum(pos + 1, Smax)  # keys it sees: cache slots [first, n_keys)
    if WINDOWED:
        first = tl.maximum(pos + 1 - window, 0)
    else:
        first = 0
    split_len = _split_len(n_keys - first, tl.num_programs(1), split_floor, BLOCK_N)
    lo = first + split * split_len
    hi = tl.minimum(tl.minimum(lo + split_len, pos), Smax)  # cached keys of this split: [lo, hi)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k_cache = KC + b * skc_b + kvh * skc_h
    v_cache = VC + b * svc_b + kvh * svc_h
    if PRE_N > 0:  # (none where the split is past the sequence's end: then hi <= lo)
        offs_p = lo + tl.arange(0, PRE_N)
        ok_p = offs_p < hi
        k_pre = _load_rows(k_cache + offs_p[:, None] * skc_s + offs_d[None, :], ok_p, offs_d, HEAD_DIM, BLOCK_D)
        v_pre = _load_rows(v_cache + offs_p[:, None] * svc_s + offs_d[None, :], ok_p, offs_d, HEAD_DIM, BLOCK_D)
    if ROTARY and ROT_TABLE:  # the rotary tables' rows, also before the wait: the tables are
        # constants and RPOS, like POS, a step input the runtime wrote before the step
        row = tl.load(RPOS + b * srp_b).to(tl.int64)
        cos = tl.load(COS + row * sc_b + offs_d, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
        sin = tl.load(SIN + row * ss_b + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    if PDL:  # kernels/launch.py: wait for the previous kernel before reading what it wrote (q, k,
        # v); the next one is let start only after the key loop (below: never before the wait,
        # which the preload's argument above needs; right after it measured the same, 2 H100s)
        tl.extra.cuda.gdc_wait()
    # q (and what rotates it) loads first, together with the new token's k and v: a load behind
    # the early return or the key loop adds its latency (with a window the new k and v load
    # after the loop: held across it, they made the windowed rotary build spill)
    heads = kvh * G + tl.arange(0, BLOCK_H)  # the group's query heads, padded to BLOCK_H rows
    head_ok = tl.arange(0, BLOCK_H) < G
    q_rows = Q + b * sq_b + heads[:, None] * sq_h  # [BLOCK_H, 1]
    q = _load_rows(q_rows + offs_d[None, :], head_ok, offs_d, HEAD_DIM, BLOCK_D)
    if ROTARY:  # dsc.rotary's q and k (rounded to their dtype): one launch fewer per layer
        half_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # rotate_half's partner column
        q_half = _load_rows(q_rows + half_d[None, :], head_ok, offs_d, HEAD_DIM, BLOCK_D)
        if not ROT_TABLE:  # cos, sin [B, 1, D]: a kernel before this one gathered them
            cos = tl.load(COS + b * sc_b + offs_d, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
            sin = tl.load(SIN + b * ss_b + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    k_new = K + b * sk_b + kvh * sk_h
    v_new = V + b * sv_b + kvh * sv_h
    if not WINDOWED:
        k_in, v_in, k_in_half = _new_kv(k_new, v_new, offs_d, d_ok, HEAD_DIM, ROTARY)
    if lo >= n_keys:  # this split is past the sequence's end
        return
    n_written = tl.cdiv(n_keys - first, split_len)  # splits that did not return early

    if ROTARY:
        sin = tl.where(offs_d < HEAD_DIM // 2, -sin, sin)
        q = _rotated(q, q_half, cos[None, :], sin[None, :])
    if ALIBI:  # each query head's slope, in base 2 (`_variant_scores`)
        slope = tl.load(SLOPES + heads, mask=head_ok, other=0.0) * 1.4426950408889634  # [BLOCK_H]
        q_pos = tl.zeros([BLOCK_H], tl.int32) + pos  # every row's position (the variant's query index)
    else:
        slope, q_pos = 0.0, 0

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if PRE_N > 0:  # the preloaded tile (PRE_N == BLOCK_N: the loop's first tile, the same sums).
        # With no cached key here (hi == lo: the new token opens the split) it is all masked:
        # its columns score -1e30 and carry zero values, and the new token's alpha of 0 then
        # clears them, as it clears -inf's running sums
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_pre.to(q.dtype),
            v_pre.to(q.dtype),
            ok_p[None, :],
            qk_scale,
            True,
            cap,
            slope,
            q_pos,
            offs_p,
            SOFTCAP,
            ALIBI,
        )
    for j0 in range(lo + PRE_N, hi, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        ok = offs_j < hi
        k = _load_rows(k_cache + offs_j[:, None] * skc_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D)
        v = _load_rows(v_cache + offs_j[:, None] * svc_s + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D)
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            ok[None, :],
            qk_scale,
            True,
            cap,
            slope,
            q_pos,
            offs_j,
            SOFTCAP,
            ALIBI,
        )

    if PDL:  # the next kernel may start now, not at the top, so that its programs' early
        # weight loads overlap this kernel's end rather than the key loop's chain of loads
        tl.extra.cuda.gdc_launch_dependents()

    if (pos < Smax) & (pos < lo + split_len):  # the new token's slot is in this split
        cache_ty = KC.dtype.element_ty
        if WINDOWED:
            k_in, v_in, k_in_half = _new_kv(k_new, v_new, offs_d, d_ok, HEAD_DIM, ROTARY)
        kn = k_in
        if ROTARY:  # in k's dtype first, as dsc.rotary stores it, then the cache's
            kn = _rotated(kn, k_in_half, cos, sin)
        kn = kn.to(cache_ty)
        vn = v_in.to(cache_ty)
        tl.store(k_cache + pos * skc_s + offs_d, kn, mask=d_ok)
        tl.store(v_cache + pos * svc_s + offs_d, vn, mask=d_ok)
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
    if SPLIT:
        # a sequence whose keys all fall in one split (n_written == 1, e.g. a short context):
        # that split writes `out` itself, as without splits; no partials, and the counter
        # stays at 0 (only sequences with several splits take and reset it)
        single = n_written == 1
    else:
        single = True
    if single:
        _store_rows(
            OUT + b * so_b + heads[:, None] * so_h + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            head_ok,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
        )
    else:
        part_o = PART_O + b * sp_b + heads[:, None] * sp_h + offs_d[None, :]  # + split * sp_s
        part_lse = PART_LSE + b * sl_b + heads * sl_h  # + split
        _store_rows(part_o + split * sp_s, out, head_ok, offs_d, HEAD_DIM, BLOCK_D)
        tl.store(part_lse + split, m_i + tl.log2(l_i), mask=head_ok)
        # the last split of this (sequence, kv head) to finish combines all of them: the
        # barrier orders every thread's stores before the counter's release, and the acquire
        # makes the other splits' stores visible to the last one (no second kernel launch)
        tl.debug_barrier()
        done = tl.atomic_add(LOCK + bh, 1, sem="acq_rel", scope="gpu")
        if done == n_written - 1:
            o = _combine_splits(part_o, part_lse, sp_s, n_written, head_ok, d_ok, BLOCK_H, BLOCK_D)
            _store_rows(
                OUT + b * so_b + heads[:, None] * so_h + offs_d[None, :],
                o.to(OUT.dtype.element_ty),
                head_ok,
                offs_d,
                HEAD_DIM,
                BLOCK_D,
            )
            tl.store(LOCK + bh, 0)  # ready for the next step (and the next graph replay)


# ---------------------------------------------------------------------------------------------
# Wrappers: check shapes, allocate, launch.
def _check(q, k, v, k_cache, v_cache, cache_pos, softcap=0.0, alibi_slopes=None):
    B, H, S, D = q.shape
    check_variant("attention", softcap, alibi_slopes, H)
    Hkv = k.shape[1]
    if k.shape != (B, Hkv, S, D) or v.shape != k.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if H % Hkv:
        raise ValueError(f"attention: {H} query heads are not a multiple of {Hkv} kv heads")
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != Hkv or k_cache.shape[3] != D or k_cache.shape[0] < B:
        raise ValueError(f"attention: cache {tuple(k_cache.shape)} does not fit q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attention: the KV cache must be contiguous in head_dim")
    if cache_pos.shape != (B,) or cache_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"attention: cache_pos must be an int tensor of shape ({B},), got {tuple(cache_pos.shape)} "
            f"{cache_pos.dtype}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"attention: k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if not 1 <= D <= 256:
        raise ValueError(f"attention: head_dim {D} is outside the Triton kernels' range 1..256")


def check_variant(op: str, softcap: float, alibi_slopes, heads: int) -> None:
    """softcap >= 0 (0: none); alibi_slopes: None, or one fp32 slope per query head [H]."""
    if not softcap >= 0:
        raise ValueError(f"{op}: softcap must be >= 0 (0: none), got {softcap}")
    if alibi_slopes is not None and (alibi_slopes.shape != (heads,) or alibi_slopes.dtype != torch.float32):
        raise ValueError(
            f"{op}: alibi_slopes must be a float32 tensor of shape ({heads},), got "
            f"{tuple(alibi_slopes.shape)} {alibi_slopes.dtype}"
        )


def variant_launch(scale: float, softcap: float, alibi_slopes) -> tuple:
    """A kernel launch's (qk_scale, SLOPES, cap, constexprs) for the variant (`_variant_scores`):
    without soft-capping qk_scale = scale * log2(e) and cap unused; with it the tanh's input
    scale, scale / softcap, and cap = softcap * log2(e)."""
    log2e = math.log2(math.e)
    qk_scale, cap = (scale / softcap, softcap * log2e) if softcap else (scale * log2e, 0.0)
    slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
    return qk_scale, slopes, cap, dict(SOFTCAP=bool(softcap), ALIBI=slopes is not None)


def _last_contiguous(*ts):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def prefill_attention(
    q, k, v, k_cache, v_cache, cache_pos, scale, window=0, softcap=0.0, alibi_slopes=None, *, out=None, config=None
):
    """`attention` for any S (the prefill kernel); out [B, S, H, D] may be given (tests poison it)."""
    _check(q, k, v, k_cache, v_cache, cache_pos, softcap, alibi_slopes)
    _triton()
    q, k, v = _last_contiguous(q, k, v)
    B, H, S, D = q.shape
    Hkv, Smax = k.shape[1], k_cache.shape[2]
    G = H // Hkv
    cfg = config or attention_config("prefill", D, arch_of(q.device), q.element_size())
    out = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device) if out is None else out
    if cfg.get("WS") and q.is_cuda and arch_of(q.device) == "sm_90":
        # the warp-specialized Gluon kernel (kernels/attention_sm90.py) where it applies; its
        # tile comes from its own table, WS_CONFIGS (a config's WS_<key> entries override it)
        from dsc.kernels.attention_sm90 import prefill_ws, prefill_ws_supported

        if prefill_ws_supported(q, k, v, k_cache, v_cache, window, softcap, alibi_slopes):
            ws = {key[3:]: value for key, value in cfg.items() if key.startswith("WS_")}
            if prefill_ws(q, k, v, k_cache, v_cache, cache_pos, scale, out, ws) is not None:
                return out
    grid = (cdiv(S * G, cfg["BLOCK_M"]) * B * Hkv,)  # the kernel orders (sequence, row tile, kv head)
    BLOCK_D = max(16, next_power_of_2(D))
    # the config's variant keys (kernel `_attend_full_tiles`) matter only in the unwindowed
    # loops without soft-capping or ALiBi: such a call runs the default code, whatever the config
    # says; TMA only for 16-bit q/k/v and caches (what the GPU runs measured: fp32 tiles are twice the bytes)
    qk_scale, slopes, cap, variant = variant_launch(scale, softcap, alibi_slopes)
    plain = not window and not any(variant.values())
    defer_pv = bool(cfg.get("DEFER_PV", False)) and plain
    sixteen = all(t.dtype in (torch.float16, torch.bfloat16) for t in (q, k, v, k_cache, v_cache))
    descs = (
        _kv_descriptors(k, v, k_cache, v_cache, cfg["BLOCK_N"], BLOCK_D)
        if cfg.get("TMA", False) and plain and sixteen
        else None
    )
    launched(_prefill_kernel)[grid](
        q,
        k,
        v,
        k_cache,
        v_cache,
        cache_pos,
        out,
        qk_scale,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        Hkv,
        S,
        Smax,
        window,
        *(descs or (None,) * 4),
        slopes,
        cap,
        G=G,
        HEAD_DIM=D,
        BLOCK_D=BLOCK_D,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        WINDOWED=window > 0,
        TMA=descs is not None,
        DEFER_PV=defer_pv,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **variant,
    )
    return out


def _kv_descriptors(k, v, k_cache, v_cache, block_n: int, block_d: int):
    """Host-side TMA descriptors of k, v, k_cache, v_cache (each [B or Bmax, Hkv, S or Smax, D];
    blocks [1, 1, block_n, block_d], columns past D read 0), or None where TMA cannot address one
    of them (a base not 16-byte aligned, or a stride that is not a multiple of 16 bytes): the
    kernel then loads those tiles through pointers, as by default."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    ts = (k, v, k_cache, v_cache)
    if any(t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]) for t in ts):
        return None
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, block_d]) for t in ts]


def decode_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    cache_pos,
    scale,
    window=0,
    softcap=0.0,
    alibi_slopes=None,
    *,
    rotary=None,
    rot_pos=None,
    out=None,
    config=None,
    num_splits=None,
):
    """`attention` for S == 1 (flash-decoding). The grid depends on shapes only.
    rotary=(cos, sin): `rotary_attention`, q and k are dsc.rotary's inputs, rotated in the kernel;
    with rot_pos [B, 1] (integers), cos and sin are tables [P, D] and the kernel reads their rows
    rot_pos (dsc.rotary's cos, sin = table[rot_pos]: the gathers' launches are saved)."""
    _check(q, k, v, k_cache, v_cache, cache_pos, softcap, alibi_slopes)
    if q.shape[2] != 1:
        raise ValueError(f"decode_attention: one query per sequence, got S={q.shape[2]}")
    if rot_pos is not None:
        check_rotary_tables(q, k, *rotary, rot_pos)
    elif rotary is not None:
        check_rotary(q, k, *rotary)
    _triton()
    q, k, v = _last_contiguous(q, k, v)
    # cos, sin and their batch (or table row) strides, rot_pos and its batch stride; None
    # (constexprs) where the kernel does not read them
    rot = (None,) * 6
    if rotary is not None:
        cos, sin = _last_contiguous(*rotary)
        rot = (cos, sin, cos.stride(0), sin.stride(0)) + (
            (None, None) if rot_pos is None else (rot_pos, rot_pos.stride(0))
        )
    B, H, _, D = q.shape
    Hkv, Smax = k.shape[1], k_cache.shape[2]
    G = H // Hkv
    cfg = config or attention_config("decode", D, arch_of(q.device), q.element_size())
    splits = num_splits or decode_num_splits(B, Hkv, Smax, cfg, sm_count(q.device))
    if splits > MAX_SPLITS:
        raise ValueError(f"decode_attention: {splits} splits exceed MAX_SPLITS={MAX_SPLITS}")
    out = torch.empty(B, 1, H, D, dtype=q.dtype, device=q.device) if out is None else out
    part_o = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device) if splits > 1 else out
    part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device) if splits > 1 else out
    BLOCK_D = max(16, next_power_of_2(D))
    lock = split_counters(q.device, B * Hkv) if splits > 1 else out
    qk_scale, slopes, cap, variant = variant_launch(scale, softcap, alibi_slopes)
    launched(_decode_kernel)[(B * Hkv, splits)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        cache_pos,
        out,
        part_o,
        part_lse,
        lock,
        qk_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(2),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        Hkv,
        Smax,
        cfg.get("SPLIT_FLOOR", cfg["MIN_SPLIT"]),
        window,
        *rot,
        slopes,
        cap,
        G=G,
        HEAD_DIM=D,
        BLOCK_D=BLOCK_D,
        BLOCK_H=max(16, next_power_of_2(G)),
        BLOCK_N=cfg["BLOCK_N"],
        SPLIT=splits > 1,
        WINDOWED=window > 0,
        ROTARY=rotary is not None,
        ROT_TABLE=rot_pos is not None,
        num_stages=cfg["num_stages"],
        **decode_preload(cfg),
        **pdl_options(q.device),
        **variant,
        **ROTATE_OPTIONS,  # with or without ROTARY: one arithmetic for both (the rotary pair's bits)
    )
    return out


def variant_config(window=0, softcap=0.0, alibi_slopes=None) -> dict:
    """The plan's record of an attention's variant: only what is set (a plain attention's
    config stays as it was without the variants)."""
    return {
        **({"window": window} if window else {}),
        **({"softcap": float(softcap)} if softcap else {}),
        **({"alibi": True} if alibi_slopes is not None else {}),
    }


# ---------------------------------------------------------------------------------------------
# Ops
@torch.library.custom_op("dsc::causal_attention", mutates_args=())
def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_pos: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """softcap > 0: scores s -> softcap * tanh(s / softcap) (after the scale, before the mask);
    alibi_slopes [H] fp32: + slope_h * (key position - query position) (`attend_reference`)."""
    return causal_attention_reference(q, k, v, cache_pos, scale, window, softcap, alibi_slopes)


def _out_like(q):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D)


declare("dsc.causal_attention.default")


@causal_attention.register_fake
def _(q, k, v, cache_pos, scale, window=0, softcap=0.0, alibi_slopes=None):
    return _out_like(q)


@torch.library.custom_op("dsc::attention", mutates_args=("k_cache", "v_cache"))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_pos: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    return attention_reference(q, k, v, k_cache, v_cache, cache_pos, scale, window, softcap, alibi_slopes)


declare("dsc.attention.default", attention=True)


@cuda_kernel(attention)
def _(q, k, v, k_cache, v_cache, cache_pos, scale, window=0, softcap=0.0, alibi_slopes=None):
    variant = dict(softcap=softcap, alibi_slopes=alibi_slopes)
    if q.shape[2] == 1:
        return decode_attention(q, k, v, k_cache, v_cache, cache_pos, scale, window, **variant)
    return prefill_attention(q, k, v, k_cache, v_cache, cache_pos, scale, window, **variant)


@attention.register_fake
def _(q, k, v, k_cache, v_cache, cache_pos, scale, window=0, softcap=0.0, alibi_slopes=None):
    return _out_like(q)


@planner("dsc.attention.default")
def _plan_attention(q, k, v, k_cache, v_cache, cache_pos, scale, window=0, softcap=0.0, alibi_slopes=None, *, arch):
    """The kernels and configs the CUDA implementation will launch. The decode batch is
    symbolic at compile time: splits are counted at batch 1 (the most splits); one launch."""
    B, H, S, D = q.shape
    Hkv, Smax = k.shape[1], k_cache.shape[2]
    if isinstance(S, int) and S == 1:
        cfg = attention_config("decode", D, arch, q.element_size())
        batch = B if isinstance(B, int) else 1
        splits = decode_num_splits(batch, Hkv, Smax, cfg, SM_COUNT.get(arch, SM_COUNT["sm_90"]))
        cfg = {**cfg, "splits": splits, "splits_at_batch": batch, **variant_config(window, softcap, alibi_slopes)}
        return {"name": "triton.attention_decode", "config": cfg, "launches": 1}
    cfg = attention_config("prefill", D, arch, q.element_size())
    if cfg.get("WS") and arch == "sm_90":
        from dsc.kernels.attention_sm90 import WS_CONFIGS, prefill_ws_supported

        if prefill_ws_supported(q, k, v, k_cache, v_cache, window, softcap, alibi_slopes):
            return {"name": "gluon.attention_prefill_ws", "config": {**WS_CONFIGS[D], "group": H // Hkv}, "launches": 1}
    cfg = {key: value for key, value in cfg.items() if key != "WS"}
    cfg = {**cfg, "group": H // Hkv, **variant_config(window, softcap, alibi_slopes)}
    return {"name": "triton.attention_prefill", "config": cfg, "launches": 1}


@torch.library.custom_op("dsc::rotary_attention", mutates_args=("k_cache", "v_cache"))
def rotary_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_pos: torch.Tensor,
    scale: float,
    window: int = 0,
    rot_pos: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """rot_pos [B, S] (fuse_rotary_attention, where cos and sin were rows of the position tables
    that fold_position_tables made): cos and sin are those tables [P, D], and the decode kernel
    reads the rows itself, so the step launches no gathers for them. softcap, alibi_slopes: as
    `attention`'s (after rot_pos: the arguments every attention op ends with)."""
    return rotary_attention_reference(
        q, k, v, cos, sin, k_cache, v_cache, cache_pos, scale, window, rot_pos, softcap, alibi_slopes
    )


declare("dsc.rotary_attention.default", attention=True)


@cuda_kernel(rotary_attention)
def _(q, k, v, cos, sin, k_cache, v_cache, cache_pos, scale, window=0, rot_pos=None, softcap=0.0, alibi_slopes=None):
    variant = dict(softcap=softcap, alibi_slopes=alibi_slopes)
    if q.shape[2] == 1:
        return decode_attention(
            q, k, v, k_cache, v_cache, cache_pos, scale, window, rotary=(cos, sin), rot_pos=rot_pos, **variant
        )
    if rot_pos is not None:
        cos, sin = rotary_rows(cos, sin, rot_pos)
    q, k = rotary_triton(q, k, cos, sin)  # the prefill kernel reads each key many times: rotate once
    return prefill_attention(q, k, v, k_cache, v_cache, cache_pos, scale, window, **variant)


@rotary_attention.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, cache_pos, scale, window=0, rot_pos=None, softcap=0.0, alibi_slopes=None):
    return _out_like(q)


@planner("dsc.rotary_attention.default")
def _plan_rotary_attention(
    q,
    k,
    v,
    cos,
    sin,
    k_cache,
    v_cache,
    cache_pos,
    scale,
    window=0,
    rot_pos=None,
    softcap=0.0,
    alibi_slopes=None,
    *,
    arch,
):
    """Decode: the decode kernel with ROTARY, one launch; otherwise the rotary kernel, then prefill."""
    plan = _plan_attention(q, k, v, k_cache, v_cache, cache_pos, scale, window, softcap, alibi_slopes, arch=arch)
    if plan["name"] == "triton.attention_decode":
        return {**plan, "name": "triton.rotary_attention_decode"}
    return {
        "name": f"triton.rotary + {plan['name']}",
        "config": {**plan["config"], "rotary": rotary_config(q.shape[-1], arch)},
        "launches": 2,
    }
