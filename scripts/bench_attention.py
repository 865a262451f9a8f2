"""Benchmark the Triton attention kernels against torch SDPA on one GPU.

    python scripts/bench_attention.py            # the tables (about a minute on an H200)
    python scripts/bench_attention.py --sweep    # + sweep the launch configs (adds about 2-3 min)
    python scripts/bench_attention.py --short    # only: batch-1 decode configs at 128-4096 keys
    python scripts/bench_attention.py --prefill-variants  # only: the prefill table row and every variant row
    python scripts/bench_attention.py --prefill-variants --heads 25,25,64  # ... at other heads (default 32,8,128)
    python scripts/bench_attention.py --prefill-variants '{"BLOCK_M": 256, "BLOCK_N": 32, "num_warps": 16, "num_stages": 3, "TMA": true}'
                                      # ... and these rows too (JSON configs, one per argument)
    TRITON_INTERPRET=1 python scripts/bench_attention.py --smoke   # the script's own test on CPU

Shapes: Llama-3-8B attention (32 query heads, 8 kv heads, head_dim 128), bf16.
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
Times: triton.testing.do_bench medians (L2 flushed before every run). Prefill rows are timed
twice: as launched from Python ("eager"), and replayed from a CUDA graph ("graph": the kernel's
GPU time alone; do_bench counts the host's launch cost whenever the host takes longer to launch
a call than the GPU takes to flush the L2, which a 2048-token batch-1 call is short enough for);
the target is judged on the graph time, and the host's launch cost is printed per call. --sweep tries the
candidate launch configs and prints the best, as rows for PREFILL_CONFIGS / DECODE_CONFIGS
(decode candidates scored on graph replays). The prefill table also times the first candidate
row of the prefill variants (kernels/attention.py PREFILL_VARIANTS: TMA tile loads, deferred
p @ v, at tilings the table does not use), and --sweep times the table's own row first, then
the variant rows and the table's tiles without the variant keys, and prints each against the
table's row at the same shapes.
Writes $OUT/bench_attention.json when OUT is set. Self-contained: loads kernels/attention.py
(and runtime/decode.py's graph capture) by path.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from checkout_modules import checkout_modules

ROOT = Path(__file__).resolve().parents[1]
H, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
PEAK_TFLOPS, PEAK_TBS = 803.0, 4.33
PREFILL_TARGET = 0.5  # of PEAK_TFLOPS, at S = 2048 (issue 5)
SMOKE = "--smoke" in sys.argv


A, DECODE = checkout_modules("kernels.attention", "runtime.decode")  # runtime.decode: its `capture_graph`


def bench_ms(fn, rep=100):
    """Median milliseconds of fn()."""
    if SMOKE:  # CPU: one timed run after a warm-up
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rand(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def graph_ms(fn, rep=100):
    """bench_ms of one fn() call captured in a CUDA graph and replayed (L2 still flushed before
    each replay): the call's GPU time without its host-side launch cost, which do_bench counts
    whenever the host takes longer to launch the call than the GPU takes to flush the L2."""
    if SMOKE:
        return bench_ms(fn, rep)
    graph, _ = DECODE.capture_graph(fn, torch.device(DEVICE), None)
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
    row = dict(kind="prefill", B=B, S=S, label=label,
               config=config or A.attention_config("prefill", D, A.arch_of(q.device)))
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
    row = dict(kind="decode", B=B, ctx=ctx, Smax=Smax, config=config or A.attention_config("decode", D, A.arch_of(q.device)))
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
    g, _ = DECODE.capture_graph(lambda: [A.decode_attention(q, k, v, kc, vc, pos, D**-0.5, config=config)
                                         for kc, vc in caches], torch.device(DEVICE), None)
    return bench_ms(g.replay, rep) / layers  # (the graph and the caches go with the frame)


# ---- tables ---------------------------------------------------------------------------------
def fmt(x, spec):
    return "-".rjust(int(spec.split(".")[0] or 0)) if x is None else format(x, spec)


def kernel_tflops(row):
    """A prefill row's TFLOP/s from its graph replay (the eager time where there is none)."""
    return row.get("dsc_graph_tflops") or row["dsc_tflops"]


def print_prefill(rows):
    goal = PREFILL_TARGET * PEAK_TFLOPS
    print(f"\nprefill (cache_pos 0), {str(DTYPE)[6:]}, H={H} Hkv={HKV} D={D}; % of {PEAK_TFLOPS:.0f} TFLOP/s, "
          f"target >= {100 * PREFILL_TARGET:.0f}% ({goal:.0f} TFLOP/s)")
    print("  eager: do_bench of the call as launched from Python (host launch cost included when the")
    print("  host is slower than the GPU's L2 flush); graph: the call replayed from a CUDA graph (the")
    print("  kernel's GPU time; target judged here; the SDPA baselines' columns are graph-replayed too);")
    print("  host: launch microseconds per call")
    print(f"{'B':>3} {'S':>6} {'config':>8} | {'eager ms':>8} {'TFLOP/s':>8} | {'graph ms':>8} {'TFLOP/s':>8} "
          f"{'%peak':>6} {'target':>6} {'host us':>7} | {'flash ms':>8} {'TFLOP/s':>8} | {'cudnn ms':>8} {'TFLOP/s':>8}")
    for r in rows:
        tflops = kernel_tflops(r)
        pct = None if tflops is None else 100 * tflops / PEAK_TFLOPS
        met = "-" if pct is None else ("met" if tflops >= goal else "MISSED")
        flash = "sdpa_flash_graph" if "sdpa_flash_graph_ms" in r else "sdpa_flash"
        cudnn = "sdpa_cudnn_graph" if "sdpa_cudnn_graph_ms" in r else "sdpa_cudnn"
        print(f"{r['B']:>3} {r['S']:>6} {r.get('label', 'table'):>8} | {fmt(r['dsc_ms'], '8.4f')} "
              f"{fmt(r['dsc_tflops'], '8.1f')} | {fmt(r.get('dsc_graph_ms'), '8.4f')} {fmt(tflops, '8.1f')} "
              f"{fmt(pct, '5.1f')}% {met:>6} {fmt(r.get('dsc_host_us'), '7.0f')} | "
              f"{fmt(r.get(flash + '_ms'), '8.4f')} {fmt(r.get(flash + '_tflops'), '8.1f')} | "
              f"{fmt(r.get(cudnn + '_ms'), '8.4f')} {fmt(r.get(cudnn + '_tflops'), '8.1f')}"
              + (f"  {json.dumps(r['config'])}" if r.get("label") == "variant" else ""))


def print_decode(rows):
    print(f"\ndecode (S=1), {str(DTYPE)[6:]}, H={H} Hkv={HKV} D={D}; KV bytes read / time, % of {PEAK_TBS} TB/s")
    print(f"{'B':>3} {'ctx':>5} {'Smax':>5} {'splits':>6} | {'kernel ms':>9} {'TB/s':>5} {'%peak':>6} | "
          f"{'graph ms':>8} {'TB/s':>5} {'%peak':>6} | {'sdpa ms':>8} {'TB/s':>5}")
    for r in rows:
        pk = None if r["dsc_tbs"] is None else 100 * r["dsc_tbs"] / PEAK_TBS
        pg = None if r.get("dsc_graph_tbs") is None else 100 * r["dsc_graph_tbs"] / PEAK_TBS
        print(f"{r['B']:>3} {r['ctx']:>5} {r['Smax']:>5} {r['splits']:>6} | {fmt(r['dsc_ms'], '9.4f')} "
              f"{fmt(r['dsc_tbs'], '5.2f')} {fmt(pk, '5.1f')}% | {fmt(r.get('dsc_graph_ms'), '8.4f')} "
              f"{fmt(r.get('dsc_graph_tbs'), '5.2f')} {fmt(pg, '5.1f')}% | {fmt(r.get('sdpa_ms'), '8.4f')} "
              f"{fmt(r.get('sdpa_tbs'), '5.2f')}")


# ---- sweep ----------------------------------------------------------------------------------
PREFILL_FIRST = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages): tried first, in case the budget runs out
    (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2),
    (64, 64, 4, 2), (64, 128, 4, 2), (64, 64, 4, 3), (128, 128, 4, 2), (128, 32, 8, 3),
]


def prefill_candidates():
    """Prefill launch configs, likeliest first: 8 warps (two warpgroups) need BLOCK_M >= 128;
    stages x (K + V) tiles must fit 227 KB of shared memory (BLOCK_N 128 stops at 3 stages).
    The prefill variant's rows come right after the default's tiles, so that even a short time
    budget measures them side by side."""
    rest = [c for c in itertools.product((128, 64), (64, 128, 32), (8, 4), (3, 2, 4))
            if not (c[0] == 64 and c[2] == 8) and not (c[1] == 128 and c[3] == 4) and c not in PREFILL_FIRST]
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
    variants = [r for r in prefill_rows if r is not base and (
        r["config"].get("TMA") or r["config"].get("DEFER_PV") or all(r["config"][k] == table[k] for k in tiles))]
    if base is None or not variants:
        return []
    print(f"prefill variant vs the table's row {base['config']} (TFLOP/s at B, S):")
    out = []
    for r in variants:
        gains = [(v["B"], v["S"], kernel_tflops(v), kernel_tflops(d)) for v, d in zip(r["rows"], base["rows"])]
        print(f"  {r['config']}: " + ", ".join(f"B{b} S{s} {x:.1f} vs {y:.1f} ({100 * (x / y - 1):+.1f}%)"
                                              for b, s, x, y in gains))
        out.append(dict(config=r["config"], rows=[dict(B=b, S=s, variant_tflops=x, default_tflops=y)
                                                  for b, s, x, y in gains]))
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
    tiles = [dict(BLOCK_N=n, num_warps=w, num_stages=s, PROGRAMS_PER_SM=2, MIN_SPLIT=256)
             for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)) if not (n == 32 and w == 8)]
    decode_rows = []

    def try_decode(cfg):
        # scored on CUDA-graph replays, as the runtime runs it: eager timings at batch 1 are
        # mostly launch cost (session 7: 66 us eager against 23 us replayed at 8192 tokens)
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
    return dict(prefill=prefill_rows, decode=decode_rows, best_prefill=best_p, best_decode=best_d,
                prefill_variant_vs_default=variant_vs_default)


def short_context_sweep():
    """`--short`: batch-1 decode at the contexts a chat turn decodes at (128-4096 keys, a cache of
    SHORT_SMAX slots, default 4096), Llama-8B heads at tp 1 and 4 (8 and 2 kv heads), graph-timed
    per call, for a few (MIN_SPLIT, SPLIT_FLOOR, num_stages, PRE_N, num_warps) rows: SPLIT_FLOOR decides
    how many programs share a short context (at 256 keys and a floor of 256 one program per kv
    head walks them all), MIN_SPLIT the grid. Returns the rows; prints per config."""
    global H, HKV
    saved = H, HKV
    table = A.attention_config("decode", D, A.arch_of(torch.device(DEVICE)))
    # the table's row; without its preloaded tile (PRE_N 0), at 4 warps (session 17's row) and at
    # the row's warps; a 64-key preload; session 8's row (no SPLIT_FLOOR); a grid of smaller splits
    cands = [table, dict(table, PRE_N=0, num_warps=4), dict(table, PRE_N=0), dict(table, PRE_N=64),
             dict(table, MIN_SPLIT=256, SPLIT_FLOOR=256, PRE_N=0, num_warps=4),
             dict(table, MIN_SPLIT=128, SPLIT_FLOOR=128, num_stages=2)]
    rows = []
    smax = int(os.environ.get("SHORT_SMAX", "4096"))
    print(f"decode at short contexts, B=1, Smax={smax}, per call in a graph of 32 (us); table row {table}")
    for hkv in (8, 2):
        H, HKV = 4 * hkv, hkv
        for cfg in cands:
            t = {ctx: bench_decode(1, ctx, smax, config=cfg, baselines=False, rep=40)
                 for ctx in (128, 256, 512, 1024, 2048, 4096) if ctx <= smax}
            us = {ctx: None if r.get("dsc_graph_ms") is None else 1e3 * r["dsc_graph_ms"] for ctx, r in t.items()}
            rows.append(dict(Hkv=hkv, config=cfg, table=cfg is table, us=us))
            print(f"  Hkv {hkv} {'table ' if cfg is table else ''}{cfg}: "
                  + "  ".join(f"ctx {c} {fmt(v, '6.2f')}" for c, v in us.items()), flush=True)
    H, HKV = saved
    return rows


def main():
    global H, HKV, D, DTYPE, DEVICE
    t0 = time.time()
    if SMOKE:
        H, HKV, D, DTYPE, DEVICE = 6, 2, 16, torch.float16, "cpu"
        prefill_shapes, decode_shapes = [(1, 40), (2, 33)], [(1, 64, None), (3, 40, None), (3, 16, 64)]
    else:
        if "--heads" in sys.argv:  # e.g. --heads 25,25,64: GPT-2-XL's heads (one per kv head, head_dim 64)
            H, HKV, D = (int(n) for n in sys.argv[sys.argv.index("--heads") + 1].split(","))
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {A._triton().__version__}  "
              f"SMs {A.sm_count(torch.device('cuda'))}  heads {H} / kv heads {HKV} / head_dim {D}")
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
        # freshly compiled config read 20-50% low: s16-h200/prefill-ws-first)
        for cfg in [None] + configs:
            for B, S in prefill_shapes:
                q, k, v, kc, vc, pos = prefill_inputs(B, S)
                try_ms(lambda: A.prefill_attention(q, k, v, kc, vc, pos, D**-0.5, config=cfg), rep=1)
        rows = [bench_prefill(B, S) for B, S in prefill_shapes]
        rows += [bench_prefill(B, S, cfg, baselines=False, label="variant") for cfg in configs
                 for B, S in prefill_shapes]
        print_prefill(rows)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "bench_prefill_variants.json").write_text(json.dumps(rows, indent=1, default=str))
        return
    prefill = [bench_prefill(B, S) for B, S in prefill_shapes]
    prefill += [bench_prefill(B, S, cfg, baselines=False, label="variant")
                for cfg in variant_configs()[:1] for B, S in prefill_shapes]
    print_prefill(prefill)
    decode = [bench_decode(B, ctx, Smax) for B, ctx, Smax in decode_shapes]
    print_decode(decode)
    result = dict(device="cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=A._triton().__version__, shapes=dict(H=H, Hkv=HKV, D=D, dtype=str(DTYPE)),
                  peaks=dict(tflops=PEAK_TFLOPS, tbs=PEAK_TBS), prefill=prefill, decode=decode)
    if "--sweep" in sys.argv:
        print("\nsweep:")
        result["sweep"] = s = sweep(deadline=t0 + 240)
        if s["best_prefill"]:
            print(f"best prefill config (geomean over B=1,8 at S=2048: {s['best_prefill']['score_tflops']:.1f} TFLOP/s):"
                  f"\n    ('sm_90', {D}): {s['best_prefill']['config']},")
            if s["best_prefill"]["config"].get("TMA") or s["best_prefill"]["config"].get("DEFER_PV"):
                print("    (a prefill variant row: switch it on only once scripts/check_attention_gpu.py passes at it)")
        if s["best_decode"]:
            print(f"best decode config (geomean {s['best_decode']['score_tbs']:.2f} TB/s):"
                  f"\n    ('sm_90', {D}): {s['best_decode']['config']},")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_attention.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
