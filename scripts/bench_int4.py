"""Benchmark --int4 (W4A16) on one GPU: the kernels at Llama-8B's linears, then a whole artifact.

    python scripts/bench_int4.py gemm                      # every config checked, then timed; bf16 alongside
    python scripts/bench_int4.py e2e --work build/int4     # random Llama-8B checkpoint, --int4 artifact, dsc bench
    TRITON_INTERPRET=1 python scripts/bench_int4.py gemm --smoke   # no GPU: the code path at tiny shapes

gemm: x [M, K] @ dequant(W)^T for (K, N) of Llama-8B's projections (q/k/v fused, o, gate/up
fused, down), group 128: at M = 1 each GEMV config of a small sweep (checked against the
reference, SQNR >= 40 dB, before it is timed), at M = 8 and 2,048 the default mma config; bf16
cuBLAS on the same shapes; bandwidth of the weight bytes read. e2e: `dsc bench` of the --int4
artifact at batches 1 and 8 (the bf16 artifact's numbers: scripts/bench_fp8.py e2e). Writes
$OUT/bench_int4_*.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from timing import bench_ms

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GEMV_SWEEP = [
    {"kernel": "w4a16_gemv", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
    for bn, bk, w in itertools.product((4, 8, 16, 32), (64, 128), (2, 4))
]


def _out(name: str, data) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"bench_int4_{name}.json").write_text(json.dumps(data, indent=1))


def _sqnr(ref, got) -> float:
    noise = (ref.double() - got.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


def gemm(smoke: bool = False) -> None:
    from dsc.kernels import int4

    dev = "cpu" if smoke else "cuda"
    shapes, ms, sweep = (
        ({"tiny": (256, 48)}, (1, 5, 40), GEMV_SWEEP[:2]) if smoke else (SHAPES, (1, 8, 2048), GEMV_SWEEP)
    )
    dtype = torch.float32 if smoke else torch.bfloat16
    rows, g = [], torch.Generator(device=dev).manual_seed(0)
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device=dev, generator=g, dtype=dtype) / k**0.5
        p = int4.quantize_weight(w, 128)
        wbytes = p["qweight"].numel() + 4 * p["scale"].numel()
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=g, dtype=dtype)
            ref = int4.linear_w4a16_reference(x.float(), p["qweight"], p["scale"], p["min"], None, 128)
            t16 = bench_ms(lambda: x @ w.T)
            configs = sweep if m == 1 else [int4.w4a16_config(m, n, k, 128)]
            for cfg in configs:
                run = lambda: int4.w4a16_matmul(x, p["qweight"], p["scale"], p["min"], None, 128, config=cfg)  # noqa: E731
                s = _sqnr(ref, run().float())
                t = bench_ms(run) if s >= 40 else float("nan")
                rows.append(
                    {
                        "linear": name,
                        "M": m,
                        "K": k,
                        "N": n,
                        "config": cfg,
                        "sqnr_db": s,
                        "int4_ms": t,
                        "bf16_ms": t16,
                        "speedup": t16 / t,
                        "weight_GBps": wbytes / t / 1e6,
                    }
                )
            best = min(
                (r for r in rows if r["linear"] == name and r["M"] == m and r["sqnr_db"] >= 40),
                key=lambda r: r["int4_ms"],
                default=None,
            )
            if best:
                print(
                    f"{name:8s} M={m:5d} K={k:5d} N={n:5d}  bf16 {t16 * 1e3:8.1f} us  "
                    f"int4 {best['int4_ms'] * 1e3:8.1f} us "
                    f"x{best['speedup']:.2f} ({best['weight_GBps']:.0f} GB/s)  {best['config']}",
                    flush=True,
                )
            bad = [r for r in rows if r["linear"] == name and r["M"] == m and r["sqnr_db"] < 40]
            for r in bad:
                print(f"  WRONG: {r['config']} SQNR {r['sqnr_db']:.1f} dB", flush=True)
    _out("gemm", rows)


def e2e(work: Path, layers: int | None) -> None:
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    ckpt, art = work / "ckpt", work / "int4"
    t = time.perf_counter()
    if not (ckpt / "config.json").exists():
        make_random_checkpoint(
            ckpt,
            "llama-8b",
            dtype="bfloat16",
            device="cuda",
            tokenizer=False,
            **({"num_hidden_layers": layers} if layers else {}),
        )
    print(f"checkpoint in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    if not (art / "manifest.json").exists():
        dsc.compile(str(ckpt), art, max_batch=8, max_seq=1024, int4=True)
    print(f"int4: compiled in {time.perf_counter() - t:.1f} s", flush=True)
    js = work / "bench-int4.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dsc",
            "bench",
            str(art),
            "--batch",
            "1",
            "--batch",
            "8",
            "--prefill",
            "128",
            "--json",
            str(js),
        ],
        check=True,
    )
    _out("e2e", json.loads(js.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["gemm", "e2e"])
    ap.add_argument("--work", default=str(ROOT / "build" / "int4"))
    ap.add_argument("--layers", type=int, default=None, help="override the checkpoint's layer count")
    ap.add_argument("--smoke", action="store_true", help="gemm on the CPU at a tiny shape (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gemm(args.smoke) if args.what == "gemm" else e2e(work, args.layers)


if __name__ == "__main__":
    main()
