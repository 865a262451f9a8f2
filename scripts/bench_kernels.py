"""Kernel benchmarks on one GPU, by section.

    python scripts/bench_kernels.py                      # fused: norm/activation/rotary kernels vs the unfused torch
    ops
    python scripts/bench_kernels.py fused --rows 8192    # ... at fewer rows (prefill tokens)
    python scripts/bench_kernels.py attention            # attention kernels vs torch SDPA (about a minute)
    python scripts/bench_kernels.py attention --sweep    # + sweep the launch configs (adds about 2-3 min)
    python scripts/bench_kernels.py attention --short    # only: batch-1 decode configs at 128-4096 keys
    python scripts/bench_kernels.py attention --prefill-variants [--heads 25,25,64] ['{"BLOCK_M": 256, ...}']
    python scripts/bench_kernels.py fused-decode         # fused decode kernels vs their unfused pairs (graphs)
    python scripts/bench_kernels.py paged [--block-size 32]   # paged decode attention vs the static decode kernel
    TRITON_INTERPRET=1 python scripts/bench_kernels.py {fused,attention,paged} --smoke   # code path only, CPU

fused: bandwidth = the bytes the op must move (every input read once, every output written once)
/ median time (timing.bench_ms, L2 flushed between runs), as a fraction of 4.33 TB/s.
"Unfused" is the chain of torch ops the model runs without dsc (Hugging Face's own code: the
residual add then LlamaRMSNorm's pow/mean/rsqrt/mul/cast; silu then mul; gelu_new's 8 ops;
apply_rotary_pos_emb on q and k), timed the same way on the same tensors, so its "bandwidth"
counts the same useful bytes. A decode-sized row count (--decode-rows, default 8) is also
timed from a CUDA graph of 100 calls: the per-step cost of each variant when launches dominate.
Shapes: Llama-3-8B (hidden 4096, intermediate 14336, 32/8 heads of 128) in bf16; GELU at GPT-2-XL's
4 x 1600 and at 16384.

attention: Llama-3-8B attention (32 query heads, 8 kv heads, head_dim 128), bf16.
- prefill: 2048 new tokens per sequence (cache_pos 0), batch 1 and 8. FLOPs counted as
  4·D per visible (query, key) pair: 4·B·H·D·S(S+1)/2. Against 803 TFLOP/s (the H200's measured
  bf16 matmul rate); target >= 50%. Baselines: SDPA flash and cuDNN backends, causal, on k/v
  expanded to 32 heads (they read k/v, not a cache, and write no cache).
- decode: one token per sequence against contexts 1024..8192, batch 1..64, every sequence at
  full length (Smax = context). Bytes counted: the K and V cache read, 2·B·Hkv·ctx·D·2. Against
  4.33 TB/s (measured read bandwidth); target >= 80%. Baseline: SDPA (torch's choice of backend,
  enable_gqa) over the same cache. "graph" times 32 layers' decode calls (32 distinct caches, or
  fewer when they would not fit in 8 GB) captured in one CUDA graph, per call, as the runtime
  replays them; "kernel" times one call alone. Rows with Smax 8192 but a shorter context show
  what the shape-only (CUDA-graph-safe) grid costs when sequences are short.
Prefill rows are timed twice: as launched from Python ("eager"), and replayed from a CUDA graph
("graph": the kernel's GPU time alone); the target is judged on the graph time, and the host's
launch cost is printed per call. --sweep tries the candidate launch configs and prints the best,
as rows for PREFILL_CONFIGS / DECODE_CONFIGS (decode candidates scored on graph replays). The
prefill table also times the first candidate row of the prefill variants (kernels/attention.py
PREFILL_VARIANTS), and --sweep times the table's own row first, then the variant rows and the
table's tiles without the variant keys, and prints each against the table's row.

fused-decode (bf16, one row, CUDA graphs, weight copies rotating past the 60 MiB L2): the gate/up
GEMV + SwiGLU kernel against the GEMV + swiglu pair, with a small config sweep (rows for
kernels/tuning.json `gemv_swiglu`); the W8A16 GEMV + SwiGLU against its pair; the W8A16 GEMV at
Llama-8B's row-parallel shapes under its tuned config and under the GEMV push kernel's configs at
2 and 4 ranks; the decode attention rotating q and k itself against rotary then attention.
paged: a decode step of dsc::paged_attention (T == N: kernels/paged_attention.py's decode kernel,
reading K/V through block tables) against the static decode kernel (kernels/attention.py
decode_attention) on the same data: Llama-3-8B attention (32 / 8 heads of 128), bf16, batch
1/8/32/64/128, every sequence at context 512/1024/2048 (the new token at position ctx - 1; the
static cache's Smax and the block table's max_blocks x block size are both ctx, so both kernels
take the same splits). The pool holds the static cache's rows, its blocks in a random order.
Times: us per call of several layers' calls over distinct caches replayed from one CUDA graph,
as a decode step runs them; "paged/static" is their ratio (the target: the paged decode within
10% of the static step). The outputs are compared too (max |paged - static|).
Every time comes from scripts/timing.py. Writes $OUT/bench_<section>.json when OUT is set.
Loads the kernel files of this checkout by path (torch and triton only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import bench_ms, capture, checkout_modules, graph_us

PEAK_READ = 4.33e12  # B/s, measured on the H200 (docs/performance.md)
SMOKE = "--smoke" in sys.argv

NORM, ACT, ROT, A, LIN, INT8, LAUNCH, PAGED = checkout_modules(
    "kernels.norm",
    "kernels.activation",
    "kernels.rotary",
    "kernels.attention",
    "kernels.linear",
    "kernels.int8",
    "kernels.launch",
    "kernels.paged_attention",
)


# ==== section fused ================================================================================


# -- the unfused ops, as transformers runs them --------------------------------------------------
def hf_rmsnorm(x, w, eps):
    xf = x.to(torch.float32)
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hf_gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def hf_rotary(q, k, cos, sin):
    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


# -- cases: name -> (make(rows) -> (fused fn, unfused fn, bytes)) ------------------------------------
def cases(dtype, device, small: bool):
    E, I, H, HKV, D = (72, 200, 4, 2, 16) if small else (4096, 14336, 32, 8, 128)
    es = torch.empty((), dtype=dtype).element_size()
    r = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731

    def add_rmsnorm(rows):
        x, res, w = r(rows, E), r(rows, E), r(E)
        return (
            lambda: NORM.add_norm_triton("rms", x, res, w, None, 1e-5),
            lambda: hf_rmsnorm(x + res, w, 1e-5),
            (4 * rows * E + E) * es,
        )

    def rmsnorm(rows):
        x, w = r(rows, E), r(E)
        return (
            lambda: NORM.add_norm_triton("rms", x, None, w, None, 1e-5),
            lambda: hf_rmsnorm(x, w, 1e-5),
            (2 * rows * E + E) * es,
        )

    def add_layernorm(rows):
        x, res, w, b = r(rows, E), r(rows, E), r(E), r(E)
        return (
            lambda: NORM.add_norm_triton("layer", x, res, w, b, 1e-5),
            lambda: F.layer_norm(x + res, (E,), w, b, 1e-5),
            (4 * rows * E + 2 * E) * es,
        )

    def swiglu(rows):
        gu = r(rows, 2 * I)
        g, u = gu[:, :I], gu[:, I:]
        return (lambda: ACT.swiglu_triton(g, u), lambda: F.silu(g) * u, 3 * rows * I * es)

    def gelu(n, approx):
        def make(rows):
            x = r(rows, n)
            unfused = (lambda: hf_gelu_new(x)) if approx == "tanh" else (lambda: F.gelu(x))
            return lambda: ACT.gelu_triton(x, approx), unfused, 2 * rows * n * es

        return make

    def rotary(rows):
        qkv = r(1, rows, (H + 2 * HKV) * D)
        q = qkv[..., : H * D].view(1, rows, H, D).transpose(1, 2)
        k = qkv[..., H * D : (H + HKV) * D].view(1, rows, HKV, D).transpose(1, 2)
        cos, sin = r(1, rows, D), r(1, rows, D)
        return (
            lambda: ROT.rotary_triton(q, k, cos, sin),
            lambda: hf_rotary(q, k, cos, sin),
            (2 * rows * (H + HKV) * D + 2 * rows * D) * es,
        )

    return {
        f"add_rmsnorm N={E}": add_rmsnorm,
        f"rmsnorm N={E}": rmsnorm,
        f"add_layernorm N={E}": add_layernorm,
        f"swiglu N={I}": swiglu,
        f"gelu-tanh N={4 * 1600 if not small else 160}": gelu(4 * 1600 if not small else 160, "tanh"),
        f"gelu-tanh N={16384 if not small else 256}": gelu(16384 if not small else 256, "tanh"),
        f"gelu-erf N={16384 if not small else 256}": gelu(16384 if not small else 256, "none"),
        f"rotary H={H}/{HKV} D={D}": rotary,
    }


def fused_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="bench_kernels.py fused")
    ap.add_argument("--rows", type=int, default=16384, help="rows (tokens) for the bandwidth runs")
    ap.add_argument("--decode-rows", type=int, default=8, help="rows for the CUDA-graph latency runs")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --smoke with TRITON_INTERPRET=1 on CPU)")
        return 2
    dtype = getattr(torch, args.dtype)
    rows = 33 if args.smoke else args.rows
    rows_out = []
    header = (
        f"{'kernel':28s} {'rows':>6s} {'MB':>8s} {'fused ms':>9s} {'GB/s':>7s} {'%peak':>6s} "
        f"{'unfused ms':>10s} {'GB/s':>7s} {'speedup':>7s} | {'decode us fused/unfused':>24s}"
    )
    print(header)
    for name, make in cases(dtype, device, args.smoke).items():
        fused, unfused, nbytes = make(rows)
        torch.testing.assert_close(_first(fused()), _first(unfused()), rtol=2e-2, atol=2e-2)  # sanity
        tf, tu = bench_ms(fused), bench_ms(unfused)
        del fused, unfused
        f_d, u_d, _ = make(args.decode_rows)
        gf, gu = (graph_us([f_d] * 100, iters=5), graph_us([u_d] * 100, iters=5)) if device == "cuda" else (None, None)
        del f_d, u_d
        torch.cuda.empty_cache() if device == "cuda" else None
        row = {
            "kernel": name,
            "rows": rows,
            "bytes": nbytes,
            "dtype": args.dtype,
            "fused_ms": tf,
            "fused_GBps": nbytes / tf / 1e6,
            "fused_frac_of_peak": nbytes / tf / 1e-3 / PEAK_READ,
            "unfused_ms": tu,
            "unfused_GBps": nbytes / tu / 1e6,
            "speedup": tu / tf,
            "decode_rows": args.decode_rows,
            "decode_fused_us": gf,
            "decode_unfused_us": gu,
        }
        rows_out.append(row)
        dec = f"{gf:.1f} / {gu:.1f}" if gf is not None else "-"
        print(
            f"{name:28s} {rows:6d} {nbytes / 1e6:8.1f} {tf:9.3f} {row['fused_GBps']:7.0f} "
            f"{100 * row['fused_frac_of_peak']:5.1f}% {tu:10.3f} {row['unfused_GBps']:7.0f} {row['speedup']:6.2f}x | "
            f"{dec:>24s}",
            flush=True,
        )
    dev = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"device: {dev}; peak read {PEAK_READ / 1e12:.2f} TB/s; target: fused >= 80% of peak")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_kernels.json").write_text(
            json.dumps(
                {"device": dev, "torch": torch.__version__, "peak_read_Bps": PEAK_READ, "results": rows_out}, indent=1
            )
        )
    return 0


def _first(out):
    return out[-1] if isinstance(out, (tuple, list)) else out


# ==== section attention =========================================================================
H, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
PEAK_TFLOPS, PEAK_TBS = 803.0, 4.33
PREFILL_TARGET = 0.5  # of PEAK_TFLOPS, at S = 2048


def rand(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def graph_ms(fn, rep=100):
    """bench_ms of one fn() call captured in a CUDA graph and replayed (L2 still flushed before
    each replay): the call's GPU time without its host-side launch cost, which do_bench counts
    whenever the host takes longer to launch the call than the GPU takes to flush the L2."""
    if SMOKE:
        return bench_ms(fn, rep)
    graph, _ = capture(fn)
    return bench_ms(graph.replay, rep)


def host_us(fn, calls=20):
    """Host microseconds per fn() call, the calls queued back to back (the GPU is slower)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def try_ms(fn, rep=100, timer=None):
    """bench_ms, or None when this baseline/config cannot run here (reported as '-')."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    try:
        return (timer or bench_ms)(fn, rep)
    except (RuntimeError, ValueError, OutOfResources, CompilationError) as e:  # no such SDPA backend; too much smem
        print(f"    (skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None


# ---- prefill --------------------------------------------------------------------------------
def prefill_inputs(B, S):
    q, k, v = rand(B, H, S, D), rand(B, HKV, S, D), rand(B, HKV, S, D)
    k_cache, v_cache = rand(B, HKV, S, D), rand(B, HKV, S, D)
    return q, k, v, k_cache, v_cache, torch.zeros(B, dtype=torch.int64, device=DEVICE)


def prefill_flops(B, S):
    return 4 * B * H * D * S * (S + 1) / 2


def sdpa_backend(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))


def variant_configs():
    """The prefill variant's candidate rows at this head_dim (the smoke test: the table's row with
    the variant's keys, as the first sm_90 candidate is)."""
    if SMOKE:
        return [dict(A.attention_config("prefill", D, "default"), TMA=True, DEFER_PV=True)]
    return A.PREFILL_VARIANTS.get(("sm_90", D), [])


def bench_prefill(B, S, config=None, baselines=True, rep=100, label="table"):
    q, k, v, kc, vc, pos = prefill_inputs(B, S)
    row = dict(
        kind="prefill", B=B, S=S, label=label, config=config or A.attention_config("prefill", D, A.arch_of(q.device))
    )
    call = lambda: A.prefill_attention(q, k, v, kc, vc, pos, D**-0.5, config=config)  # noqa: E731
    row["dsc_ms"] = try_ms(call, rep)
    if not SMOKE and row["dsc_ms"] is not None:
        row["dsc_graph_ms"] = try_ms(call, rep, timer=graph_ms)
        row["dsc_host_us"] = host_us(call)
    if baselines and not SMOKE:
        kx, vx = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)  # [B, H, S, D]
        for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):

            def run(name=name):
                with sdpa_backend(name):
                    return F.scaled_dot_product_attention(q, kx, vx, is_causal=True, scale=D**-0.5)

            key = f"sdpa_{name.split('_')[0].lower()}"
            row[f"{key}_ms"] = try_ms(run, rep)
            if row[f"{key}_ms"] is not None:
                row[f"{key}_graph_ms"] = try_ms(run, rep, timer=graph_ms)
    flops = prefill_flops(B, S)
    for key in [k for k in row if k.endswith("_ms")]:
        ms = row[key]
        row[key.replace("_ms", "_tflops")] = None if ms is None else flops / ms / 1e9
    return row


# ---- decode ---------------------------------------------------------------------------------
def decode_bytes(B, ctx):
    return 2 * B * HKV * ctx * D * DTYPE.itemsize


def bench_decode(B, ctx, Smax=None, config=None, baselines=True, graph=True, rep=100):
    Smax = Smax or ctx
    q, k, v = rand(B, H, 1, D), rand(B, HKV, 1, D), rand(B, HKV, 1, D)
    kc, vc = rand(B, HKV, Smax, D), rand(B, HKV, Smax, D)
    pos = torch.full((B,), ctx - 1, dtype=torch.int64, device=DEVICE)
    row = dict(
        kind="decode", B=B, ctx=ctx, Smax=Smax, config=config or A.attention_config("decode", D, A.arch_of(q.device))
    )
    row["splits"] = A.decode_num_splits(B, HKV, Smax, row["config"], A.sm_count(q.device))
    row["dsc_ms"] = try_ms(lambda: A.decode_attention(q, k, v, kc, vc, pos, D**-0.5, config=config), rep)
    if graph and not SMOKE and row["dsc_ms"] is not None:
        row["dsc_graph_ms"] = bench_decode_graph(q, k, v, pos, B, Smax, config, rep)
    if baselines and not SMOKE:
        kv = kc[:, :, :ctx], vc[:, :, :ctx]
        row["sdpa_ms"] = try_ms(lambda: F.scaled_dot_product_attention(q, *kv, scale=D**-0.5, enable_gqa=True), rep)
    nbytes = decode_bytes(B, ctx)
    for key in [k for k in row if k.endswith("_ms")]:
        ms = row[key]
        row[key.replace("_ms", "_tbs")] = None if ms is None else nbytes / ms / 1e9
    return row


def bench_decode_graph(q, k, v, pos, B, Smax, config, rep):
    """Per-call ms of `layers` decode calls over distinct caches, replayed as one CUDA graph."""
    per_layer = 2 * B * HKV * Smax * D * DTYPE.itemsize
    layers = int(max(2, min(32, (8 << 30) // per_layer)))
    caches = [(rand(B, HKV, Smax, D), rand(B, HKV, Smax, D)) for _ in range(layers)]
    g, _ = capture(
        lambda: [A.decode_attention(q, k, v, kc, vc, pos, D**-0.5, config=config) for kc, vc in caches],
        torch.device(DEVICE),
        None,
    )
    return bench_ms(g.replay, rep) / layers  # (the graph and the caches go with the frame)


# ---- tables ---------------------------------------------------------------------------------
def fmt(x, spec):
    return "-".rjust(int(spec.split(".")[0] or 0)) if x is None else format(x, spec)


def kernel_tflops(row):
    """A prefill row's TFLOP/s from its graph replay (the eager time where there is none)."""
    return row.get("dsc_graph_tflops") or row["dsc_tflops"]


def print_prefill(rows):
    goal = PREFILL_TARGET * PEAK_TFLOPS
    print(
        f"\nprefill (cache_pos 0), {str(DTYPE)[6:]}, H={H} Hkv={HKV} D={D}; % of {PEAK_TFLOPS:.0f} TFLOP/s, "
        f"target >= {100 * PREFILL_TARGET:.0f}% ({goal:.0f} TFLOP/s)"
    )
    print("  eager: do_bench of the call as launched from Python (host launch cost included when the")
    print("  host is slower than the GPU's L2 flush); graph: the call replayed from a CUDA graph (the")
    print("  kernel's GPU time; target judged here; the SDPA baselines' columns are graph-replayed too);")
    print("  host: launch microseconds per call")
    print(
        f"{'B':>3} {'S':>6} {'config':>8} | {'eager ms':>8} {'TFLOP/s':>8} | {'graph ms':>8} {'TFLOP/s':>8} "
        f"{'%peak':>6} {'target':>6} {'host us':>7} | {'flash ms':>8} {'TFLOP/s':>8} | {'cudnn ms':>8} {'TFLOP/s':>8}"
    )
    for r in rows:
        tflops = kernel_tflops(r)
        pct = None if tflops is None else 100 * tflops / PEAK_TFLOPS
        met = "-" if pct is None else ("met" if tflops >= goal else "MISSED")
        flash = "sdpa_flash_graph" if "sdpa_flash_graph_ms" in r else "sdpa_flash"
        cudnn = "sdpa_cudnn_graph" if "sdpa_cudnn_graph_ms" in r else "sdpa_cudnn"
        print(
            f"{r['B']:>3} {r['S']:>6} {r.get('label', 'table'):>8} | {fmt(r['dsc_ms'], '8.4f')} "
            f"{fmt(r['dsc_tflops'], '8.1f')} | {fmt(r.get('dsc_graph_ms'), '8.4f')} {fmt(tflops, '8.1f')} "
            f"{fmt(pct, '5.1f')}% {met:>6} {fmt(r.get('dsc_host_us'), '7.0f')} | "
            f"{fmt(r.get(flash + '_ms'), '8.4f')} {fmt(r.get(flash + '_tflops'), '8.1f')} | "
            f"{fmt(r.get(cudnn + '_ms'), '8.4f')} {fmt(r.get(cudnn + '_tflops'), '8.1f')}"
            + (f"  {json.dumps(r['config'])}" if r.get("label") == "variant" else "")
        )


def print_decode(rows):
    print(f"\ndecode (S=1), {str(DTYPE)[6:]}, H={H} Hkv={HKV} D={D}; KV bytes read / time, % of {PEAK_TBS} TB/s")
    print(
        f"{'B':>3} {'ctx':>5} {'Smax':>5} {'splits':>6} | {'kernel ms':>9} {'TB/s':>5} {'%peak':>6} | "
        f"{'graph ms':>8} {'TB/s':>5} {'%peak':>6} | {'sdpa ms':>8} {'TB/s':>5}"
    )
    for r in rows:
        pk = None if r["dsc_tbs"] is None else 100 * r["dsc_tbs"] / PEAK_TBS
        pg = None if r.get("dsc_graph_tbs") is None else 100 * r["dsc_graph_tbs"] / PEAK_TBS
        print(
            f"{r['B']:>3} {r['ctx']:>5} {r['Smax']:>5} {r['splits']:>6} | {fmt(r['dsc_ms'], '9.4f')} "
            f"{fmt(r['dsc_tbs'], '5.2f')} {fmt(pk, '5.1f')}% | {fmt(r.get('dsc_graph_ms'), '8.4f')} "
            f"{fmt(r.get('dsc_graph_tbs'), '5.2f')} {fmt(pg, '5.1f')}% | {fmt(r.get('sdpa_ms'), '8.4f')} "
            f"{fmt(r.get('sdpa_tbs'), '5.2f')}"
        )


# ---- sweep ----------------------------------------------------------------------------------
PREFILL_FIRST = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages): tried first, in case the budget runs out
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 4),
    (128, 64, 8, 2),
    (64, 64, 4, 2),
    (64, 128, 4, 2),
    (64, 64, 4, 3),
    (128, 128, 4, 2),
    (128, 32, 8, 3),
]


def prefill_candidates():
    """Prefill launch configs, likeliest first: 8 warps (two warpgroups) need BLOCK_M >= 128;
    stages x (K + V) tiles must fit 227 KB of shared memory (BLOCK_N 128 stops at 3 stages).
    The prefill variant's rows come right after the default's tiles, so that even a short time
    budget measures them side by side."""
    rest = [
        c
        for c in itertools.product((128, 64), (64, 128, 32), (8, 4), (3, 2, 4))
        if not (c[0] == 64 and c[2] == 8) and not (c[1] == 128 and c[3] == 4) and c not in PREFILL_FIRST
    ]
    plain = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in PREFILL_FIRST + rest]
    table = A.attention_config("prefill", D, "sm_90" if not SMOKE else "default")  # what runs today
    first = [table] + [c for c in plain[:1] + variant_configs() if c != table]
    return first + [c for c in plain[1:] if c not in first]


def compare_variants(prefill_rows):
    """Each variant row's TFLOP/s (and the table's tiles without the variant keys) against the
    table's row (the sweep's first), per shape."""
    table = A.attention_config("prefill", D, "sm_90" if not SMOKE else "default")
    base = next((r for r in prefill_rows if r["config"] == table), None)
    tiles = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    variants = [
        r
        for r in prefill_rows
        if r is not base
        and (r["config"].get("TMA") or r["config"].get("DEFER_PV") or all(r["config"][k] == table[k] for k in tiles))
    ]
    if base is None or not variants:
        return []
    print(f"prefill variant vs the table's row {base['config']} (TFLOP/s at B, S):")
    out = []
    for r in variants:
        gains = [(v["B"], v["S"], kernel_tflops(v), kernel_tflops(d)) for v, d in zip(r["rows"], base["rows"])]
        print(
            f"  {r['config']}: "
            + ", ".join(f"B{b} S{s} {x:.1f} vs {y:.1f} ({100 * (x / y - 1):+.1f}%)" for b, s, x, y in gains)
        )
        out.append(
            dict(config=r["config"], rows=[dict(B=b, S=s, variant_tflops=x, default_tflops=y) for b, s, x, y in gains])
        )
    return out


def sweep(deadline):
    """Try candidate configs; return the best prefill and decode config with their rows."""
    prefill_shapes = [(1, 2048), (8, 2048)] if not SMOKE else [(1, 40)]
    prefill_deadline = time.time() + 0.6 * (deadline - time.time())  # the rest is decode's
    prefill_rows = []
    for cfg in prefill_candidates():
        if time.time() > prefill_deadline:
            print("  (sweep time budget spent)")
            break
        rows = [bench_prefill(B, S, cfg, baselines=False, rep=40) for B, S in prefill_shapes]
        if all(r["dsc_ms"] is not None for r in rows):
            score = math.prod(kernel_tflops(r) for r in rows) ** (1 / len(rows))
            prefill_rows.append(dict(config=cfg, score_tflops=score, rows=rows))
            print(f"  prefill {cfg}: geomean {score:.1f} TFLOP/s", flush=True)

    decode_shapes = [(1, 8192), (8, 4096), (32, 8192), (64, 2048)] if not SMOKE else [(2, 40)]
    tiles = [
        dict(BLOCK_N=n, num_warps=w, num_stages=s, PROGRAMS_PER_SM=2, MIN_SPLIT=256)
        for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
        if not (n == 32 and w == 8)
    ]
    decode_rows = []

    def try_decode(cfg):
        # scored on CUDA-graph replays, as the runtime runs it: eager timings at batch 1 are
        # mostly launch cost (an H200: 66 us eager against 23 us replayed at 8192 tokens)
        rows = [bench_decode(B, ctx, config=cfg, baselines=False, graph=not SMOKE, rep=40) for B, ctx in decode_shapes]
        key = "dsc_tbs" if SMOKE else "dsc_graph_tbs"
        if all(r.get(key) is not None for r in rows):
            score = math.prod(r[key] for r in rows) ** (1 / len(rows))
            decode_rows.append(dict(config=cfg, score_tbs=score, rows=rows))
            print(f"  decode {cfg}: geomean {score:.2f} TB/s", flush=True)

    for cfg in tiles:
        if time.time() > deadline:
            print("  (sweep time budget spent)")
            break
        try_decode(cfg)
    if decode_rows:
        best_tile = max(decode_rows, key=lambda r: r["score_tbs"])["config"]
        for ppsm, min_split in itertools.product((1, 2, 4, 8), (128, 256, 512)):
            if time.time() > deadline:
                break
            if (ppsm, min_split) != (2, 256):
                try_decode(dict(best_tile, PROGRAMS_PER_SM=ppsm, MIN_SPLIT=min_split))
    variant_vs_default = compare_variants(prefill_rows)
    best_p = max(prefill_rows, key=lambda r: r["score_tflops"], default=None)
    best_d = max(decode_rows, key=lambda r: r["score_tbs"], default=None)
    return dict(
        prefill=prefill_rows,
        decode=decode_rows,
        best_prefill=best_p,
        best_decode=best_d,
        prefill_variant_vs_default=variant_vs_default,
    )


def short_context_sweep():
    """`--short`: batch-1 decode at the contexts a chat turn decodes at (128-4096 keys, a cache of
    SHORT_SMAX slots, default 4096), Llama-8B heads at tp 1 and 4 (8 and 2 kv heads), graph-timed
    per call, for a few (MIN_SPLIT, SPLIT_FLOOR, num_stages, PRE_N, num_warps) rows: SPLIT_FLOOR decides
    how many programs share a short context (at 256 keys and a floor of 256 one program per kv
    head walks them all), MIN_SPLIT the grid. Returns the rows; prints per config."""
    global H, HKV
    saved = H, HKV
    table = A.attention_config("decode", D, A.arch_of(torch.device(DEVICE)))
    # the table's row; without its preloaded tile (PRE_N 0), at 4 warps (a narrower row) and at
    # the row's warps; a 64-key preload; a row without SPLIT_FLOOR; a grid of smaller splits
    cands = [
        table,
        dict(table, PRE_N=0, num_warps=4),
        dict(table, PRE_N=0),
        dict(table, PRE_N=64),
        dict(table, MIN_SPLIT=256, SPLIT_FLOOR=256, PRE_N=0, num_warps=4),
        dict(table, MIN_SPLIT=128, SPLIT_FLOOR=128, num_stages=2),
    ]
    rows = []
    smax = int(os.environ.get("SHORT_SMAX", "4096"))
    print(f"decode at short contexts, B=1, Smax={smax}, per call in a graph of 32 (us); table row {table}")
    for hkv in (8, 2):
        H, HKV = 4 * hkv, hkv
        for cfg in cands:
            t = {
                ctx: bench_decode(1, ctx, smax, config=cfg, baselines=False, rep=40)
                for ctx in (128, 256, 512, 1024, 2048, 4096)
                if ctx <= smax
            }
            us = {ctx: None if r.get("dsc_graph_ms") is None else 1e3 * r["dsc_graph_ms"] for ctx, r in t.items()}
            rows.append(dict(Hkv=hkv, config=cfg, table=cfg is table, us=us))
            print(
                f"  Hkv {hkv} {'table ' if cfg is table else ''}{cfg}: "
                + "  ".join(f"ctx {c} {fmt(v, '6.2f')}" for c, v in us.items()),
                flush=True,
            )
    H, HKV = saved
    return rows


def attention_main():
    global H, HKV, D, DTYPE, DEVICE
    t0 = time.time()
    if SMOKE:
        H, HKV, D, DTYPE, DEVICE = 6, 2, 16, torch.float16, "cpu"
        prefill_shapes, decode_shapes = [(1, 40), (2, 33)], [(1, 64, None), (3, 40, None), (3, 16, 64)]
    else:
        if "--heads" in sys.argv:  # e.g. --heads 25,25,64: GPT-2-XL's heads (one per kv head, head_dim 64)
            H, HKV, D = (int(n) for n in sys.argv[sys.argv.index("--heads") + 1].split(","))
        print(
            f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {A._triton().__version__}  "
            f"SMs {A.sm_count(torch.device('cuda'))}  heads {H} / kv heads {HKV} / head_dim {D}"
        )
        prefill_shapes = [(1, 2048), (8, 2048)]
        decode_shapes = [(B, ctx, None) for ctx in (1024, 2048, 4096, 8192) for B in (1, 8, 32, 64)]
        decode_shapes += [(B, ctx, 8192) for B in (8, 32) for ctx in (1024, 2048)]
    if "--short" in sys.argv:  # only the short-context decode sweep
        rows = short_context_sweep() if not SMOKE else []
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "bench_attention_short.json").write_text(json.dumps(rows, indent=1, default=str))
        return
    if "--prefill-variants" in sys.argv:  # the table's prefill row and every variant row, side by side
        extra = [json.loads(a) for a in sys.argv[1:] if a.startswith("{")]
        configs = variant_configs() + extra
        # every config compiled and run once before any is timed (the first timed B1 run of a
        # freshly compiled config reads 20-50% low)
        for cfg in [None] + configs:
            for B, S in prefill_shapes:
                q, k, v, kc, vc, pos = prefill_inputs(B, S)
                try_ms(lambda: A.prefill_attention(q, k, v, kc, vc, pos, D**-0.5, config=cfg), rep=1)
        rows = [bench_prefill(B, S) for B, S in prefill_shapes]
        rows += [
            bench_prefill(B, S, cfg, baselines=False, label="variant") for cfg in configs for B, S in prefill_shapes
        ]
        print_prefill(rows)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "bench_prefill_variants.json").write_text(json.dumps(rows, indent=1, default=str))
        return
    prefill = [bench_prefill(B, S) for B, S in prefill_shapes]
    prefill += [
        bench_prefill(B, S, cfg, baselines=False, label="variant")
        for cfg in variant_configs()[:1]
        for B, S in prefill_shapes
    ]
    print_prefill(prefill)
    decode = [bench_decode(B, ctx, Smax) for B, ctx, Smax in decode_shapes]
    print_decode(decode)
    result = dict(
        device="cpu (smoke)" if SMOKE else torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=A._triton().__version__,
        shapes=dict(H=H, Hkv=HKV, D=D, dtype=str(DTYPE)),
        peaks=dict(tflops=PEAK_TFLOPS, tbs=PEAK_TBS),
        prefill=prefill,
        decode=decode,
    )
    if "--sweep" in sys.argv:
        print("\nsweep:")
        result["sweep"] = s = sweep(deadline=t0 + 240)
        if s["best_prefill"]:
            print(
                f"best prefill config (geomean over B=1,8 at S=2048: {s['best_prefill']['score_tflops']:.1f} TFLOP/s):"
                f"\n    ('sm_90', {D}): {s['best_prefill']['config']},"
            )
            if s["best_prefill"]["config"].get("TMA") or s["best_prefill"]["config"].get("DEFER_PV"):
                print(
                    "    (a prefill variant row: switch it on only once tests/gpu/test_gpu_attention.py passes at it)"
                )
        if s["best_decode"]:
            print(
                f"best decode config (geomean {s['best_decode']['score_tbs']:.2f} TB/s):"
                f"\n    ('sm_90', {D}): {s['best_decode']['config']},"
            )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_attention.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\n({time.time() - t0:.0f} s)")


# ==== section fused-decode ==========================================================================
W8A16_SWIGLU_SHAPES = [(28672, 4096), (14336, 4096), (7168, 4096), (16384, 2048)]  # Llama-8B tp 1/2/4, Llama-1B
W8A16_ROW_PARALLEL_SHAPES = [(4096, 2048), (4096, 7168), (4096, 1024), (4096, 3584)]  # 8B o/down, tp 2 and 4


def _int8_gate_up(n: int, k: int, group: int | None, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)
    p = INT8.quantize_weight(w, group, symmetric=group is None)
    return p["qweight"], p["scale"], None if group is None else p["zero"], group or k


def time_w8a16_swiglu() -> list[dict]:
    """bf16, one row, per-channel int8: the fused W8A16 gate_up + SwiGLU kernel against the W8A16
    GEMV + swiglu pair, weight copies rotating past L2 (every call reads its weight from HBM)."""
    out = []
    for n, k in W8A16_SWIGLU_SHAPES:
        copies = max(2, math.ceil(3 * 60 * 2**20 / (n * k)))
        ws = [_int8_gate_up(n, k, None, i) for i in range(copies)]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)

        def pair(q, s, z, gs):
            y = INT8.w8a16_matmul(x, q, s, z, None, gs)
            return ACT.swiglu_triton(y[..., : n // 2], y[..., n // 2 :])

        row = {
            "shape": [n, k],
            "copies": copies,
            "config": INT8.w8a16_swiglu_config(n, k, 0, "sm_90"),
            "gemv_then_swiglu_us": graph_us([lambda w=w: pair(*w) for w in ws]),
            "fused_us": graph_us([lambda w=w: INT8.w8a16_gemv_swiglu(x, *w) for w in ws]),
        }
        out.append(row)
        print(
            f"w8a16_swiglu {n}x{k}: W8A16 GEMV + swiglu {row['gemv_then_swiglu_us']:.2f} us, fused "
            f"{row['fused_us']:.2f} us",
            flush=True,
        )
    return out


W8A16_ROW_PARALLEL_SHAPES = [(4096, 2048), (4096, 7168), (4096, 1024), (4096, 3584)]  # 8B o/down, tp 2 and 4


def time_w8a16_push_configs() -> list[dict]:
    """bf16, one row, per-channel int8, at Llama-8B's row-parallel shapes (o_proj, down_proj at
    tp 2 and 4): the W8A16 GEMV with its tuned config against the same GEMV with the config the
    GEMV push kernel takes at 2 and 4 ranks (`w8a16_push_config`'s, tuning rows included, raised by
    `gemv_push_norm_config`: more warps and rows per program so the last program holds the row in
    one pass). The plain GEMV runs both, so the difference is the config's own cost, not the
    push's (the norm's registers come on top)."""
    (COLL,) = checkout_modules("kernels.collectives")

    out = []
    for n, k in W8A16_ROW_PARALLEL_SHAPES:
        copies = max(2, math.ceil(3 * 60 * 2**20 / (n * k)))
        ws = [_int8_gate_up(n, k, None, i) for i in range(copies)]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        tuned = INT8.int8_config("w8a16_gemv", 1, n, k, 0, "sm_90", x_bytes=2)
        row = {"shape": [n, k], "copies": copies, "tuned": tuned}
        for name, cfg in [("tuned", tuned)] + [
            (
                f"push_norm_world{w}",
                {
                    key: v
                    for key, v in COLL.gemv_push_norm_config(COLL.w8a16_push_config(n, k, 0, "sm_90"), n, w).items()
                    if key not in ("CHUNK", "NORM_N", "BLOCK_W")
                },
            )
            for w in (2, 4)
        ]:
            row[f"{name}_config"] = cfg
            row[f"{name}_us"] = graph_us(
                [
                    lambda w=w, c=cfg: INT8.w8a16_matmul(x, w[0], w[1], w[2], None, w[3], kernel="w8a16_gemv", config=c)
                    for w in ws
                ]
            )
        out.append(row)
        print(
            f"w8a16_gemv {n}x{k}: tuned {row['tuned_us']:.2f} us (BLOCK_N {tuned['BLOCK_N']}, {tuned['num_warps']} "
            f"warps); the push configs: 2 ranks {row['push_norm_world2_us']:.2f} us, 4 ranks "
            f"{row['push_norm_world4_us']:.2f} us (BLOCK_N {row['push_norm_world4_config']['BLOCK_N']}, "
            f"{row['push_norm_world4_config']['num_warps']} warps)",
            flush=True,
        )
    return out


def time_linear_swiglu() -> list[dict]:
    """bf16, one row: the fused kernel with its derived config and a small sweep (rows for
    kernels/tuning.json `gemv_swiglu`, BLOCK_N counting outputs) against the GEMV + swiglu pair.
    Weight copies rotate past the 60 MiB L2, so every call reads its weight from HBM."""
    out = []
    for n, k in [(28672, 4096), (14336, 4096), (7168, 4096), (16384, 2048)]:
        copies = max(2, math.ceil(3 * 60 * 2**20 / (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) / 64 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        arch = LAUNCH.arch_of(x.device)
        g_cfg, f_cfg = LIN.gemv_config(n, k, arch), LIN.gemv_swiglu_config(n, k, arch)
        if g_cfg is None:
            continue
        row = {
            "shape": [n, k],
            "copies": copies,
            "gemv_config": g_cfg,
            "fused_config": f_cfg,
            "gemv_then_swiglu_us": graph_us(
                [lambda w=w: ACT.swiglu_triton(*LIN.gemv(x, w, None, g_cfg).chunk(2, -1)) for w in ws]
            ),
            "fused_us": graph_us([lambda w=w: LIN.gemv_swiglu(x, w, f_cfg) for w in ws]),
        }
        tried = {}
        for bn, bk, warps in itertools.product((1, 2, 4), (256, 512, 1024, 2048), (1, 2, 4, 8)):
            if not 8 <= 2 * bn * bk // (32 * warps) <= 64 or bk > k:  # elements per thread
                continue
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
            tried[f"bn{bn}_bk{bk}_w{warps}"] = graph_us([lambda w=w: LIN.gemv_swiglu(x, w, cfg) for w in ws])
        best = min(tried, key=tried.get)
        row.update(tried=tried, best=best, best_us=tried[best])
        out.append(row)
        print(
            f"linear_swiglu {n}x{k}: GEMV + swiglu {row['gemv_then_swiglu_us']:.2f} us, fused {row['fused_us']:.2f} us "
            f"({f_cfg}), best {best} {tried[best]:.2f} us",
            flush=True,
        )
        del ws
    return out


def time_rotary_attention() -> list[dict]:
    """bf16 decode at batch 1, context 128 and 4096: the fused kernel against dsc.rotary's kernel
    then the decode kernel (Llama-8B heads at tp 1 and 4)."""
    out, D = [], 128
    for H, Hkv in [(32, 8), (8, 2)]:
        for ctx in (128, 4096):
            q = torch.randn(1, H, 1, D, device="cuda").to(torch.bfloat16)
            k, v = (torch.randn(1, Hkv, 1, D, device="cuda").to(torch.bfloat16) for _ in range(2))
            cos, sin = (torch.rand(1, 1, D, device="cuda").to(torch.bfloat16) for _ in range(2))
            kc, vc = (torch.randn(2, Hkv, 8192, D, device="cuda").to(torch.bfloat16) for _ in range(2))
            pos = torch.tensor([ctx], device="cuda")
            fused = graph_us([lambda: A.decode_attention(q, k, v, kc, vc, pos, D**-0.5, rotary=(cos, sin))] * 16)
            unfused = graph_us(
                [lambda: A.decode_attention(*ROT.rotary_triton(q, k, cos, sin), v, kc, vc, pos, D**-0.5)] * 16
            )
            out.append({"heads": [H, Hkv], "context": ctx, "fused_us": fused, "rotary_then_attention_us": unfused})
            print(
                f"rotary_attention heads {H}/{Hkv} context {ctx}: fused {fused:.2f} us, "
                f"rotary + attention {unfused:.2f} us",
                flush=True,
            )
    return out


def fused_decode_main() -> int:
    if not torch.cuda.is_available():
        print("fused-decode: needs a CUDA device")
        return 2
    res = {
        "w8a16_swiglu": time_w8a16_swiglu(),
        "w8a16_push_configs": time_w8a16_push_configs(),
        "linear_swiglu": time_linear_swiglu(),
        "rotary_attention": time_rotary_attention(),
    }
    write_json("bench_fused_decode.json", res)
    return 0


# ==== section paged =================================================================================
def as_pool(cache, perm, block_size: int):
    """A static cache [B, Hkv, ctx, D] as a pool [B * ctx / block_size, Hkv, block_size, D] whose
    block i is the cache's block perm[i] (sequence b's j-th block: b * ctx / block_size + j)."""
    B, Hkv, ctx, D = cache.shape
    blocks = cache.view(B, Hkv, ctx // block_size, block_size, D).transpose(1, 2).reshape(-1, Hkv, block_size, D)
    return blocks[perm].contiguous()


def time_us(fns) -> float:
    """us per call of fns replayed from one CUDA graph (smoke: one eager round on the CPU)."""
    if SMOKE:
        return 1e3 * bench_ms(lambda: [f() for f in fns]) / len(fns)
    return graph_us(fns)


def bench_paged(B: int, ctx: int, block_size: int) -> dict:
    """One decode step's attention per layer: the static decode kernel and the paged one."""
    g = torch.Generator().manual_seed(B * 7919 + ctx)
    per_layer = 2 * B * HKV * ctx * D * DTYPE.itemsize
    layers = 1 if SMOKE else int(max(2, min(32, (4 << 30) // per_layer)))  # distinct caches, past the L2
    q, k, v = rand(B, H, 1, D), rand(B, HKV, 1, D), rand(B, HKV, 1, D)
    pos = torch.full((B,), ctx - 1, dtype=torch.int64, device=DEVICE)
    caches = [(rand(B, HKV, ctx, D), rand(B, HKV, ctx, D)) for _ in range(layers)]
    # one block order for the step (every layer's pool holds a sequence's blocks at the same ids)
    perm = torch.randperm(B * ctx // block_size, generator=g).to(DEVICE)
    pools = [(as_pool(kc, perm, block_size), as_pool(vc, perm, block_size)) for kc, vc in caches]
    tables = torch.argsort(perm).view(B, ctx // block_size).to(torch.int32)  # [B, max_blocks]
    seq = torch.arange(B, device=DEVICE)
    step = dict(
        slot_mapping=(tables[seq, (ctx - 1) // block_size] * block_size + (ctx - 1) % block_size),
        query_start=seq.to(torch.int32),
        query_lens=torch.ones(B, dtype=torch.int32, device=DEVICE),
        cache_lens=torch.full((B,), ctx - 1, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
    )
    # the step's rows: q [1, H, B, D], k / v [1, Hkv, B, D] (views of the static kernel's inputs)
    qp, kp, vp = (x.permute(2, 1, 0, 3) for x in (q, k, v))

    def static(kc, vc):
        return lambda: A.decode_attention(q, k, v, kc, vc, pos, D**-0.5)

    def paged_call(kpool, vpool):
        return lambda: PAGED.paged_attention_triton(
            qp,
            kp,
            vp,
            kpool,
            vpool,
            step["slot_mapping"],
            step["query_start"],
            step["query_lens"],
            step["cache_lens"],
            step["block_tables"],
            D**-0.5,
        )

    diff = (static(*caches[0])()[:, 0].float() - paged_call(*pools[0])()[0].float()).abs().max().item()
    row = dict(
        B=B,
        ctx=ctx,
        block_size=block_size,
        layers=layers,
        splits=A.decode_num_splits(
            B, HKV, ctx, A.attention_config("decode", D, A.arch_of(q.device)), A.sm_count(q.device)
        ),
        paged_splits=PAGED.paged_decode_splits(
            B, HKV, ctx, PAGED.paged_attention_config("decode", D, A.arch_of(q.device)), A.sm_count(q.device)
        ),
        max_abs_diff=diff,
    )
    row["static_us"] = time_us([static(kc, vc) for kc, vc in caches])
    row["paged_us"] = time_us([paged_call(kpool, vpool) for kpool, vpool in pools])
    row["paged_over_static"] = row["paged_us"] / row["static_us"]
    print(
        f"{B:>4} {ctx:>5} {row['splits']:>3}/{row['paged_splits']:<3} {row['static_us']:>10.2f} "
        f"{row['paged_us']:>9.2f} {row['paged_over_static']:>12.3f} {diff:>11.2e}",
        flush=True,
    )
    return row


def paged_main(argv) -> int:
    global H, HKV, D, DTYPE, DEVICE
    ap = argparse.ArgumentParser(prog="bench_kernels.py paged")
    ap.add_argument("--block-size", type=int, default=16, choices=(16, 32), help="tokens per KV block")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.smoke:
        H, HKV, D, DTYPE, DEVICE = 6, 2, 16, torch.float16, "cpu"
        shapes = [(1, 64), (3, 32)]
    elif not torch.cuda.is_available():
        print("no CUDA device (use --smoke with TRITON_INTERPRET=1 on CPU)")
        return 2
    else:
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {A._triton().__version__}")
        shapes = [(B, ctx) for ctx in (512, 1024, 2048) for B in (1, 8, 32, 64, 128)]
    print(
        f"\npaged decode (T == N), {str(DTYPE)[6:]}, H={H} Hkv={HKV} D={D}, block size {args.block_size}; "
        f"us per call from a CUDA graph of the layers' calls"
    )
    print(
        f"{'B':>4} {'ctx':>5} {'splits':>7} {'static us':>10} {'paged us':>9} {'paged/static':>12} {'max |diff|':>11}"
    )
    rows = [bench_paged(B, ctx, args.block_size) for B, ctx in shapes]
    write_json(
        "bench_paged.json",
        dict(
            device="cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
            shapes=dict(H=H, Hkv=HKV, D=D, dtype=str(DTYPE)),
            rows=rows,
        ),
    )
    worst = max(rows, key=lambda r: r["max_abs_diff"])["max_abs_diff"]
    if worst > 0.05:
        print(f"paged and static outputs differ by up to {worst:.3g}")
        return 1
    return 0


def write_json(name: str, data) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], name).write_text(json.dumps(data, indent=1, default=str))


SECTIONS = ("fused", "attention", "fused-decode", "paged")


def main() -> int:
    section = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "fused"
    if section not in SECTIONS:
        print(f"error: section: {section!r} is not one of {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    argv = sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == section else sys.argv[1:]
    if section == "fused":
        return fused_main(argv)
    if section == "attention":
        return attention_main() or 0
    if section == "paged":
        return paged_main(argv)
    return fused_decode_main()


if __name__ == "__main__":
    sys.exit(main())
