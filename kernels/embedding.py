"""The token embedding of a vocab-parallel rank in one launch: `dsc::vocab_embedding`.

    vocab_embedding(weight, ids, start) -> out
    weight: [rows, H]   this rank's rows of the embedding, vocabulary ids start .. start + rows - 1
    ids: [B, S] int64   token ids of the whole vocabulary
    start: [1] int64    the rank's first id (a per-rank constant of the artifact)
    out: [B, S, H]      weight[id - start] where the id is the rank's, else 0

Tensor-parallel sharding (passes/shard_tensor_parallel.py) makes the embedding of every rank
this lookup, then sums the ranks' outputs with dsc.all_reduce: exactly one rank holds each id,
the others add zeros. Written as aten ops the masked lookup was seven launches per step (sub,
two compares, and, clamp, embedding, where); one program per (token, block of BLOCK_H columns)
here reads the id and copies the row or writes zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc.kernels.launch import cdiv, device, jit, next_power_of_2, pdl_options, planner
from dsc.kernels.registry import cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch


# -- Triton kernel ----------------------------------------------------------------------------
@device
def _lookup(W, IDS, START, t, rows, stride, cols, mask):
    # columns `cols` (masked by `mask`) of token t's row in this rank's rows W (ids START[0] ..
    # START[0] + rows - 1, row stride `stride`): zeros for another rank's id. Also the lookup of
    # the push kernel with EMBED (kernels/collectives.py)
    local = tl.load(IDS + t) - tl.load(START) + 0 * cols  # the row, one per lane
    inside = (local >= 0) & (local < rows)
    return tl.load(W + tl.where(inside, local, 0) * stride + cols, mask=mask & inside, other=0.0)


def _vocab_embedding_kernel(W, IDS, START, OUT, rows, H, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # kernels/launch.py: let the next kernel start; wait for the previous one before any access
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    tl.store(OUT + t * H + cols, _lookup(W, IDS, START, t, rows, H, cols, m), mask=m)


# -- configs ----------------------------------------------------------------------------------
def vocab_embedding_config(hidden: int) -> dict:
    """{"BLOCK_H", "num_warps"}: up to 1024 columns of one token per program (16-byte accesses
    of 16-bit rows at 4 warps)."""
    return {"BLOCK_H": min(1024, next_power_of_2(hidden)), "num_warps": 4}


# -- wrapper ----------------------------------------------------------------------------------
def check_lookup(weight, ids, start) -> None:
    if weight.dim() != 2 or start.shape != (1,) or start.dtype != torch.int64 or ids.dtype != torch.int64:
        raise ValueError(
            f"vocab_embedding: weight {weight.dtype}{list(weight.shape)}, ids {ids.dtype}"
            f"{list(ids.shape)}, start {start.dtype}{list(start.shape)}: expected [rows, H], "
            "int64 ids and an int64 [1] start"
        )


def vocab_embedding_triton(weight, ids, start, config: dict | None = None):
    check_lookup(weight, ids, start)
    rows, hidden = weight.shape
    weight, ids = weight.contiguous(), ids.contiguous()
    out = torch.empty(*ids.shape, hidden, dtype=weight.dtype, device=weight.device)
    cfg = dict(config or vocab_embedding_config(hidden))
    if ids.numel() and hidden:
        num_warps = cfg.pop("num_warps")
        grid = (ids.numel(), cdiv(hidden, cfg["BLOCK_H"]))
        jit(_vocab_embedding_kernel)[grid](
            weight, ids, start, out, rows, hidden, num_warps=num_warps, **cfg, **pdl_options(weight.device)
        )
    return out


# -- reference --------------------------------------------------------------------------------
def vocab_embedding_reference(weight, ids, start):
    rows = weight.shape[0]
    local = ids - start
    inside = (local >= 0) & (local < rows)
    return torch.where(inside.unsqueeze(-1), F.embedding(local.clamp(0, rows - 1), weight), 0.0)


# -- custom op --------------------------------------------------------------------------------
@torch.library.custom_op("dsc::vocab_embedding", mutates_args=())
def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    check_lookup(weight, ids, start)
    return vocab_embedding_reference(weight, ids, start)


declare("dsc.vocab_embedding.default", gather=True)


@cuda_kernel(vocab_embedding)
def _(weight, ids, start):
    return vocab_embedding_triton(weight, ids, start)


@vocab_embedding.register_fake
def _(weight, ids, start):
    return weight.new_empty(*ids.shape, weight.shape[1])


@planner("dsc.vocab_embedding.default")
def _plan_vocab_embedding(weight, ids, start, *, arch):
    return {"name": "triton.vocab_embedding", "config": vocab_embedding_config(weight.shape[1]), "launches": 1}
