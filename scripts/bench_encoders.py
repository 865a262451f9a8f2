"""Benchmark dsc's encoders against transformers on one GPU, in the same run and process.

    python scripts/bench_encoders.py [--work build/encoders] [--dtype bfloat16]
    python scripts/bench_encoders.py --device cpu --dtype float32 --cases bert-odd:16:3 --no-compile   # smoke

Cases: BERT-large (random weights) at sequence 128, batches 1 and 32; the all-MiniLM-L6-v2
shape at sequence 128, batch 256. Each: dsc's `Engine.encode` of the compiled artifact (the
`encode` program: fused LayerNorms, GELU with bias, fused q/k/v, SDPA with the padding mask)
against transformers' `AutoModel` (SDPA attention) eager and under `torch.compile`, on the same
checkpoint and the same right-padded batch (lengths 96-128); dsc also without CUDA graphs. Times: median ms per batch
over 30
calls after warm-up, synchronized; sequences per second; the max |difference| of dsc's last
hidden states from transformers' at the real tokens. Writes $OUT/bench_encoders.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

CASES = [("bert-large", 128, 1), ("bert-large", 128, 32), ("minilm-l6", 128, 256)]


def timed(fn, device: str, iters: int = 30, warmup: int = 5) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main() -> None:
    from transformers import AutoModel

    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="build/encoders")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--cases", default=None, help="shape:seq:batch,... (default: BERT-large 128:1, 128:32; MiniLM 128:256)"
    )
    ap.add_argument("--no-compile", action="store_true", help="leave out transformers under torch.compile")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    dev = args.device
    cases = (
        [(c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2])) for c in args.cases.split(",")]
        if args.cases
        else CASES
    )
    t = lambda fn: timed(fn, dev, args.iters)  # noqa: E731
    work, dtype = Path(args.work), getattr(torch, args.dtype)
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype]
    rows = []
    for shape, seq, batch in cases:
        ckpt, art = work / f"ckpt-{shape}", work / f"art-{shape}-{short}"
        if not (ckpt / "config.json").exists():
            make_random_checkpoint(ckpt, shape, dtype=args.dtype)
        if not (art / "manifest.json").exists():
            dsc.compile(str(ckpt), art, dtype=short, max_seq=seq)
        g = torch.Generator().manual_seed(batch)
        lengths = torch.randint(seq * 3 // 4, seq + 1, (batch,), generator=g)
        lengths[0] = seq
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        ids = torch.randint(min(1000, vocab // 2), vocab, (batch, seq), generator=g)
        mask = torch.arange(seq)[None, :] < lengths[:, None]
        ids = torch.where(mask, ids, 0)
        eng = dsc.load(art, device=dev)
        ids_d, len_d, mask_d, real = ids.to(dev), lengths.to(dev), mask.long().to(dev), mask.to(dev)
        with torch.inference_mode():
            ours = eng.encode(ids_d, len_d)
            t_dsc = t(lambda: eng.encode(ids_d, len_d))
        eng = None  # frees its GPU memory (the timing lambda holds the name, not the engine)
        eager = dsc.load(art, device=dev, cuda_graphs=False)
        with torch.inference_mode():
            plain = eager.encode(ids_d, len_d)
            t_dsc_eager = t(lambda: eager.encode(ids_d, len_d))
        graph_diff = float((ours - plain).abs()[real].max())
        eager = None
        hf = (
            AutoModel.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa", add_pooling_layer=False)
            .to(dev)
            .eval()
        )
        t_comp = compile_s = float("nan")
        with torch.inference_mode():
            ref = hf(input_ids=ids_d, attention_mask=mask_d).last_hidden_state.float()
            t_eager = t(lambda: hf(input_ids=ids_d, attention_mask=mask_d))
            if not args.no_compile:
                comp = torch.compile(hf)
                t0 = time.perf_counter()
                comp(input_ids=ids_d, attention_mask=mask_d)
                torch.cuda.synchronize() if dev == "cuda" else None
                compile_s = time.perf_counter() - t0
                t_comp = t(lambda: comp(input_ids=ids_d, attention_mask=mask_d))
                del comp
        diff = float((ours - ref).abs()[real].max())
        scale = float(ref.abs()[real].max())
        hf = None
        if dev == "cuda":
            torch.cuda.empty_cache()
        r = {
            "model": shape,
            "seq": seq,
            "batch": batch,
            "dtype": args.dtype,
            "dsc_ms": t_dsc,
            "eager_ms": t_eager,
            "compile_ms": t_comp,
            "dsc_eager_ms": t_dsc_eager,
            "graph_vs_eager_max_abs_diff": graph_diff,
            "compile_first_call_s": compile_s,
            "dsc_seqs_per_s": batch / t_dsc * 1e3,
            "vs_eager": t_eager / t_dsc,
            "vs_compile": t_comp / t_dsc,
            "max_abs_diff": diff,
            "max_abs_ref": scale,
        }
        rows.append(r)
        print(
            f"{shape:10s} seq {seq} batch {batch:3d}: dsc {t_dsc:7.2f} ms ({r['dsc_seqs_per_s']:8.0f} seq/s)  "
            f"eager {t_eager:7.2f} ms (x{r['vs_eager']:.2f})  torch.compile {t_comp:7.2f} ms (x{r['vs_compile']:.2f}, "
            f"first call {compile_s:.0f} s)  max|diff| {diff:.3g} of {scale:.3g}; "
            f"dsc without graphs {t_dsc_eager:.2f} ms "
            f"(graph vs eager max|diff| {graph_diff:.3g})",
            flush=True,
        )
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_encoders.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
