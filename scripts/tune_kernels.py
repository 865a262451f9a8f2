"""Tune the fused Triton kernels' launch configurations on this GPU and rewrite kernels/tuning.json.

    python scripts/tune_kernels.py                       # ~5 minutes on an H100/H200
    python scripts/tune_kernels.py --out $OUT/tuning.json   # write the table elsewhere (copy it back)
    python scripts/tune_kernels.py --only swiglu,rotary
    TRITON_INTERPRET=1 python scripts/tune_kernels.py --smoke   # code path only, CPU

For every kernel and shape class (the row width rounded up to a power of two; head_dim for
rotary) it times each candidate config at a prefill-sized row count (--rows, bandwidth: the
objective) with timing.bench_ms (triton.testing.do_bench); among the candidates within 3% of the fastest it
keeps the one fastest at a decode-sized row count (--decode-rows). Only the rows of the
kernels it tunes, under this GPU's arch key ("sm_90"), are replaced; everything else in the
table (other arches, other kernels' rows) is kept. The plan (plan_kernels) and the runtime
read the same table, so recompile artifacts after a retune to refresh their plans.
Writes --out (default: $OUT/tuning.json when OUT is set, else kernels/tuning.json) and prints
every candidate's time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
from timing import bench_ms, checkout_modules

ROOT = Path(__file__).resolve().parents[1]


LAUNCH, NORM, ACT, ROT = checkout_modules("kernels.launch", "kernels.norm", "kernels.activation", "kernels.rotary")
WARPS = (1, 2, 4, 8, 16)


def candidates(kernel: str, width: int):
    if kernel in ("add_rmsnorm", "add_layernorm"):
        block = LAUNCH.next_power_of_2(width)
        return [{"num_warps": w} for w in WARPS + (32,) if w * 32 <= block]
    if kernel in ("swiglu", "gelu"):
        return [
            {"BLOCK": b, "num_warps": w}
            for b, w in itertools.product((256, 512, 1024, 2048, 4096), WARPS)
            if w * 32 <= b
        ]
    if kernel == "rotary":
        return [{"BLOCK_H": h, "num_warps": w} for h, w in itertools.product((1, 2, 4, 8, 16, 32), (1, 2, 4, 8))]
    raise ValueError(kernel)


def runner(kernel: str, width: int, rows: int, dtype, device):
    """fn(config) running the kernel once on fixed inputs; and the shape-class key."""
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    if kernel in ("add_rmsnorm", "add_layernorm"):
        x, res, w, b = r(rows, width), r(rows, width), r(width), r(width)
        kind = "rms" if kernel == "add_rmsnorm" else "layer"
        block = LAUNCH.next_power_of_2(width)
        return (
            lambda c: NORM.add_norm_triton(
                kind, x, res, w, b if kind == "layer" else None, 1e-5, config={"BLOCK_N": block, **c}
            )
        ), f"N{block}"
    if kernel == "swiglu":
        gu = r(rows, 2 * width)
        return (
            lambda c: ACT.swiglu_triton(gu[:, :width], gu[:, width:], config=c)
        ), f"N{LAUNCH.next_power_of_2(width)}"
    if kernel == "gelu":
        x = r(rows, width)
        return (lambda c: ACT.gelu_triton(x, "tanh", config=c)), f"N{LAUNCH.next_power_of_2(width)}"
    if kernel == "rotary":
        H, HKV, D = 32, 8, width
        qkv = r(1, rows, (H + 2 * HKV) * D)
        q = qkv[..., : H * D].view(1, rows, H, D).transpose(1, 2)
        k = qkv[..., H * D : (H + HKV) * D].view(1, rows, HKV, D).transpose(1, 2)
        cos, sin = r(1, rows, D), r(1, rows, D)
        return (
            lambda c: ROT.rotary_triton(q, k, cos, sin, config={"BLOCK_D": LAUNCH.next_power_of_2(D // 2), **c})
        ), f"D{D}"
    raise ValueError(kernel)


# kernel -> the widths to tune (their shape classes): Llama 1B/8B/70B, GPT-2-XL, head dims
WIDTHS = {
    "add_rmsnorm": (2048, 4096, 8192),
    "add_layernorm": (1024, 1600, 4096),
    "swiglu": (8192, 14336, 28672),
    "gelu": (4096, 6400, 16384),
    "rotary": (64, 128),
}
SMOKE_WIDTHS = {"add_rmsnorm": (72,), "add_layernorm": (72,), "swiglu": (200,), "gelu": (160,), "rotary": (16,)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--decode-rows", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--only", default="", help="comma-separated kernels (default: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    dtype = getattr(torch, args.dtype)
    arch = LAUNCH.arch_of(torch.device(device)) if device == "cuda" else "default"
    widths = SMOKE_WIDTHS if args.smoke else WIDTHS
    only = set(filter(None, args.only.split(","))) or set(widths)
    out_path = Path(
        args.out or (Path(os.environ["OUT"]) / "tuning.json" if os.environ.get("OUT") else LAUNCH.TUNING_FILE)
    )
    table = json.loads(LAUNCH.TUNING_FILE.read_text())
    tuned: dict[str, dict] = {}
    log = []
    for kernel in sorted(only):
        for width in widths[kernel]:
            big, key = runner(kernel, width, 33 if args.smoke else args.rows, dtype, device)
            small, _ = runner(kernel, width, args.decode_rows, dtype, device)
            cands = candidates(kernel, width)[: 3 if args.smoke else None]
            t_big = {i: bench_ms(lambda c=c: big(c), rep=40, warmup=10) for i, c in enumerate(cands)}
            best = min(t_big.values())
            near = [i for i, t in t_big.items() if t <= 1.03 * best]
            t_small = {i: bench_ms(lambda c=cands[i]: small(c), rep=40, warmup=10) for i in near}
            pick = min(near, key=t_small.__getitem__)
            tuned.setdefault(kernel, {})[key] = cands[pick]
            for i, c in enumerate(cands):
                log.append(
                    {
                        "kernel": kernel,
                        "width": width,
                        "class": key,
                        "config": c,
                        "ms": t_big[i],
                        "decode_ms": t_small.get(i),
                        "picked": i == pick,
                    }
                )
            print(
                f"{kernel:14s} {key:7s} width {width:6d}: {cands[pick]}  {t_big[pick]:.3f} ms "
                f"(worst candidate {max(t_big.values()):.3f} ms)",
                flush=True,
            )
            big = small = None  # frees their buffers (the timing lambdas hold the names)
    section = table.setdefault(arch, {})
    for kernel, classes in tuned.items():
        section.setdefault(kernel, {}).update(classes)
    table[arch] = {k: dict(sorted(v.items(), key=lambda kv: (len(kv[0]), kv[0]))) for k, v in sorted(section.items())}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(table, indent=1) + "\n")
    (out_path.parent / "tune_kernels_log.json").write_text(
        json.dumps(
            {
                "arch": arch,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "rows": args.rows,
                "decode_rows": args.decode_rows,
                "dtype": args.dtype,
                "candidates": log,
            },
            indent=1,
        )
    )
    print(f"wrote {out_path} ({arch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
