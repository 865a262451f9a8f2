"""L2 prefetch of a weight a later kernel of the decode step will stream (DSC_L2_PREFETCH).

At batch 1 a decoder layer's GEMVs stream their weights at close to the GPU's memory bandwidth,
but between them memory sits idle: the attention over a short context, the all-reduce after
o_proj (its pushes, the wait for the peers, the norm) and the kernel boundaries are latency,
not bytes. The more tensor-parallel ranks, the smaller each GEMV and the larger that idle
share (Llama-8B at tp=4 on 4 H200s: the attention and the o_proj + all-reduce +
norm slots take about 12 us per layer, against 2 us for o_proj's 8.4 MB). `l2_prefetch` fills some
of that time: one launch, right after a layer's attention, that asks the L2 cache for the
first `nbytes` of the MLP's gate/up weight, so gate_up then reads those bytes from L2 instead
of HBM.

The kernel issues Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global`, sm_90: a
hint, no registers or shared memory filled, nothing to wait for), CHUNK bytes per lane and
LANES lanes per program. It changes no value: the step computes the same bits with or without
it. With PDL it lets its dependents launch at once, issues its prefetches, then waits for the
kernel before it (every PDL kernel waits before it exits: kernels/launch.py), so it adds one
short kernel to the chain and nothing before the attention's end.

The runtime inserts it into the decode program at load (runtime/engine.py
`Engine._insert_l2_prefetch`, through `insert_l2_prefetch` in the same module): it is not in the
compiled plan, and `dsc inspect`'s launch counts do not include it. Off by default (Llama-8B:
no gain at tp=1, a loss at tp=4, and at tp=2 a loss beside the one-wave GEMV push rows;
docs/switches.md): DSC_L2_PREFETCH=MB turns it on with
a budget of MB megabytes per layer (MB:last also marks the lines evict-last, so the o_proj
weights streaming through L2 in between evict other lines first). Only on CUDA devices of
capability 9.0 or more with PDL on; elsewhere the function does nothing.
"""
from __future__ import annotations

import os

import torch

from dsc.kernels.launch import cdiv, jit, pdl_enabled

tl = None  # triton.language, bound by launch.jit on first launch

CHUNK = 8 << 10  # bytes per bulk prefetch (a multiple of 16, as the instruction requires)
LANES = 32  # prefetches per program: one per thread of its one warp (fewer would be issued by
# several threads each), so 256 KB per program, 64 programs for 16 MB. Not tuned (no MB budget gained: docs/switches.md)


def _l2_prefetch_kernel(W, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, EVICT_LAST: tl.constexpr,
                        PDL: tl.constexpr = False):
    # W: the weight's bytes (uint8, 16-byte aligned); nbytes: how many to prefetch from its start
    # (a multiple of 16). Program p, lane l: bytes [(p * LANES + l) * CHUNK, + CHUNK) up to nbytes.
    # Nothing is loaded: before the PDL wait it reads no memory at all.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    start = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK).to(tl.int32)
    addr = (W + start).to(tl.int64)
    # cp.async.bulk.prefetch.L2 (PTX 8.0, sm_90); a lane whose size is 0 (past nbytes) issues
    # nothing. The output register only satisfies inline_asm_elementwise; is_pure=False keeps it
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 policy; setp.gt.s32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 policy, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()


def l2_prefetch_setting() -> tuple[int, bool]:
    """DSC_L2_PREFETCH (read when an engine builds its programs): "off" / unset (the default),
    "MB" or "MB:last" -> (bytes per layer, evict-last hint)."""
    spec = os.environ.get("DSC_L2_PREFETCH", "off").strip()
    if spec in ("", "off", "0"):
        return 0, False
    mb, _, hint = spec.partition(":")
    try:
        n = float(mb)
    except ValueError:
        n = -1.0
    if not (0 < n <= 1024) or hint not in ("", "last"):
        raise ValueError(f"DSC_L2_PREFETCH must be off, MB (megabytes per layer, at most 1024) or MB:last, "
                         f"got {spec!r}")
    return int(n * (1 << 20)) // 16 * 16, hint == "last"


def l2_prefetch_supported(device: torch.device) -> bool:
    """Where kernels launch with PDL (kernels/launch.py `pdl_enabled`): an NVIDIA GPU of
    capability 9.0 or more, as the bulk prefetch needs too, and PDL not turned off (without it
    the launch would sit between the attention and o_proj instead of overlapping them)."""
    return pdl_enabled(device)


def l2_prefetch(weight: torch.Tensor, nbytes: int, evict_last: bool = False) -> None:
    """Ask the L2 cache for the first nbytes of `weight` (contiguous, CUDA, 16-byte aligned);
    returns at once. Does nothing where `l2_prefetch_supported` is false (CPU, the interpreter)."""
    nbytes = min(nbytes, weight.numel() * weight.element_size()) // 16 * 16
    if (nbytes <= 0 or not weight.is_contiguous() or weight.data_ptr() % 16
            or not l2_prefetch_supported(weight.device)):
        return
    grid = (cdiv(nbytes, CHUNK * LANES),)
    jit(_l2_prefetch_kernel)[grid](weight.reshape(-1).view(torch.uint8), nbytes, CHUNK=CHUNK, LANES=LANES,
                                   EVICT_LAST=evict_last, num_warps=1, PDL=True, launch_pdl=True)
