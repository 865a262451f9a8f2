"""Tune the batch-1 GEMV (kernels/linear.py) against cuBLAS on this GPU; write kernels/tuning.json rows.

    python scripts/tune_gemv.py --out $OUT          # ~3 minutes on an H200
    python scripts/tune_gemv.py --shapes gpt2-xl --tp 1
    TRITON_INTERPRET=1 python scripts/tune_gemv.py --smoke --device cpu   # code path only

For every linear of the model shapes named (Llama-8B, Llama-1B, GPT-2-XL by default) at each
tensor-parallel degree (the local weight [N, K] of one rank: q/k/v and gate/up fused as dsc
compiles them, lm_head vocab-parallel when tp divides the vocabulary), it times one-row
products x[1, K] @ W.T in the setting a decode step runs them: a CUDA graph of back-to-back
calls, each on its own copy of the weight (copies totalling >= 1 GiB, so nothing is served from
the 50 MB L2), replayed; time per call = replay time / calls. cuBLAS (F.linear, what aten.linear
runs) and every GEMV candidate (BLOCK_N x BLOCK_K x warps) are timed in the same run. The best
candidate is checked against an fp32 matmul, and a tuning row is written only where it is at
least 3% faster than cuBLAS; other shapes keep cuBLAS (no row). Rows of shapes not timed are
kept; other kernels' rows and other arches are untouched.
Writes $OUT/tune_gemv.json (every time) and $OUT/tuning.json (the merged table; copy it to
kernels/tuning.json), and prints a table with the achieved bandwidth of both.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import graph_us, median_s

ROOT = Path(__file__).resolve().parents[1]


def linear_shapes(shape: str, tp: int) -> dict[str, tuple[int, int]]:
    """{linear: (N, K)} of one rank's weights for a model shape of compiler/random_checkpoint.py
    (the sizes read through compiler/architectures.py, so every family's config spelling works;
    a single kv head, Falcon-7B's, is replicated on every rank)."""
    from dsc.compiler.architectures import ARCHITECTURES
    from dsc.compiler.random_checkpoint import SHAPES

    model_type, c = SHAPES[shape]
    arch = ARCHITECTURES[model_type]
    e, i, v = arch.hidden(c), arch.intermediate(c), c["vocab_size"]
    hd = arch.head_dim(c)
    q, kv = arch.heads(c) * hd // tp, arch.kv_heads(c) * hd // min(tp, arch.kv_heads(c))
    if model_type == "gpt2":
        out = {
            "c_attn": (3 * e // tp, e),
            "attn.c_proj": (e, e // tp),
            "c_fc": (4 * e // tp, e),
            "mlp.c_proj": (e, 4 * e // tp),
        }
    elif arch.family == "gpt2":  # LayerNorm, one up projection (Falcon, GPT-J, GPT-NeoX, ...)
        out = {"qkv": (q + 2 * kv, e), "o": (e, q), "up": (i // tp, e), "down": (e, i // tp)}
    else:
        out = {"qkv": (q + 2 * kv, e), "o": (e, q), "gate_up": (2 * i // tp, e), "down": (e, i // tp)}
    out["lm_head"] = (v // tp if v % tp == 0 else v, e)
    return out


def candidates(k: int):
    for bn, bk, w in itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024, 2048), (1, 2, 4, 8)):
        per_thread = bn * bk // (32 * w)
        if 8 <= per_thread <= 64 and bk <= max(128, 1 << (k - 1).bit_length()):
            yield {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
            if bn > 1:
                yield {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "X_ROW": True}


def time_calls(fn, copies: list[torch.Tensor], x: torch.Tensor, graphs: bool, reps: int = 5) -> float:
    """Microseconds per call of fn(x, W) over the weight copies, as a CUDA graph's replay (graphs)
    or as calls queued from Python."""
    calls = [lambda w=w: fn(x, w) for w in copies]
    if x.device.type == "cuda" and graphs:
        return graph_us(calls, iters=1, rounds=reps)
    return 1e6 * median_s(lambda: [c() for c in calls], rounds=reps if x.device.type == "cuda" else 1) / len(copies)


def write_outputs(out: str, name: str, dev: torch.device, results: list, table: dict) -> Path:
    """OUT/name (every timing, with the device) and OUT/tuning.json (the merged table)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    (out / name).write_text(json.dumps({"device": device, "results": results}, indent=1) + "\n")
    (out / "tuning.json").write_text(json.dumps(table, indent=1) + "\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-8b:bfloat16,llama-1b:bfloat16,gpt2-xl:float16")
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cuda; cpu only with --smoke under TRITON_INTERPRET=1")
    ap.add_argument("--smoke", action="store_true", help="one tiny shape, two candidates (code path only)")
    ap.add_argument(
        "--int8",
        action="store_true",
        help="tune the W8A16 GEMV (kernels/int8.py, per-channel int8 weights) instead: rows "
        "'w8a16_gemv' M1_N<n>_K<k> with the best config, timed against the current one",
    )
    args = ap.parse_args()
    from dsc.kernels import linear as L
    from dsc.kernels.launch import TUNING_FILE, arch_of

    dev = torch.device(args.device)
    graphs = dev.type == "cuda"
    arch = arch_of(dev)
    table = json.loads(TUNING_FILE.read_text())
    rows = table.setdefault(arch, {}).setdefault("gemv", {})
    results = []
    jobs = []
    for sd in args.shapes.split(","):
        shape, dtype = sd.split(":")
        for tp in (int(t) for t in args.tp.split(",")):
            for name, nk in linear_shapes(shape, tp).items():
                if not (args.int8 and name == "lm_head"):  # lm_head stays 16-bit by default
                    jobs.append((f"{shape} tp{tp} {name}", nk, getattr(torch, dtype)))
    if args.smoke:
        jobs = [("smoke", (40, 96), torch.float32)]
    if args.int8:
        return tune_int8(args, jobs, table, arch, dev, graphs)
    seen: dict[tuple, dict] = {}
    print(
        f"{'linear':<28} {'N x K':>14} {'MB':>7} {'cuBLAS us':>10} {'TB/s':>5} {'gemv us':>8} {'TB/s':>5} "
        f"{'speedup':>7}  config",
        flush=True,
    )
    t0 = time.perf_counter()
    for label, (n, k), dtype in jobs:
        key = (n, k, dtype)
        if key not in seen:
            nbytes = n * k * dtype.itemsize
            ncopy = 1 if args.smoke else max(2, min(256, (1 << 30) // nbytes))
            g = torch.Generator(device=dev).manual_seed(0)
            copies = [torch.randn(n, k, generator=g, device=dev).div_(k**0.5).to(dtype) for _ in range(ncopy)]
            x = torch.randn(1, k, generator=g, device=dev).to(dtype)
            cublas = time_calls(lambda x, w: F.linear(x, w), copies, x, graphs)
            cands = list(candidates(k))[: 2 if args.smoke else None]
            times = []
            for cfg in cands:
                try:
                    times.append((time_calls(lambda x, w, c=cfg: L.gemv(x, w, None, c), copies, x, graphs), cfg))
                except Exception as e:  # a config Triton cannot build (registers, shared memory)
                    print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
            us, cfg = min(times, key=lambda t: t[0])
            ref = x.float() @ copies[0].float().T
            err = ((L.gemv(x, copies[0], None, cfg).float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                raise SystemExit(f"{label}: the GEMV with {cfg} is wrong (relative error {err:.2e})")
            seen[key] = {
                "N": n,
                "K": k,
                "dtype": str(dtype).removeprefix("torch."),
                "MB": nbytes / 1e6,
                "cublas_us": cublas,
                "gemv_us": us,
                "config": cfg,
                "rel_err": err,
                "all": [{"us": t, **c} for t, c in times],
            }
            del copies
        r = seen[key]
        results.append({"linear": label, **r})

        def bw(us):
            return r["MB"] / us  # MB/us = TB/s

        print(
            f"{label:<28} {f'{n} x {k}':>14} {r['MB']:7.1f} {r['cublas_us']:10.2f} {bw(r['cublas_us']):5.2f} "
            f"{r['gemv_us']:8.2f} {bw(r['gemv_us']):5.2f} {r['cublas_us'] / r['gemv_us']:6.2f}x  {r['config']}",
            flush=True,
        )
    for r in seen.values():
        shape_class = f"N{r['N']}_K{r['K']}"
        if r["gemv_us"] < 0.97 * r["cublas_us"]:
            # EARLY (K-blocks loaded before the PDL wait) is measured in decode steps, not here: kept
            early = {key: v for key, v in rows.get(shape_class, {}).items() if key == "EARLY"}
            rows[shape_class] = {
                **r["config"],
                "us": round(r["gemv_us"], 2),
                "cublas_us": round(r["cublas_us"], 2),
                **early,
            }
        else:
            rows.pop(shape_class, None)
    table[arch]["gemv"] = dict(sorted(rows.items()))
    out = write_outputs(args.out, "tune_gemv.json", dev, results, table)
    print(
        f"{len(seen)} shapes in {time.perf_counter() - t0:.0f}s; rows written for "
        f"{sum(r['gemv_us'] < 0.97 * r['cublas_us'] for r in seen.values())}: {out / 'tuning.json'}"
    )
    return 0


def int8_candidates(k: int):
    for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096), (2, 4, 8)):
        per_thread = bn * bk // (32 * w)  # int8 weights per thread per K-block
        if 16 <= per_thread <= 64 and bk <= max(512, 1 << (k - 1).bit_length()):
            for x_row in (False, True) if bn > 1 else (False,):
                yield {
                    "BLOCK_N": bn,
                    "BLOCK_K": bk,
                    "PREFETCH": False,
                    "FAST_CVT": True,
                    "num_warps": w,
                    "num_stages": 1,
                    **({"X_ROW": True} if x_row else {}),
                }


def tune_int8(args, jobs, table, arch, dev, graphs) -> int:
    """The W8A16 GEMV (per-channel symmetric int8) at each shape: the current config (tuning
    table or built-in default) and every candidate, timed like the 16-bit GEMV."""
    from dsc.kernels import int8 as I

    rows = table.setdefault(arch, {}).setdefault("w8a16_gemv", {})
    results, seen = [], {}
    print(
        f"{'linear':<28} {'N x K':>14} {'MB':>7} {'current us':>10} {'TB/s':>5} {'best us':>8} {'TB/s':>5} "
        f"{'speedup':>7}  config",
        flush=True,
    )
    for label, (n, k), dtype in jobs:
        if (n, k) not in seen:
            ncopy = 1 if args.smoke else max(2, min(256, (1 << 30) // (n * k)))
            g = torch.Generator(device=dev).manual_seed(0)
            w = torch.randn(n, k, generator=g, device=dev)
            p = I.quantize_weight(w)
            copies = [p["qweight"]] + [
                p["qweight"][torch.randperm(n, device=dev, generator=g)] for _ in range(ncopy - 1)
            ]
            scale = p["scale"]
            x = torch.randn(1, k, generator=g, device=dev).to(dtype)

            def run(x, q, c):
                return I.w8a16_matmul(x, q, scale, None, None, k, kernel="w8a16_gemv", config=c)

            current = dict(I.int8_config("w8a16_gemv", 1, n, k, 0, arch))
            cur_us = time_calls(lambda x, q: run(x, q, current), copies, x, graphs)
            times = []
            for cfg in list(int8_candidates(k))[: 2 if args.smoke else None]:
                try:
                    times.append((time_calls(lambda x, q, c=cfg: run(x, q, c), copies, x, graphs), cfg))
                except Exception as e:
                    print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
            us, cfg = min(times + [(cur_us, current)], key=lambda t: t[0])
            ref = I.linear_w8a16_reference(x.float(), copies[0], scale, None, None, k)
            err = ((run(x, copies[0], cfg).float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                raise SystemExit(f"{label}: the W8A16 GEMV with {cfg} is wrong (relative error {err:.2e})")
            seen[(n, k)] = {
                "N": n,
                "K": k,
                "MB": n * k / 1e6,
                "current_us": cur_us,
                "best_us": us,
                "config": cfg,
                "rel_err": err,
                "all": [{"us": t, **c} for t, c in times],
            }
            del copies
        r = seen[(n, k)]
        results.append({"linear": label, **r})
        print(
            f"{label:<28} {f'{n} x {k}':>14} {r['MB']:7.1f} {r['current_us']:10.2f} {r['MB'] / r['current_us']:5.2f} "
            f"{r['best_us']:8.2f} {r['MB'] / r['best_us']:5.2f} {r['current_us'] / r['best_us']:6.2f}x  {r['config']}",
            flush=True,
        )
    for r in seen.values():  # the config only: int8_config passes every key to the kernel
        rows[f"M1_N{r['N']}_K{r['K']}"] = dict(r["config"])
    table[arch]["w8a16_gemv"] = dict(sorted(rows.items()))
    out = write_outputs(args.out, "tune_gemv_int8.json", dev, results, table)
    print(f"{len(seen)} int8 shapes; rows written to {out / 'tuning.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
