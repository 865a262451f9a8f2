"""Benchmark --fp8 against bf16 on one GPU, in the same run: the linears alone, then whole artifacts.

    python scripts/bench_fp8.py gemm                     # the Llama-8B linears: bf16 matmul vs fp8
    python scripts/bench_fp8.py prepare --work build/fp8 # random Llama-8B checkpoint, bf16 and fp8 artifacts
    python scripts/bench_fp8.py e2e --work build/fp8     # dsc bench of both (each in its own process)
    python scripts/bench_fp8.py gemm --smoke             # no GPU: the code path at a tiny shape (the reference)

gemm: x [M, K] @ W^T for (K, N) of Llama-8B's projections (q/k/v fused, o, gate/up fused,
down) at M = 1, 8, 64, 2048: torch's bf16 matmul (cuBLAS) against dsc::linear_fp8 (activation
quantization kernel + cuBLASLt fp8 with row-wise scales), and against _scaled_mm alone; TFLOP/s
and the ratio. e2e: `dsc bench` of the bf16 and the fp8 artifact of the same checkpoint:
prefill of 128 and 2,048 tokens (TFLOP/s from the model's FLOPs: 2 x parameters x tokens plus
attention) and decode ms/step at batches 1, 8, 64; ratios printed. Writes $OUT/bench_fp8_*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from timing import bench_ms

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
MS = (1, 8, 64, 2048)


def _out(name: str, data) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"bench_fp8_{name}.json").write_text(json.dumps(data, indent=1))


def gemm(ms=MS, smoke: bool = False) -> None:
    from dsc.kernels import fp8

    dev = "cpu" if smoke else "cuda"
    shapes = {"tiny": (128, 48)} if smoke else SHAPES
    rows, g = [], torch.Generator(device=dev).manual_seed(0)
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) / k**0.5
        p = fp8.quantize_weight(w)
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            xq, xs = fp8.quantize_activation(x) if smoke else fp8.quantize_rows(x)
            ref = fp8.linear_fp8_reference(x.float(), p["qweight"], p["scale"], None)
            got = torch.ops.dsc.linear_fp8(x, p["qweight"], p["scale"], None).float()
            err = float((got - ref).norm() / ref.norm())
            t16 = bench_ms(lambda: x @ w.T)
            t8 = bench_ms(lambda: torch.ops.dsc.linear_fp8(x, p["qweight"], p["scale"], None))
            if smoke:  # cuBLASLt's fp8 GEMM is the GPU's
                tmm = tfast = float("nan")
            else:
                tmm = bench_ms(
                    lambda: torch._scaled_mm(
                        xq, p["qweight"].t(), scale_a=xs, scale_b=p["scale"].reshape(1, n), out_dtype=torch.bfloat16
                    )
                )
                tfast = bench_ms(
                    lambda: torch._scaled_mm(
                        xq,
                        p["qweight"].t(),
                        scale_a=xs,
                        scale_b=p["scale"].reshape(1, n),
                        out_dtype=torch.bfloat16,
                        use_fast_accum=True,
                    )
                )
            fl = 2 * m * n * k
            rows.append(
                {
                    "linear": name,
                    "M": m,
                    "K": k,
                    "N": n,
                    "bf16_ms": t16,
                    "fp8_ms": t8,
                    "scaled_mm_ms": tmm,
                    "scaled_mm_fast_accum_ms": tfast,
                    "bf16_tflops": fl / t16 / 1e9,
                    "fp8_tflops": fl / t8 / 1e9,
                    "speedup": t16 / t8,
                    "rel_err_vs_reference": err,
                }
            )
            r = rows[-1]
            print(
                f"{name:8s} M={m:5d} K={k:5d} N={n:5d}  bf16 {t16 * 1e3:8.1f} us {r['bf16_tflops']:6.1f} TF/s  "
                f"fp8 {t8 * 1e3:8.1f} us {r['fp8_tflops']:6.1f} TF/s (scaled_mm alone {tmm * 1e3:7.1f} us, "
                f"fast accumulation {tfast * 1e3:7.1f} us)  "
                f"x{r['speedup']:.2f}  err {err:.1e}",
                flush=True,
            )
    _out("gemm", rows)


def prepare(work: Path, layers: int | None) -> None:
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    ckpt = work / "ckpt"
    t = time.perf_counter()
    if not (ckpt / "config.json").exists():
        over = {"num_hidden_layers": layers} if layers else {}
        make_random_checkpoint(ckpt, "llama-8b", dtype="bfloat16", device="cuda", tokenizer=False, **over)
    print(f"checkpoint in {time.perf_counter() - t:.1f} s", flush=True)
    for tag, opts in (("bf16", {}), ("fp8", {"fp8": True})):
        art = work / tag
        t = time.perf_counter()
        if not (art / "manifest.json").exists():
            dsc.compile(str(ckpt), art, max_batch=64, max_seq=2304, **opts)
        print(f"{tag}: compiled in {time.perf_counter() - t:.1f} s", flush=True)


def e2e(work: Path) -> None:
    res = {}
    for tag in ("bf16", "fp8"):
        js = work / f"bench-{tag}.json"
        cmd = [
            sys.executable,
            "-m",
            "dsc",
            "bench",
            str(work / tag),
            "--batch",
            "1",
            "--batch",
            "8",
            "--batch",
            "64",
            "--prefill",
            "128",
            "--prefill",
            "2048",
            "--json",
            str(js),
        ]
        subprocess.run(cmd, check=True)
        res[tag] = json.loads(js.read_text())
    cfg = json.loads((work / "ckpt" / "config.json").read_text())
    h, L, inter, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    params = L * (h * (h + 2 * kv) + h * h + 3 * h * inter)

    def flops(n: int) -> float:  # linears of every token, causal attention, the head at the last token
        return 2 * params * n + L * 2 * h * n * n + 2 * h * V

    lines, summary = [], {}
    for n in ("128", "2048"):
        b, f = res["bf16"]["prefill"][n]["ms"], res["fp8"]["prefill"][n]["ms"]
        summary[f"prefill_{n}"] = {
            "bf16_ms": b,
            "fp8_ms": f,
            "bf16_tflops": flops(int(n)) / b / 1e9,
            "fp8_tflops": flops(int(n)) / f / 1e9,
            "ratio": b / f,
        }
        s = summary[f"prefill_{n}"]
        lines.append(
            f"prefill {n:>5} tokens: bf16 {b:7.2f} ms ({s['bf16_tflops']:.0f} TFLOP/s)  fp8 {f:7.2f} ms "
            f"({s['fp8_tflops']:.0f} TFLOP/s)  fp8/bf16 TFLOP/s x{s['ratio']:.2f}"
        )
    for bsz in ("1", "8", "64"):
        b, f = res["bf16"]["decode"][bsz]["ms_per_step"], res["fp8"]["decode"][bsz]["ms_per_step"]
        summary[f"decode_{bsz}"] = {"bf16_ms": b, "fp8_ms": f, "ratio": b / f}
        lines.append(f"decode batch {bsz:>2}: bf16 {b:6.3f} ms/step  fp8 {f:6.3f} ms/step  x{b / f:.2f}")
    summary["weights_gib"] = {t: res[t]["memory"]["weights"] / 2**30 for t in res}
    lines.append("weights: " + ", ".join(f"{t} {v:.2f} GiB" for t, v in summary["weights_gib"].items()))
    print("\n".join(lines))
    _out("e2e", {"summary": summary, "runs": res})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["gemm", "prepare", "e2e"])
    ap.add_argument("--work", default=str(ROOT / "build" / "fp8"))
    ap.add_argument("--layers", type=int, default=None, help="override the checkpoint's layer count")
    ap.add_argument("--m", default=",".join(map(str, MS)), help="gemm: token counts, comma-separated")
    ap.add_argument("--smoke", action="store_true", help="gemm on the CPU at a tiny shape")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    {
        "gemm": lambda: gemm(tuple(int(v) for v in args.m.split(",")), args.smoke),
        "prepare": lambda: prepare(work, args.layers),
        "e2e": lambda: e2e(work),
    }[args.what]()


if __name__ == "__main__":
    main()
