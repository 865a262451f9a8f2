"""Benchmark the fused Triton kernels (norm, activation, rotary): achieved bandwidth against the
H200's measured read ceiling, and the unfused torch ops they replace, timed in the same run.

    python scripts/bench_kernels.py                 # a few minutes on an H100/H200
    python scripts/bench_kernels.py --rows 8192     # fewer rows (prefill tokens)
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --smoke   # code path only, CPU, meaningless times

Bandwidth = the bytes the op must move (every input read once, every output written once)
/ median time (triton.testing.do_bench, L2 flushed between runs), as a fraction of 4.33 TB/s.
"Unfused" is the chain of torch ops the model runs without dsc (Hugging Face's own code: the
residual add then LlamaRMSNorm's pow/mean/rsqrt/mul/cast; silu then mul; gelu_new's 8 ops;
apply_rotary_pos_emb on q and k), timed the same way on the same tensors, so its "bandwidth"
counts the same useful bytes. A decode-sized row count (--decode-rows, default 8) is also
timed from a CUDA graph of 100 calls: the per-step cost of each variant when launches dominate.
Writes a table to stdout and $OUT/bench_kernels.json when OUT is set.
Shapes: Llama-3-8B (hidden 4096, intermediate 14336, 32/8 heads of 128) in bf16; GELU at GPT-2-XL's
4 x 1600 and at 16384.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from checkout_modules import checkout_modules

ROOT = Path(__file__).resolve().parents[1]
PEAK_READ = 4.33e12  # B/s, measured on the H200 (docs: DESIGN.md)


NORM, ACT, ROT = checkout_modules("kernels.norm", "kernels.activation", "kernels.rotary")


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
        return (lambda: NORM.add_norm_triton("rms", x, res, w, None, 1e-5),
                lambda: hf_rmsnorm(x + res, w, 1e-5), (4 * rows * E + E) * es)

    def rmsnorm(rows):
        x, w = r(rows, E), r(E)
        return (lambda: NORM.add_norm_triton("rms", x, None, w, None, 1e-5),
                lambda: hf_rmsnorm(x, w, 1e-5), (2 * rows * E + E) * es)

    def add_layernorm(rows):
        x, res, w, b = r(rows, E), r(rows, E), r(E), r(E)
        return (lambda: NORM.add_norm_triton("layer", x, res, w, b, 1e-5),
                lambda: F.layer_norm(x + res, (E,), w, b, 1e-5), (4 * rows * E + 2 * E) * es)

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
        k = qkv[..., H * D: (H + HKV) * D].view(1, rows, HKV, D).transpose(1, 2)
        cos, sin = r(1, rows, D), r(1, rows, D)
        return (lambda: ROT.rotary_triton(q, k, cos, sin), lambda: hf_rotary(q, k, cos, sin),
                (2 * rows * (H + HKV) * D + 2 * rows * D) * es)

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


def bench_ms(fn) -> float:
    if not torch.cuda.is_available():
        import time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_us(fn, calls: int = 100) -> float | None:
    """Per-call time of `fn` replayed from a CUDA graph of `calls` calls (launch-bound sizes)."""
    if not torch.cuda.is_available():
        return None
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * calls)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384, help="rows (tokens) for the bandwidth runs")
    ap.add_argument("--decode-rows", type=int, default=8, help="rows for the CUDA-graph latency runs")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --smoke with TRITON_INTERPRET=1 on CPU)")
        return 2
    dtype = getattr(torch, args.dtype)
    rows = 33 if args.smoke else args.rows
    rows_out = []
    header = (f"{'kernel':28s} {'rows':>6s} {'MB':>8s} {'fused ms':>9s} {'GB/s':>7s} {'%peak':>6s} "
              f"{'unfused ms':>10s} {'GB/s':>7s} {'speedup':>7s} | {'decode us fused/unfused':>24s}")
    print(header)
    for name, make in cases(dtype, device, args.smoke).items():
        fused, unfused, nbytes = make(rows)
        torch.testing.assert_close(_first(fused()), _first(unfused()), rtol=2e-2, atol=2e-2)  # sanity
        tf, tu = bench_ms(fused), bench_ms(unfused)
        del fused, unfused
        f_d, u_d, _ = make(args.decode_rows)
        gf, gu = graph_us(f_d), graph_us(u_d)
        del f_d, u_d
        torch.cuda.empty_cache() if device == "cuda" else None
        row = {"kernel": name, "rows": rows, "bytes": nbytes, "dtype": args.dtype,
               "fused_ms": tf, "fused_GBps": nbytes / tf / 1e6, "fused_frac_of_peak": nbytes / tf / 1e-3 / PEAK_READ,
               "unfused_ms": tu, "unfused_GBps": nbytes / tu / 1e6, "speedup": tu / tf,
               "decode_rows": args.decode_rows, "decode_fused_us": gf, "decode_unfused_us": gu}
        rows_out.append(row)
        dec = f"{gf:.1f} / {gu:.1f}" if gf is not None else "-"
        print(f"{name:28s} {rows:6d} {nbytes / 1e6:8.1f} {tf:9.3f} {row['fused_GBps']:7.0f} "
              f"{100 * row['fused_frac_of_peak']:5.1f}% {tu:10.3f} {row['unfused_GBps']:7.0f} {row['speedup']:6.2f}x | {dec:>24s}",
              flush=True)
    dev = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"device: {dev}; peak read {PEAK_READ / 1e12:.2f} TB/s; target: fused >= 80% of peak")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_kernels.json").write_text(json.dumps(
            {"device": dev, "torch": torch.__version__, "peak_read_Bps": PEAK_READ, "results": rows_out}, indent=1))
    return 0


def _first(out):
    return out[-1] if isinstance(out, (tuple, list)) else out


if __name__ == "__main__":
    sys.exit(main())
