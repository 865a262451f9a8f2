"""Tensor-parallel collectives: `dsc::all_reduce` (the sum after a row-parallel linear),
`dsc::all_reduce_add_rmsnorm` (that sum, the residual add and the RMSNorm after it, which
`fuse_add_norm` makes of the three), `dsc::vocab_embedding_all_reduce_rmsnorm` (the
vocab-parallel token embedding: the rank's lookup, the sum over the ranks and layer 0's input
RMSNorm, also made by `fuse_add_norm`) and `dsc::all_gather` (vocab-parallel logits -> full
logits on every rank).

The op runs torch's functional collective on the default process group, so a decode step
that contains it can be captured in a CUDA graph (NCCL) and runs on CPU under gloo. Outside
a distributed run (world size 1) it is the identity.

On CUDA the runtime can also enable a one-shot all-reduce through torch's symmetric memory
(`enable_symmetric`): every rank copies its tensor into a buffer its peers can read over
NVLink, all ranks meet at a barrier on device-side signal pads, and each rank sums all the
buffers itself. One launch of a few microseconds, where NCCL at decode sizes (a few KiB to
half a MiB) costs a clone plus a ring all-reduce; a batch-1 decode step of a 32-layer Llama
does 65 of them. Tensors larger than the buffers, other dtypes, and every call outside a
program scope (`program_scope`) take NCCL.

Buffer reuse. The one-shot kernel has a barrier after its copy and none after its sum, so a
rank may start copying its next input while a slower peer still reads its previous one. Two
consecutive one-shot all-reduces therefore never use the same buffer: within a program they
alternate between buffers 0 and 1, and a program with an odd count ends on buffer 2, so the
last all-reduce of any program and the first of the next (always buffer 0) differ as well.
A rank that has passed all-reduce k+1's barrier knows that every peer has finished reading
all-reduce k, so buffer k's owner may overwrite it at k+2. CUDA-graph replays repeat the
captured program's choice, which keeps the same order. An NCCL all-reduce in between is a
synchronisation point of its own.

The fused all-reduce + add + RMSNorm (one launch where the unfused ops take two; one program
per row):
- push (`_ar_push_add_rmsnorm_kernel`): every rank writes its row straight into
  its own slot of every rank's "push" buffer over NVLink, then polls its own buffer until a
  load finds no element of the row holding the marker value (-0.0; a real -0.0 is sent as +0.0,
  which changes no sum), writes the marker back, and sums the rows that load read in fp32 in
  rank order (every rank gets the same bits). No flags, no fences and no remote reads: a
  peer's data is its own arrival signal, so the call costs one NVLink write latency. A push buffer holds the marker
  everywhere outside a call. Reuse: a rank writes into buffer b again only two all-reduces
  later, having first received every rank's data (or passed a barrier) for the all-reduce in
  between, which each rank sends only after its kernel that read and reset buffer b finished.
- GEMV push (with the push kernel): `dsc::linear_all_reduce_add_rmsnorm` is the row-parallel
  o_proj / down_proj with the all-reduce + norm after it; at one row the GEMV's programs store
  their outputs into every rank's push buffer themselves, and the GEMV's last program then
  waits, sums and normalizes as the push kernel does (NORM_N: one launch).
- embedding push (with the push kernel): `dsc::vocab_embedding_all_reduce_rmsnorm` is the push
  kernel with EMBED, whose row is the rank's lookup of the token (kernels/embedding.py's:
  zeros for another rank's id) and whose residual is zero, so s is the all-reduce's output;
  one launch where the lookup, torch's one-shot all-reduce (not a PDL launch: it serialises the
  stream) and the norm take three. Elsewhere (no push kernel, more rows than the buffers, CPU)
  it is those three ops, `dsc::rmsnorm` last.
All of them then round the sum to the dtype as the all-reduce's output is, add the residual and
normalize as `dsc::add_rmsnorm` does. With PDL (kernels/launch.py) they read only the norm
weight before `gdc_wait()`; since every PDL kernel waits before it exits, the wait returning
means every earlier kernel has finished, so the reuse argument's kernel boundaries still hold.
Where the fused path is off (DSC_ALLREDUCE=nccl, a failed probe at set-up, rows beyond the
buffers, CPU) the op is `dsc::all_reduce` followed by `dsc::add_rmsnorm`, with the same values.
- push all-gather (`_push_gather_kernel`, with the push kernel): `dsc::all_gather` of the
  vocab-parallel logits, the rank's block pushed into its region
  of every rank's push buffer and each program waiting for its offsets from every sender, then
  storing them in rank order: one launch where NCCL's ring all-gather takes about 10 us at tp=4.
  Rows that do not fit the buffers (sized by the all-reduces) take NCCL.
DSC_ALLREDUCE (switches.py): auto (the default) takes the kernels above where the set-up's probe
passes; nccl takes NCCL for every collective.
Each all-reduce op here, fused or not, and the all-gather take one buffer slot per call in
`program_scope` (declared `collective_slot` below; runtime/engine.py counts them).
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsc import switches
from dsc.kernels.embedding import _lookup, check_lookup, vocab_embedding, vocab_embedding_reference
from dsc.kernels.int8 import _check as _check_int8
from dsc.kernels.int8 import _split as _int8_split
from dsc.kernels.int8 import _w8a16_rows, group_k, int8_config, linear_w8a16_reference, w8a16_gemv_row
from dsc.kernels.launch import arch_of, cdiv, device, jit, next_power_of_2, pdl_options, planner, rows_of, tuning_table
from dsc.kernels.linear import CONFIG_KEYS, _gemv_rows, gemv_config, gemv_launch
from dsc.kernels.norm import MAX_N, add_rmsnorm_reference, norm_config, rmsnorm_reference
from dsc.kernels.registry import KEEP, cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch
_MARK = {torch.bfloat16: -32768, torch.float16: -32768, torch.float32: -2147483648}  # -0.0's bits
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


class _Symmetric:
    """Three rendezvoused symmetric-memory buffers of `numel` elements of `dtype` (the one-shot
    all-reduce's), and for the fused all-reduce + norm three push buffers of `world` x `numel`
    elements (one region per sender, holding the marker); the fused kernels take up to `rows`
    rows."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numel: int, rows: int):
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.9
        if enable is not None:
            with warnings.catch_warnings():  # deprecated (a no-op) in newer torch
                warnings.simplefilter("ignore", FutureWarning)
                enable(group)
        self.group, self.dtype, self.numel, self.rows = group, dtype, numel, rows
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.buffers, ptrs = [], []
        for _ in range(3):
            buf = symm_mem.empty(numel, dtype=dtype, device=device)
            ptrs.append(symm_mem.rendezvous(buf, group).buffer_ptrs)
            self.buffers.append(buf)
        self.push, ptrs = [], []
        for _ in range(3):
            buf = symm_mem.empty(self.world * numel, dtype=dtype, device=device)
            buf.view(_BITS[dtype]).fill_(_MARK[dtype])
            ptrs.append(symm_mem.rendezvous(buf, group).buffer_ptrs)
            self.push.append(buf)
        self.push_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)  # [3, world] addresses
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's push buffers are marked before any rank writes
        self.fused = False  # the push kernel: set by enable_symmetric after the probe, the same on every rank
        self.count = 0  # all-reduces in the current program scope (0: none open)
        self.index = 0  # the next one's position
        # one real all-reduce of this dtype now: an unsupported dtype or a broken peer mapping
        # fails here, where every rank can still fall back to NCCL, not inside a decode step
        # (the NCCL all-reduce after it in enable_symmetric orders it before any later use)
        ones = torch.ones(min(8, numel), dtype=dtype, device=device)
        got = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffers[0][: ones.numel()], ones, "sum", group)
        if not torch.equal(got, torch.full_like(ones, dist.get_world_size())):
            raise RuntimeError(f"a probe all-reduce of ones over {dist.get_world_size()} ranks gave {got.tolist()}")

    def slot(self) -> int:
        i, self.index = self.index, self.index + 1
        return 2 if i == self.count - 1 and self.count % 2 == 1 else i % 2


_symm: _Symmetric | None = None
_retired: list[_Symmetric] = []  # replaced states: graphs captured with their buffers may still replay


def _label(s: _Symmetric) -> str:
    return "symm_mem+norm+gemv_push_norm" if s.fused else "symm_mem"


def enable_symmetric(device: torch.device, dtype: torch.dtype, numel: int, rows: int = 1) -> str:
    """Collective: every rank calls it with the same arguments, before any CUDA graph capture.
    `numel`: the largest decode all-reduce; `rows`: its rows (max_batch). Returns
    "symm_mem+norm+gemv_push_norm" when the one-shot all-reduce and the fused all-reduce + norm
    (push kernel) are on for all ranks, the row-parallel linears' GEMVs pushing their rows and
    ending the all-reduce (`linear_all_reduce_add_rmsnorm`); "symm_mem" when only the one-shot
    is on, else "nccl" (with the reason on stderr from rank 0). DSC_ALLREDUCE=nccl turns all of
    them off."""
    global _symm
    if device.type != "cuda" or not dist.is_initialized() or dist.get_world_size() == 1:
        return "nccl"
    if switches.ALLREDUCE == "nccl":
        return "nccl"
    s = _symm
    if s is not None and s.buffers[0].device == device and s.dtype == dtype and s.numel >= numel and s.rows >= rows:
        return _label(s)  # a second engine in this process: the same buffers serve it
    if s is not None:
        _retired.append(s)
        _symm = None
    state = None

    def set_up():
        nonlocal state
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
            raise RuntimeError(f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy")
        state = _Symmetric(device, dtype, numel, rows)

    err, fused_err = _try(set_up), ""  # any failure: fall back on every rank
    if state is not None:
        fused_err = _try(lambda: _probe_fused(state, compile_only=True))
    ok = _agree(device, err, fused_err)  # no rank launches the probe unless every rank compiled it
    if ok[0] and ok[1]:  # every rank has the kernel built: all launch the probe, none is left waiting
        fused_err = _try(lambda: _probe_fused(state))
        ok = _agree(device, err, fused_err)
    if ok[0]:
        state.fused = ok[1]
        if not state.fused and dist.get_rank() == 0:
            print(
                f"dsc: fused all-reduce + RMSNorm unavailable ({fused_err or 'on another rank'}); "
                "using the one-shot all-reduce and a separate norm",
                file=sys.stderr,
            )
        _symm = state
        return _label(state)
    if dist.get_rank() == 0:
        print(f"dsc: one-shot all-reduce unavailable ({err or 'on another rank'}); using NCCL", file=sys.stderr)
    return "nccl"


def _try(fn) -> str:
    """ "" when fn() ran, else its error in one line."""
    try:
        fn()
        return ""
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}".splitlines()[0]


def _agree(device: torch.device, *errors: str) -> list[bool]:
    """Per error slot: True when no rank reported an error there (a MIN all-reduce)."""
    ok = torch.tensor([0 if e else 1 for e in errors], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return [bool(v) for v in ok.tolist()]


def _probe_fused(s: _Symmetric, compile_only: bool = False) -> None:
    """Two fused all-reduce + norms (push kernel) of known values on every rank, outside any
    program, then the embedding variant once and the push all-gather; raises when a result is wrong.
    Buffers 1, 2, 1, 2: _Symmetric's probe used buffer 0, and the first all-reduce of the first
    program will use 0 again, so consecutive uses still differ (and each buffer is reused two
    collectives later, as in a program). compile_only: build the kernels without launching them (grids of no rows)."""
    n = min(64, s.numel)
    dev = s.buffers[0].device
    rows = 0 if compile_only else 1
    x = torch.full((rows, n), float(s.rank + 1), dtype=s.dtype, device=dev)
    res = torch.zeros(rows, n, dtype=s.dtype, device=dev)
    w = torch.ones(n, dtype=s.dtype, device=dev)
    total = torch.full((rows, n), s.world * (s.world + 1) / 2, dtype=s.dtype, device=dev)  # 1 + ... + world
    ones = torch.ones_like(total, dtype=torch.float32)
    for slot in (1, 2):
        got, y = _launch_fused(s, slot, x, res, w, 1e-6)
        if not torch.equal(got, total) or not torch.allclose(y.float(), ones, atol=1e-2):
            raise RuntimeError(f"a probe all-reduce + norm over {s.world} ranks gave {got.flatten()[:4].tolist()}")
    # id 0 is rank 0's (its rows start at 0; every other rank's at 2 * rank): 5.0 on every rank
    table = torch.full((2, n), 5.0, dtype=s.dtype, device=dev)
    start = torch.tensor([2 * s.rank], dtype=torch.int64, device=dev)
    got, y = _launch_embedding_push(s, 1, table, torch.zeros(rows, dtype=torch.int64, device=dev), start, w, 1e-6)
    if not torch.equal(got, torch.full_like(got, 5.0)) or not torch.allclose(y.float(), ones, atol=1e-2):
        raise RuntimeError(
            f"a probe embedding + all-reduce + norm over {s.world} ranks gave {got.flatten()[:4].tolist()}"
        )
    # the push all-gather (buffer 2 again, after 1): rank q's block holds q + 1
    got = _launch_push_gather(s, 2, x)
    want = torch.arange(1, s.world + 1, dtype=s.dtype, device=dev).repeat_interleave(n).expand(rows, -1)
    if not torch.equal(got, want):
        raise RuntimeError(f"a probe push all-gather over {s.world} ranks gave {got.flatten()[::n].tolist()}")


def disable_symmetric() -> None:
    """Drop the buffers (at shutdown, after the CUDA graphs that use them are destroyed)."""
    global _symm
    _symm = None
    _retired.clear()


@contextlib.contextmanager
def program_scope(all_reduces: int):
    """Run one program's `all_reduces` dsc.all_reduce calls with the buffer order above. With
    fewer than two, a program has no partner to alternate with and uses NCCL."""
    s = _symm
    if s is None:
        yield
        return
    s.count, s.index = (all_reduces if all_reduces >= 2 else 0), 0
    try:
        yield
    finally:
        s.count, s.index = 0, 0


def _one_shot(x: torch.Tensor) -> torch.Tensor | None:
    s = _symm
    if s is None or s.count == 0 or not x.is_cuda:
        return None
    slot = s.slot()  # counted even when this call takes NCCL, which synchronises on its own
    if x.dtype != s.dtype or x.numel() > s.numel:
        return None
    buf = s.buffers[slot][: x.numel()].view(x.shape)
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x.contiguous(), "sum", s.group)


_TP_GROUP = None  # the tensor-parallel ranks the collectives run over (None: every rank)


def set_tp_group(group) -> None:
    """The process group of this rank's tensor-parallel peers (under pipeline parallelism, its
    stage's ranks; runtime/pipeline.py); None: the whole world."""
    global _TP_GROUP
    _TP_GROUP = group


def tp_group():
    return _TP_GROUP if _TP_GROUP is not None else dist.group.WORLD


def tp_size() -> int:
    return dist.get_world_size(tp_group())


@torch.library.custom_op("dsc::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if not dist.is_available() or not dist.is_initialized() or tp_size() == 1:
        return x.clone()
    out = _one_shot(x)
    if out is not None:
        return out
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(x, "sum", tp_group()))


def _rank_sum(per_rank: list[tuple], i: int) -> torch.Tensor:
    """The sum over the ranks of their argument i (what every rank's all-reduce returns)."""
    return sum(a[i] for a in per_rank)


def _onnx_contrib_op(name: str, attributes: tuple[str, ...] = ()):
    """An op of onnxruntime's com.microsoft domain, whose schemas onnx does not ship."""
    import onnx.defs as d
    from onnxscript.values import Op, Opset

    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    schema = d.OpSchema(
        name,
        "com.microsoft",
        1,
        inputs=[d.OpSchema.FormalParameter("input", "T")],
        outputs=[d.OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", floats, "")],
        attributes=[d.OpSchema.Attribute(a, d.OpSchema.AttrType.INT, "") for a in attributes],
    )
    return Op(Opset("com.microsoft", 1), name, schema)


declare(
    "dsc.all_reduce.default",
    all_reduce=True,
    collective_slot=True,
    simulate=lambda per_rank: [_rank_sum(per_rank, 0)] * len(per_rank),
    onnx=KEEP,
    onnx_translation=lambda x: _onnx_contrib_op("AllReduce")(x),
)


@all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


# -- all-reduce + residual add + RMSNorm ----------------------------------------------------
@device
def _add_row(acc, r, S, cols, mask):
    # acc (the ranks' fp32 sum) becomes the all-reduce's output in the dtype, then
    # s = residual + it, rounded and stored as the unfused ops round; returns s in fp32
    dt = S.dtype.element_ty
    s = (acc.to(dt).to(tl.float32) + r).to(dt)
    tl.store(S + cols, s, mask=mask)
    return s.to(tl.float32)


@device
def _norm_row(sf, rstd, w, Y, cols, mask):
    # y = RMSNorm(s) * weight, rounded as `dsc::add_rmsnorm` rounds
    dt = Y.dtype.element_ty
    y = (sf * rstd).to(dt).to(tl.float32)
    tl.store(Y + cols, (w * y).to(dt), mask=mask)


@device
def _add_rmsnorm_row(acc, r, w, S, Y, row, cols, mask, eps, N: tl.constexpr):
    # the fused kernels' last step on a whole row: `_add_row`, then the norm
    sf = _add_row(acc, r, S + row.to(tl.int64) * N, cols, mask)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)
    _norm_row(sf, rstd, w, Y + row.to(tl.int64) * N, cols, mask)


def _ar_push_add_rmsnorm_kernel(
    X,
    R,
    W,
    S,
    Y,
    BUFS,
    stride_x,
    stride_r,
    eps,
    rank,
    region,
    IDS,
    START,
    vocab,
    N: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MARK: tl.constexpr,
    PDL: tl.constexpr = False,
    EMBED: tl.constexpr = False,
):
    # BUFS: [WORLD] addresses of every rank's push buffer (this call's slot), read as integers of
    # the dtype's width; sender q's rows start at q * region in every buffer. MARK: -0.0's bits.
    # EMBED (`vocab_embedding_all_reduce_rmsnorm`): row i is the lookup of token IDS[i] in this
    # rank's rows X [vocab, N] (row stride stride_x) of the embedding, ids START[0] .. START[0] +
    # vocab - 1, zeros for another rank's id; no residual (R, stride_r unused): s is the sum.
    # IDS, START, vocab are unused without EMBED
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dt = S.dtype.element_ty
    it = tl.int16 if dt.primitive_bitwidth == 16 else tl.int32
    if PDL:  # the next kernel may start (its own wait orders it after this one); only the norm
        # weight is read before the wait
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if EMBED:  # kernels/embedding.py's lookup
        x = _lookup(X, IDS, START, row, vocab, stride_x, cols, mask)
    else:
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    bits = x.to(it, bitcast=True)
    bits = tl.where(bits == MARK, 0, bits)  # -0.0 -> +0.0: the marker means "not arrived"
    at = (rank * region + row * N).to(tl.int64)  # (no rank.to(): triton makes a rank of 1 a constant)
    for p in tl.static_range(WORLD):  # this rank's row into its region of every rank's buffer
        buf = tl.multiple_of(tl.load(BUFS + p).to(tl.pointer_type(it)), 16)
        tl.store(buf + at + cols, bits, mask=mask)
    if EMBED:  # a residual of zeros: `_add_row` stores the sum rounded to the dtype, the all-reduce's output
        r = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        r = tl.load(R + row.to(tl.int64) * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    _push_wait_sum_norm(BUFS, r, w, S, Y, row, rank, region, eps, N, WORLD, BLOCK_W, BLOCK_N, MARK)


@device
def _push_wait_sum_norm(
    BUFS,
    r,
    w,
    S,
    Y,
    row,
    rank,
    region,
    eps,
    N: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MARK: tl.constexpr,
):
    # the push kernel's end on row `row`, in one piece (BLOCK_N >= N; r, w: its residual and
    # the norm weight, loaded): wait until every sender's row has fully arrived in this rank's
    # buffer: poll (volatile loads, all senders at once) until no element holds the marker. The
    # loop carries only a scalar (triton 3.6 fails to compile a loop-carried tensor in such a
    # loop: hence a name per load); the load that finds no marker is the one summed, normalized
    # and reset. (Loading the rows once more after the loop made Llama-8B's tp=2 step 2-20 us
    # slower on 2 H200s.)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dt = S.dtype.element_ty
    it = tl.int16 if dt.primitive_bitwidth == 16 else tl.int32
    mine = tl.multiple_of(tl.load(BUFS + rank).to(tl.pointer_type(it)), 16)
    senders = tl.arange(0, BLOCK_W)[:, None]
    ptrs = mine + (senders.to(tl.int64) * region + row * N) + cols[None, :]
    m2 = (senders < WORLD) & mask[None, :]
    first = tl.load(ptrs, mask=m2, other=0, volatile=True)
    pending = tl.sum(tl.sum((first == MARK).to(tl.int32), axis=1), axis=0)
    if pending == 0:  # the same on every thread (a block-wide sum): no divergent barrier
        _add_rmsnorm_row(_push_sum(first, ptrs, m2, senders, WORLD, MARK, dt), r, w, S, Y, row, cols, mask, eps, N)
    while pending != 0:
        again = tl.load(ptrs, mask=m2, other=0, volatile=True)
        pending = tl.sum(tl.sum((again == MARK).to(tl.int32), axis=1), axis=0)
        if pending == 0:
            _add_rmsnorm_row(_push_sum(again, ptrs, m2, senders, WORLD, MARK, dt), r, w, S, Y, row, cols, mask, eps, N)


@device
def _push_sum(rows, ptrs, m2, senders, WORLD: tl.constexpr, MARK: tl.constexpr, dt: tl.constexpr):
    # the senders' rows as loaded (every one arrived) -> their fp32 sum in rank order (the same
    # on every rank; x + 0.0 is exact), after writing the marker back for this buffer's next use
    # through the same pointers (each element's load and reset in one thread, in order; no
    # sender writes here again before this rank's next all-reduce has started, i.e. before
    # this kernel has finished)
    tl.store(ptrs, tl.full(rows.shape, MARK, rows.dtype), mask=m2)
    vals = rows.to(dt, bitcast=True).to(tl.float32)
    acc = tl.sum(tl.where(senders == 0, vals, 0.0), axis=0)
    for q in tl.static_range(1, WORLD):
        acc += tl.sum(tl.where(senders == q, vals, 0.0), axis=0)
    return acc


@device
def _push_wait_sum_norm_chunked(
    BUFS,
    R,
    NW,
    S,
    Y,
    rank,
    region,
    eps,
    N: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CHUNK: tl.constexpr,
    MARK: tl.constexpr,
):
    # `_push_wait_sum_norm` on row 0 in chunks of CHUNK columns, where the whole row would not
    # fit a GEMV program's registers (`gemv_push_norm_config`). Pass 1, chunk by chunk: wait
    # for it, reset, sum, add the residual and store s, summing s^2 (a scalar: what the poll
    # loops may carry). Pass 2: the norm of the s this program stored (after a barrier: a
    # thread may read what another stored)
    cols0 = tl.arange(0, CHUNK)
    dt = S.dtype.element_ty
    it = tl.int16 if dt.primitive_bitwidth == 16 else tl.int32
    mine = tl.multiple_of(tl.load(BUFS + rank).to(tl.pointer_type(it)), 16)
    senders = tl.arange(0, BLOCK_W)[:, None]
    sq = eps * 0.0
    for c0 in tl.static_range(0, N, CHUNK):
        cols = c0 + cols0
        mask = cols < N
        ptrs = mine + senders.to(tl.int64) * region + cols[None, :]
        m2 = (senders < WORLD) & mask[None, :]
        r = tl.load(R + cols, mask=mask, other=0.0).to(tl.float32)
        first = tl.load(ptrs, mask=m2, other=0, volatile=True)
        pending = tl.sum(tl.sum((first == MARK).to(tl.int32), axis=1), axis=0)
        part = eps * 0.0
        if pending == 0:
            sf = _add_row(_push_sum(first, ptrs, m2, senders, WORLD, MARK, dt), r, S, cols, mask)
            part = tl.sum(sf * sf, axis=0)
        while pending != 0:
            again = tl.load(ptrs, mask=m2, other=0, volatile=True)
            pending = tl.sum(tl.sum((again == MARK).to(tl.int32), axis=1), axis=0)
            if pending == 0:
                sf = _add_row(_push_sum(again, ptrs, m2, senders, WORLD, MARK, dt), r, S, cols, mask)
                part = tl.sum(sf * sf, axis=0)
        sq += part
    rstd = tl.rsqrt(sq / N + eps)
    tl.debug_barrier()
    for c0 in tl.static_range(0, N, CHUNK):
        cols = c0 + cols0
        mask = cols < N
        sf = tl.load(S + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(NW + cols, mask=mask, other=0.0).to(tl.float32)
        _norm_row(sf, rstd, w, Y, cols, mask)


def _gemv_push_kernel(
    X,
    W,
    BUFS,
    N,
    K,
    rank,
    region,
    R,
    NW,
    S,
    Y,
    eps,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ROW: tl.constexpr,
    WORLD: tl.constexpr,
    MARK: tl.constexpr,
    NORM_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY_K: tl.constexpr = 0,
):
    # the row-parallel linear before a fused all-reduce + norm, at one row: kernels/linear.py's
    # GEMV, whose programs store their outputs, rounded to the dtype, straight into this rank's
    # region of every rank's push buffer (as the push kernel would, -0.0 sent as +0.0) instead
    # of into a tensor. The peers' copies start as soon as each program has its rows, while the
    # others still stream the weight.
    # NORM_N = N: the last program (the last to start) then ends the all-reduce as the push
    # kernel does (wait, sum, reset, add, norm; s and y of the N outputs into S and Y): one
    # launch where the GEMV and the push kernel take two. Its wait is the markers' (every row,
    # its own rank's from the other
    # programs included), so no counter orders it: one program polls while the others run or
    # have run. (A counter of finished programs, one atomic each on one address, made
    # Llama-8B's tp=2 step 3 us per all-reduce slower on H200s.)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = _gemv_rows(X, W, offs_n, mask_n, K, EVEN, BLOCK_N, BLOCK_K, X_ROW, PDL, EARLY_K)
    _push_rows_and_end(X, y, offs_n, mask_n, BUFS, rank, region, R, NW, S, Y, eps, WORLD, MARK, NORM_N, BLOCK_W, CHUNK)


@device
def _push_rows_and_end(
    X,
    y,
    offs_n,
    mask_n,
    BUFS,
    rank,
    region,
    R,
    NW,
    S,
    Y,
    eps,
    WORLD: tl.constexpr,
    MARK: tl.constexpr,
    NORM_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # a GEMV push program's end (`_gemv_push_kernel`, `_w8a16_gemv_push_kernel`): its outputs y
    # [rows offs_n] rounded to x's dtype into this rank's region of every rank's push buffer (-0.0
    # sent as +0.0); then the last program ends the all-reduce of the NORM_N outputs (wait, sum,
    # reset, add, norm)
    it = tl.int16 if X.dtype.element_ty.primitive_bitwidth == 16 else tl.int32
    bits = y.to(X.dtype.element_ty).to(it, bitcast=True)
    bits = tl.where(bits == MARK, 0, bits)
    at = rank * region + offs_n
    for p in tl.static_range(WORLD):
        buf = tl.load(BUFS + p).to(tl.pointer_type(it))
        tl.store(buf + at, bits, mask=mask_n)
    if tl.program_id(0) == tl.num_programs(0) - 1:
        if CHUNK >= NORM_N:  # the row in one piece: the push kernel's end, r and w loaded first
            cols = tl.arange(0, CHUNK)
            r = tl.load(R + cols, mask=cols < NORM_N, other=0.0).to(tl.float32)
            w = tl.load(NW + cols, mask=cols < NORM_N, other=0.0).to(tl.float32)
            _push_wait_sum_norm(
                BUFS, r, w, S, Y, tl.full([], 0, tl.int32), rank, region, eps, NORM_N, WORLD, BLOCK_W, CHUNK, MARK
            )
        else:
            _push_wait_sum_norm_chunked(BUFS, R, NW, S, Y, rank, region, eps, NORM_N, WORLD, BLOCK_W, CHUNK, MARK)


def _w8a16_gemv_push_kernel(
    X,
    W,
    WS,
    WZ,
    BUFS,
    N,
    K,
    G,
    rank,
    region,
    R,
    NW,
    S,
    Y,
    eps,
    GROUP_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    X_ROW: tl.constexpr,
    WORLD: tl.constexpr,
    MARK: tl.constexpr,
    NORM_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # `_gemv_push_kernel` over an int8 weight: the W8A16 GEMV's rows (kernels/int8.py; WS, WZ
    # its scales and zero points, G groups per row) pushed into every rank's buffer, and the
    # last program ending the all-reduce: the row-parallel o_proj / down_proj of an
    # --int8 artifact and the all-reduce + add + RMSNorm after it in one launch
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = _w8a16_rows(X, W, WS, WZ, offs_n, mask_n, K, G, GROUP_K, HAS_ZERO, CVT, BLOCK_N, BLOCK_K, PREFETCH, X_ROW, PDL)
    _push_rows_and_end(X, y, offs_n, mask_n, BUFS, rank, region, R, NW, S, Y, eps, WORLD, MARK, NORM_N, BLOCK_W, CHUNK)


def _launch_fused(
    s: _Symmetric, slot: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The push kernel. x, residual: [..., N] of one shape, read as rows (launch.rows_of, as the
    norm kernels do); returns (sum, normed) of x's shape, contiguous."""
    n = x.shape[-1]
    x, rows, sx = rows_of(x)
    residual, _, sr = rows_of(residual)
    out_s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_y = torch.empty_like(out_s)
    jit(_ar_push_add_rmsnorm_kernel)[(rows,)](
        x,
        residual,
        weight,
        out_s,
        out_y,
        s.push_ptrs[slot],
        sx,
        sr,
        eps,
        s.rank,
        s.numel,
        x,
        x,
        0,
        MARK=_MARK[s.dtype],
        **_fused_options(s, n, x.device),
    )
    return out_s, out_y


def _fused_options(s: _Symmetric, n: int, dev: torch.device) -> dict:
    """The fused all-reduce + norm kernels' launch keywords for rows of n: one program per row,
    the whole row in one block (`add_rmsnorm`'s config)."""
    cfg = norm_config("add_rmsnorm", n, arch_of(dev))
    return dict(
        N=n,
        WORLD=s.world,
        BLOCK_W=next_power_of_2(s.world),
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        **pdl_options(dev),
    )


def _launch_embedding_push(
    s: _Symmetric,
    slot: int,
    table: torch.Tensor,
    ids: torch.Tensor,
    start: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The push kernel with EMBED: this rank's lookup of `ids` in its rows `table` [vocab, N]
    (ids from start[0]) sent as the all-reduce's input; returns (sum, normed) [*ids.shape, N]."""
    n = table.shape[-1]
    ids = ids.contiguous()
    out_s = torch.empty(*ids.shape, n, dtype=table.dtype, device=table.device)
    out_y = torch.empty_like(out_s)
    jit(_ar_push_add_rmsnorm_kernel)[(ids.numel(),)](
        table,
        out_s,
        weight,
        out_s,
        out_y,
        s.push_ptrs[slot],
        table.stride(0),
        0,
        eps,
        s.rank,
        s.numel,
        ids,
        start,
        table.shape[0],
        MARK=_MARK[s.dtype],
        EMBED=True,
        **_fused_options(s, n, table.device),
    )
    return out_s, out_y


@torch.library.custom_op("dsc::all_reduce_add_rmsnorm", mutates_args=())
def all_reduce_add_rmsnorm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = residual + all_reduce(x), y = RMSNorm(s) * weight, rounded as the unfused ops.
    The argument order is add_rmsnorm's in a Hugging Face layer (residual + the sublayer's
    output), so `dsc diff --numeric` pairs the arguments of the fused and the unfused node."""
    return add_rmsnorm_reference(all_reduce(x), residual, weight, eps)


declare(
    "dsc.all_reduce_add_rmsnorm.default",
    all_reduce=True,
    collective_slot=True,
    # (residual, x, weight, eps): the sum of x, then each rank's norm
    simulate=lambda per_rank: [add_rmsnorm_reference(_rank_sum(per_rank, 1), a[0], *a[2:]) for a in per_rank],
    # ONNX: the AllReduce node and the norm's reference
    onnx=lambda residual, x, weight, eps: add_rmsnorm_reference(torch.ops.dsc.all_reduce(x), residual, weight, eps),
)


@cuda_kernel(all_reduce_add_rmsnorm)
def _(residual, x, weight, eps):
    s = _symm
    n = x.shape[-1]
    if (
        s is not None
        and s.fused
        and s.count
        and x.dtype == s.dtype
        and residual.dtype == s.dtype
        and residual.shape == x.shape
        and 0 < n <= MAX_N
        and 0 < x.numel() // n <= s.rows
        and x.numel() <= s.numel
    ):
        return _launch_fused(s, s.slot(), x, residual, weight.contiguous(), eps)
    return torch.ops.dsc.add_rmsnorm(all_reduce(x), residual, weight, eps)


@all_reduce_add_rmsnorm.register_fake
def _(residual, x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@planner("dsc.all_reduce_add_rmsnorm.default")
def _plan_all_reduce_add_rmsnorm(residual, x, weight, eps, *, arch):
    """The decode program's kernel (plan_kernels sends prefill programs to plan_all_reduce_norm's
    NCCL branch): one launch on CUDA with symmetric memory."""
    cfg = norm_config("add_rmsnorm", x.shape[-1], arch)
    return {
        "name": "triton.all_reduce_add_rmsnorm",
        "config": {**cfg, "fallback": "symm_mem.one_shot_all_reduce + triton.add_rmsnorm"},
        "launches": 1,
    }


# -- vocab-parallel embedding + all-reduce + RMSNorm ------------------------------------------
@torch.library.custom_op("dsc::vocab_embedding_all_reduce_rmsnorm", mutates_args=())
def vocab_embedding_all_reduce_rmsnorm(
    weight: torch.Tensor, ids: torch.Tensor, start: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = all_reduce(vocab_embedding(weight, ids, start)), the vocab-parallel token
    embedding (the residual stream's start), y = RMSNorm(h) * norm_weight (layer 0's input norm),
    the values of the unfused ops (`fuse_add_norm` makes it of the three)."""
    h = all_reduce(vocab_embedding(weight, ids, start))
    return h, rmsnorm_reference(h, norm_weight, eps)


def _embedding_then_norms(per_rank: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, ids, start, norm weight, eps) of every rank: the ranks' lookups of their rows
    summed (the vocab-parallel embedding), then each rank's norm."""
    h = sum(vocab_embedding_reference(*a[:3]) for a in per_rank)
    return [(h, rmsnorm_reference(h, *a[3:])) for a in per_rank]


def _embedding_all_reduce_norm_onnx(weight, ids, start, norm_weight, eps):
    # the lookup's reference, the AllReduce node, the norm's reference
    h = torch.ops.dsc.all_reduce(vocab_embedding_reference(weight, ids, start))
    return h, rmsnorm_reference(h, norm_weight, eps)


declare(
    "dsc.vocab_embedding_all_reduce_rmsnorm.default",
    gather=True,
    all_reduce=True,
    collective_slot=True,
    simulate=_embedding_then_norms,
    onnx=_embedding_all_reduce_norm_onnx,
)


@cuda_kernel(vocab_embedding_all_reduce_rmsnorm)
def _(weight, ids, start, norm_weight, eps):
    check_lookup(weight, ids, start)
    s = _symm
    n = weight.shape[-1]
    if (
        s is not None
        and s.fused
        and s.count
        and weight.dtype == norm_weight.dtype == s.dtype
        and 0 < n <= MAX_N
        and 0 < ids.numel() <= s.rows
        and ids.numel() * n <= s.numel
    ):
        return _launch_embedding_push(s, s.slot(), weight.contiguous(), ids, start, norm_weight.contiguous(), eps)
    h = all_reduce(torch.ops.dsc.vocab_embedding(weight, ids, start))  # takes the slot (or NCCL)
    return h, torch.ops.dsc.rmsnorm(h, norm_weight, eps)


@vocab_embedding_all_reduce_rmsnorm.register_fake
def _(weight, ids, start, norm_weight, eps):
    h = weight.new_empty(*ids.shape, weight.shape[1])
    return h, torch.empty_like(h)


@planner("dsc.vocab_embedding_all_reduce_rmsnorm.default")
def _plan_vocab_embedding_all_reduce_rmsnorm(weight, ids, start, norm_weight, eps, *, arch):
    """The decode program's kernel (plan_kernels sends prefill programs to plan_all_reduce_norm's
    NCCL branch): one launch on CUDA with the push kernel."""
    cfg = norm_config("add_rmsnorm", weight.shape[-1], arch)
    return {
        "name": "triton.vocab_embedding_all_reduce_rmsnorm",
        "config": {**cfg, "fallback": "triton.vocab_embedding + symm_mem.one_shot_all_reduce + triton.rmsnorm"},
        "launches": 1,
    }


# -- row-parallel linear + all-reduce + residual add + RMSNorm --------------------------------
_gemv_push_error = ""  # why the GEMV push kernel failed to build here (then: the unfused pair)
_w8a16_push_error = ""  # the same for its W8A16 form


def _gemv_push_usable(s: _Symmetric | None, residual, x, weight, norm_weight, error: str) -> bool:
    """Whether a row-parallel linear + all-reduce + norm call may take a GEMV push kernel (ending
    the all-reduce): the push kernel on, DSC_ALLREDUCE=auto, that kernel built here (`error`
    empty), one row, activations of the buffers' dtype, a contiguous weight [n, k] whose rows
    fit the buffers."""
    if s is None or not s.fused or not s.count or switches.ALLREDUCE != "auto" or error or not weight.is_contiguous():
        return False
    n, k = weight.shape
    return (
        x.numel() == k
        and residual.numel() == n
        and 0 < n <= MAX_N
        and n <= s.numel
        and x.dtype == residual.dtype == norm_weight.dtype == s.dtype
    )


def _gemv_push_config(s: _Symmetric | None, residual, x, weight, norm_weight) -> dict | None:
    """The GEMV config when this call takes `_gemv_push_kernel` (`_gemv_push_usable`, a 16-bit
    weight of the buffers' dtype and a tuned GEMV for its shape); else None (the linear's
    kernel, then the fused all-reduce + norm)."""
    if not _gemv_push_usable(s, residual, x, weight, norm_weight, _gemv_push_error) or weight.dtype != s.dtype:
        return None
    return gemv_push_config(*weight.shape, arch_of(x.device))


def gemv_push_config(n: int, k: int, arch: str) -> dict | None:
    """The GEMV push kernel's config for a weight [n, k]: the shape's GEMV row (None where
    cuBLAS serves), with kernels/tuning.json's `gemv_push` row over it where one was measured
    (more rows per program: fewer, larger stores to the peers)."""
    cfg = gemv_config(n, k, arch)
    row = tuning_table().get(arch, {}).get("gemv_push", {}).get(f"N{n}_K{k}")
    if cfg is None or not row:
        return cfg
    return {**cfg, **{key: row[key] for key in CONFIG_KEYS if key in row}}


@torch.library.custom_op("dsc::linear_all_reduce_add_rmsnorm", mutates_args=())
def linear_all_reduce_add_rmsnorm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """all_reduce_add_rmsnorm(residual, x @ weight.T, norm_weight, eps): a row-parallel linear
    (no bias) and the all-reduce + add + RMSNorm after it (the decode_linears pass makes it of
    the two). On CUDA at one row with the push kernel on, its GEMV pushes its outputs into the
    peers' buffers as it computes them (`_gemv_push_kernel`) and its last program ends the
    all-reduce: one launch where the GEMV and the push kernel take two. Elsewhere the two ops."""
    return _linear_then_fused(residual, x, weight, norm_weight, eps)


def _linear_then_fused(residual, x, weight, norm_weight, eps):
    """The unfused pair: the linear's kernel, then the fused all-reduce + norm (takes a slot)."""
    return torch.ops.dsc.all_reduce_add_rmsnorm(residual, torch.ops.dsc.linear(x, weight), norm_weight, eps)


declare(
    "dsc.linear_all_reduce_add_rmsnorm.default",
    all_reduce=True,
    collective_slot=True,
    fuses=("dsc.linear.default", "dsc.all_reduce_add_rmsnorm.default"),
    # (residual, x, weight, norm weight, eps)
    simulate=lambda per_rank: [
        add_rmsnorm_reference(sum(F.linear(a[1], a[2]) for a in per_rank), a[0], *a[3:]) for a in per_rank
    ],
)


@cuda_kernel(linear_all_reduce_add_rmsnorm)
def _(residual, x, weight, norm_weight, eps):
    s = _symm
    cfg = _gemv_push_config(s, residual, x, weight, norm_weight)
    pair = lambda: _linear_then_fused(residual, x, weight, norm_weight, eps)  # noqa: E731
    if cfg is None:
        return pair()
    return _gemv_push_call(
        s, residual, norm_weight, eps, "gemv", lambda slot, norm: _launch_gemv_push(s, slot, x, weight, cfg, norm), pair
    )


def _gemv_push_call(s: _Symmetric, residual, norm_weight, eps, kind: str, launch, pair):
    """A GEMV push kernel's call (kind "gemv" or "w8a16"): launch(slot, norm) pushes the rows and,
    given norm = (residual, norm weight, eps), ends the all-reduce and returns (s, y). A kernel
    that fails to build leaves this rank the unfused pair, `pair()`, from then on: its row
    reaches the same buffers in the same layout (the push kernel sends the linear's output), so
    ranks may differ."""
    global _gemv_push_error, _w8a16_push_error
    slot = s.slot()
    norm = (residual, norm_weight.contiguous(), eps)
    try:
        out = launch(slot, norm)
    except Exception as e:  # noqa: BLE001  (a build failure: nothing was launched)
        error = f"{type(e).__name__}: {e}".splitlines()[0]
        if kind == "gemv":
            _gemv_push_error = error
        else:
            _w8a16_push_error = error
        print(
            f"dsc: {'W8A16 ' if kind == 'w8a16' else ''}GEMV + all-reduce push kernel unavailable on rank "
            f"{s.rank} ({error}); using the GEMV and the push kernel",
            file=sys.stderr,
        )
        s.index -= 1  # the unfused pair takes this slot again
        return pair()
    return out[0].view(residual.shape), out[1].view(residual.shape)


def gemv_push_norm_config(config: dict, n: int, world: int) -> dict:
    """`_gemv_push_kernel`'s launch config with the all-reduce's end (NORM_N = n) from the GEMV
    push config. The last program polls, sums and normalizes the whole row, at most 64 elements
    of the senders' rows per thread (the push kernel's load at 8 warps and 4 ranks): enough
    warps that the row fits in one pass (4 at 2 ranks and 4096 columns, 8 at 4 ranks; at most
    8), BLOCK_N scaled with them, so a warp's share of the weight tile stays the tuned one;
    CHUNK the columns per pass (`config`'s, if it sets one). Every program holds the norm code's
    registers: at Llama-8B's shapes with the shipped rows (EARLY included), ptxas of the CPU build
    of triton 3.6 reports 96 at tp=2's o_proj and down_proj (8 rows per program:
    512 programs at 4 warps, one wave of 5 per SM; 4 rows take 1024 programs at 95, 1.55
    waves, and the step 60 us longer), 128 / 92 at tp=4's (123 / 64 for the GEMV push alone).
    Capping them (maxnreg, 1024-column chunks) takes a call at tp=4's o_proj shape from 6.5 to
    27 us and tp=4's step 1.4 ms slower; 2048-column chunks at tp=2 (64 registers, one wave)
    make the step 75 us slower on 2 H100s."""
    cfg = dict(config)
    block_w = next_power_of_2(world)
    warps = cfg["num_warps"]
    want = min(8, max(warps, next_power_of_2(cdiv(block_w * n, 64 * 32))))
    if want > warps and n % (cfg["BLOCK_N"] * want // warps) == 0:
        cfg.update(BLOCK_N=cfg["BLOCK_N"] * want // warps, num_warps=want)
    chunk = min(next_power_of_2(n), 64 * 32 * cfg["num_warps"] // block_w)
    return {"CHUNK": chunk, **cfg, "NORM_N": n, "BLOCK_W": block_w}


def _launch_gemv_push(
    s: _Symmetric, slot: int, x: torch.Tensor, weight: torch.Tensor, config: dict, norm: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (one row of K) @ weight [N, K].T into this rank's region of every rank's push buffer of
    `slot`, row 0, with the GEMV config `config` (kernels/linear.py's); norm = (residual,
    norm_weight, eps): the same launch ends the all-reduce and returns (s, y) as `_launch_fused`
    does."""
    n, k = weight.shape
    residual, norm_weight, eps = norm
    out_s = torch.empty(n, dtype=residual.dtype, device=x.device)
    out_y = torch.empty_like(out_s)
    grid, opts = gemv_launch(gemv_push_norm_config(config, n, s.world), n, k, x.device)
    jit(_gemv_push_kernel)[grid](
        x.contiguous(),
        weight,
        s.push_ptrs[slot],
        n,
        k,
        s.rank,
        s.numel,
        residual.contiguous(),
        norm_weight,
        out_s,
        out_y,
        eps,
        WORLD=s.world,
        MARK=_MARK[s.dtype],
        **opts,
    )
    return out_s, out_y


@linear_all_reduce_add_rmsnorm.register_fake
def _(residual, x, weight, norm_weight, eps):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


@planner("dsc.linear_all_reduce_add_rmsnorm.default")
def _plan_linear_all_reduce_add_rmsnorm(residual, x, weight, norm_weight, eps, *, arch):
    """The decode program's (batch 1): where the GEMV is tuned for the shape, one launch, the
    GEMV pushing its rows and its last program waiting, summing and normalizing
    (DSC_ALLREDUCE=auto, the default, on the target); else the linear's kernel (cuBLAS), then
    the fused all-reduce + norm."""
    from dsc.kernels.linear import _plan_linear

    lin = _plan_linear(x, weight, arch=arch)
    cfg = {**lin["config"], "norm": norm_config("add_rmsnorm", weight.shape[0], arch)}
    if lin["name"] == "triton.gemv":
        # the launch raises the warps (and BLOCK_N with them) with the ranks: gemv_push_norm_config
        cfg.update(gemv_push_config(*weight.shape, arch), NORM_N=weight.shape[0])
        cfg["fallback"] = "triton.gemv + triton.all_reduce_add_rmsnorm"
        return {"name": "triton.gemv_push_add_rmsnorm", "config": cfg, "launches": 1}
    return {"name": f"{lin['name']} + triton.all_reduce_add_rmsnorm", "config": cfg, "launches": lin["launches"] + 1}


# -- the same over an int8 weight (--int8, W8A16) --------------------------------------------------
@torch.library.custom_op("dsc::linear_w8a16_all_reduce_add_rmsnorm", mutates_args=())
def linear_w8a16_all_reduce_add_rmsnorm(
    residual: torch.Tensor,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """all_reduce_add_rmsnorm(residual, linear_w8a16(x, qweight, scale, zero, None, group_size),
    norm_weight, eps): `linear_all_reduce_add_rmsnorm` for an --int8 artifact's row-parallel
    o_proj / down_proj (the decode_linears pass makes it of the two). On CUDA at one row with the
    push kernel on, the W8A16 GEMV pushes its outputs (`_w8a16_gemv_push_kernel`) and its last
    program ends the all-reduce: one launch where the pair takes two. Elsewhere the two ops."""
    return _w8a16_then_fused(residual, x, qweight, scale, zero, group_size, norm_weight, eps)


def _w8a16_then_fused(residual, x, qweight, scale, zero, group_size, norm_weight, eps):
    """The unfused pair: the W8A16 linear, then the fused all-reduce + norm (takes a slot)."""
    y = torch.ops.dsc.linear_w8a16(x, qweight, scale, zero, None, group_size)
    return torch.ops.dsc.all_reduce_add_rmsnorm(residual, y, norm_weight, eps)


declare(
    "dsc.linear_w8a16_all_reduce_add_rmsnorm.default",
    all_reduce=True,
    collective_slot=True,
    fuses=("dsc.linear_w8a16.default", "dsc.all_reduce_add_rmsnorm.default"),
    # (residual, x, qweight, scale, zero, group, norm weight, eps)
    simulate=lambda per_rank: [
        add_rmsnorm_reference(sum(linear_w8a16_reference(a[1], *a[2:5], None, a[5]) for a in per_rank), a[0], *a[6:])
        for a in per_rank
    ],
)


@cuda_kernel(linear_w8a16_all_reduce_add_rmsnorm)
def _(residual, x, qweight, scale, zero, group_size, norm_weight, eps):
    s = _symm
    pair = lambda: _w8a16_then_fused(residual, x, qweight, scale, zero, group_size, norm_weight, eps)  # noqa: E731
    if not _gemv_push_usable(s, residual, x, qweight, norm_weight, _w8a16_push_error):
        return pair()
    cfg = w8a16_push_config(*qweight.shape, group_k(scale, group_size), arch_of(x.device), x.element_size())
    return _gemv_push_call(
        s,
        residual,
        norm_weight,
        eps,
        "w8a16",
        lambda slot, norm: _launch_w8a16_push(s, slot, x, qweight, scale, zero, group_size, cfg, norm),
        pair,
    )


def w8a16_push_config(n: int, k: int, group_k: int, arch: str, x_bytes: int = 2) -> dict:
    """The W8A16 GEMV push kernel's config for an int8 weight [n, k] (group_k 0: per channel):
    the W8A16 GEMV's at one row (`int8_config`), with kernels/tuning.json's `w8a16_gemv_push` row
    over it where one was measured (Llama-8B's tp=4 o_proj and down_proj: 16 rows, 8 warps, one
    wave of 256 programs where the raised GEMV rows took two; a DSC_TUNING file tries others side by
    side); `gemv_push_norm_config` raises it for the
    all-reduce's end at launch."""
    cfg = int8_config("w8a16_gemv", 1, n, k, group_k, arch, x_bytes=x_bytes)
    return {**cfg, **w8a16_gemv_row("w8a16_gemv_push", n, k, group_k, arch)}


def _launch_w8a16_push(
    s: _Symmetric,
    slot: int,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    config: dict,
    norm: tuple,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_launch_gemv_push` over an int8 weight: x (one row of K) @ dequant(qweight [N, K]).T into
    this rank's region of every rank's push buffer of `slot`, with the W8A16 GEMV config
    `config`; norm = (residual, norm_weight, eps): the same launch ends the all-reduce and
    returns (s, y)."""
    n, k = qweight.shape
    _, _, _, g = _check_int8(x.reshape(1, k), qweight, scale, zero, None, group_size)
    gk = 0 if g == 1 else group_size
    zero_ = zero if zero is not None else qweight  # any pointer: unused without HAS_ZERO
    flags = dict(GROUP_K=gk, HAS_ZERO=zero is not None, WORLD=s.world, MARK=_MARK[s.dtype], **pdl_options(x.device))
    residual, norm_weight, eps = norm
    out_s = torch.empty(n, dtype=residual.dtype, device=x.device)
    out_y = torch.empty_like(out_s)
    const, opts = _int8_split(
        {"FAST_CVT": False, "PREFETCH": False, "X_ROW": False, **gemv_push_norm_config(config, n, s.world)}, x.device
    )
    jit(_w8a16_gemv_push_kernel)[(cdiv(n, const["BLOCK_N"]),)](
        x.contiguous(),
        qweight,
        scale,
        zero_,
        s.push_ptrs[slot],
        n,
        k,
        g,
        s.rank,
        s.numel,
        residual.contiguous(),
        norm_weight,
        out_s,
        out_y,
        eps,
        **flags,
        **const,
        **opts,
    )
    return out_s, out_y


@linear_w8a16_all_reduce_add_rmsnorm.register_fake
def _(residual, x, qweight, scale, zero, group_size, norm_weight, eps):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


@planner("dsc.linear_w8a16_all_reduce_add_rmsnorm.default")
def _plan_linear_w8a16_all_reduce_add_rmsnorm(residual, x, qweight, scale, zero, group_size, norm_weight, eps, *, arch):
    """The decode program's (batch 1): one launch, the W8A16 GEMV pushing its rows and its last
    program waiting, summing and normalizing (DSC_ALLREDUCE=auto, the default, on the target);
    the config `w8a16_push_config`'s, whose warps (and BLOCK_N with them) the launch raises with the ranks
    (`gemv_push_norm_config`). Without the push kernel: the W8A16 GEMV, then the fused
    all-reduce + norm."""
    n, k = qweight.shape
    gk = group_k(scale, group_size)
    cfg = {
        "N": n,
        "K": k,
        **w8a16_push_config(n, k, gk, arch, x.dtype.itemsize),
        "NORM_N": n,
        "norm": norm_config("add_rmsnorm", n, arch),
        "fallback": "triton.w8a16 + triton.all_reduce_add_rmsnorm",
    }
    return {"name": "triton.w8a16_gemv_push_add_rmsnorm", "config": cfg, "launches": 1}


def _push_gather_kernel(
    X,
    Y,
    BUFS,
    n,
    total,
    rank,
    region,
    WORLD: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK: tl.constexpr,
    MARK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # the push all-gather: X [B, n] (this rank's, contiguous: `total` = B * n elements) -> Y
    # [B, WORLD * n], sender q's block at columns q * n. Each program takes BLOCK of X's flat
    # elements: stores them (-0.0 sent as +0.0) into this rank's region of every rank's push
    # buffer, at the same offsets, then polls its own buffer until every sender's elements at
    # those offsets have arrived (no marker left), writes the marker back and stores them into
    # Y. A program waits only for its own offsets, which the same program of each peer sends.
    # Reuse as the push all-reduce's: one slot per call in `program_scope`.
    if PDL:  # wait for the producer (the logits' GEMV) before any memory access
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    dt = Y.dtype.element_ty
    it = tl.int16 if dt.primitive_bitwidth == 16 else tl.int32
    bits = tl.load(X + offs, mask=mask, other=0.0).to(it, bitcast=True)
    bits = tl.where(bits == MARK, 0, bits)  # -0.0 -> +0.0: the marker means "not arrived"
    at = (rank * region + offs).to(tl.int64)
    for p in tl.static_range(WORLD):
        buf = tl.multiple_of(tl.load(BUFS + p).to(tl.pointer_type(it)), 16)
        tl.store(buf + at, bits, mask=mask)
    mine = tl.multiple_of(tl.load(BUFS + rank).to(tl.pointer_type(it)), 16)
    senders = tl.arange(0, BLOCK_W)[:, None]
    ptrs = mine + (senders.to(tl.int64) * region + offs[None, :])
    m2 = (senders < WORLD) & mask[None, :]
    # where each sender's element goes in Y: row offs // n, column sender * n + offs % n
    dest = Y + ((offs // n) * (WORLD * n) + offs % n).to(tl.int64)[None, :] + senders.to(tl.int64) * n
    # the poll loop as `_push_wait_sum_norm`'s (a scalar carried; the load that finds no marker
    # is the one stored)
    first = tl.load(ptrs, mask=m2, other=0, volatile=True)
    pending = tl.sum(tl.sum((first == MARK).to(tl.int32), axis=1), axis=0)
    if pending == 0:
        tl.store(ptrs, tl.full(first.shape, MARK, first.dtype), mask=m2)
        tl.store(dest, first.to(dt, bitcast=True), mask=m2)
    while pending != 0:
        again = tl.load(ptrs, mask=m2, other=0, volatile=True)
        pending = tl.sum(tl.sum((again == MARK).to(tl.int32), axis=1), axis=0)
        if pending == 0:
            tl.store(ptrs, tl.full(again.shape, MARK, again.dtype), mask=m2)
            tl.store(dest, again.to(dt, bitcast=True), mask=m2)


PUSH_GATHER = dict(BLOCK=1024, num_warps=4)  # one program per 1024 elements (Llama-8B's batch-1 logits: 32 at tp=4)


def _push_gather(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """`all_gather` through the push buffers (one launch, no NCCL), or None: NCCL's. Takes a
    slot in the program scope either way (the engine counts the op with the all-reduces)."""
    s = _symm
    if s is None or s.count == 0 or not x.is_cuda:
        return None
    slot = s.slot()  # counted even when this call takes NCCL, which synchronises on its own
    if (
        not s.fused
        or switches.ALLREDUCE != "auto"
        or x.dtype != s.dtype
        or x.numel() > s.numel
        or dim % x.dim() != x.dim() - 1
        or x.numel() == 0
    ):
        return None
    return _launch_push_gather(s, slot, x)


def _launch_push_gather(s: _Symmetric, slot: int, x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> [..., world * n], the ranks' blocks in rank order, through the push
    buffers of `slot` (x.numel() <= s.numel)."""
    x = x.contiguous()
    n = x.shape[-1]
    y = torch.empty(*x.shape[:-1], s.world * n, dtype=x.dtype, device=x.device)
    jit(_push_gather_kernel)[(cdiv(x.numel(), PUSH_GATHER["BLOCK"]),)](
        x,
        y,
        s.push_ptrs[slot],
        n,
        x.numel(),
        s.rank,
        s.numel,
        WORLD=s.world,
        BLOCK_W=next_power_of_2(s.world),
        MARK=_MARK[s.dtype],
        **PUSH_GATHER,
        **pdl_options(x.device),
    )
    return y


@torch.library.custom_op("dsc::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order). `world` is the tp size the plan
    was compiled for; it fixes the output shape at compile time."""
    if not dist.is_available() or not dist.is_initialized():
        if world != 1:
            raise RuntimeError(f"dsc.all_gather over {world} ranks needs an initialised process group")
        return x.clone()
    if tp_size() != world:
        raise RuntimeError(f"dsc.all_gather compiled for {world} ranks, process group has {tp_size()}")
    out = _push_gather(x, dim)
    if out is not None:
        return out
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch < 2.12
    g = funcol.wait_tensor(gather(x.contiguous(), 0, tp_group()))  # [world * x.shape[0], ...]
    dim %= x.dim()
    if math.prod(x.shape[:dim]) == 1:  # (batch-1 decode's logits) the ranks' blocks already lie
        shape = list(x.shape)  # in `dim`'s order: a view, no cat kernel
        shape[dim] *= world
        return g.view(shape)
    return torch.cat(g.chunk(world, 0), dim)


declare(
    "dsc.all_gather.default",
    collective_slot=True,  # pushed through the all-reduces' buffers where it fits
    simulate=lambda per_rank: [torch.cat([a[0] for a in per_rank], per_rank[0][1])] * len(per_rank),
    onnx=KEEP,
    onnx_translation=lambda x, dim, world: _onnx_contrib_op("AllGather", ("group_size", "axis"))(
        x, group_size=world, axis=dim
    ),
)


@all_gather.register_fake
def _(x, dim, world):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


@planner("dsc.all_gather.default")
def _plan_all_gather(x, dim, world, *, arch):
    """The vocab-parallel logits' gather: on the last dim with the push all-reduce kernel on, one
    launch through the push buffers (rows that fit them); else NCCL's all-gather, then a cat
    (none where the rows are one: the ranks' blocks already lie in order)."""
    if dim % x.dim() == x.dim() - 1:
        return {
            "name": "triton.push_all_gather",
            "config": {"dim": dim, **PUSH_GATHER, "fallback": "nccl.all_gather + cat"},
            "launches": 1,
        }
    return {"name": "nccl.all_gather", "config": {"dim": dim}, "launches": 2}  # gather + cat
