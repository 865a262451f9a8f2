"""Benchmark dsc's encoders against transformers on one GPU, in the same run and process.

    python scripts/bench_encoders.py [--work build/encoders] [--dtype bfloat16]

Cases: BERT-large (random weights) at sequence 128, batches 1 and 32; the all-MiniLM-L6-v2
shape at sequence 128, batch 256. Each: dsc's `Engine.encode` of the compiled artifact (the
`encode` program: fused LayerNorms, GELU with bias, fused q/k/v, SDPA with the padding mask)
against transformers' `AutoModel` (SDPA attention) eager and under `torch.compile`, on the same
checkpoint and the same right-padded batch (lengths 96-128); dsc also without CUDA graphs. Times: median ms per batch over 30
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


def timed(fn, iters: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main() -> None:
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint
    from transformers import AutoModel

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="build/encoders")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    work, dtype = Path(args.work), getattr(torch, args.dtype)
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype]
    rows = []
    for shape, seq, batch in CASES:
        ckpt, art = work / f"ckpt-{shape}", work / f"art-{shape}-{short}"
        if not (ckpt / "config.json").exists():
            make_random_checkpoint(ckpt, shape, dtype=args.dtype)
        if not (art / "manifest.json").exists():
            dsc.compile(str(ckpt), art, dtype=short, max_seq=seq)
        g = torch.Generator().manual_seed(batch)
        lengths = torch.randint(seq * 3 // 4, seq + 1, (batch,), generator=g)
        lengths[0] = seq
        ids = torch.randint(1000, 30000, (batch, seq), generator=g)
        mask = torch.arange(seq)[None, :] < lengths[:, None]
        ids = torch.where(mask, ids, 0)
        eng = dsc.load(art, device="cuda")
        ids_d, len_d, mask_d = ids.cuda(), lengths.cuda(), mask.long().cuda()
        with torch.inference_mode():
            ours = eng.encode(ids_d, len_d)
            t_dsc = timed(lambda: eng.encode(ids_d, len_d))
        del eng
        eager = dsc.load(art, device="cuda", cuda_graphs=False)
        with torch.inference_mode():
            plain = eager.encode(ids_d, len_d)
            t_dsc_eager = timed(lambda: eager.encode(ids_d, len_d))
        graph_diff = float((ours - plain).abs()[mask.cuda()].max())
        del eager
        hf = AutoModel.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa", add_pooling_layer=False).cuda().eval()
        with torch.inference_mode():
            ref = hf(input_ids=ids_d, attention_mask=mask_d).last_hidden_state.float()
            t_eager = timed(lambda: hf(input_ids=ids_d, attention_mask=mask_d))
            comp = torch.compile(hf)
            t0 = time.perf_counter()
            comp(input_ids=ids_d, attention_mask=mask_d)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            t_comp = timed(lambda: comp(input_ids=ids_d, attention_mask=mask_d))
        diff = float((ours - ref).abs()[mask.cuda()].max())
        scale = float(ref.abs()[mask.cuda()].max())
        del hf, comp
        torch.cuda.empty_cache()
        r = {"model": shape, "seq": seq, "batch": batch, "dtype": args.dtype, "dsc_ms": t_dsc, "eager_ms": t_eager,
             "compile_ms": t_comp, "dsc_eager_ms": t_dsc_eager, "graph_vs_eager_max_abs_diff": graph_diff, "compile_first_call_s": compile_s, "dsc_seqs_per_s": batch / t_dsc * 1e3,
             "vs_eager": t_eager / t_dsc, "vs_compile": t_comp / t_dsc, "max_abs_diff": diff, "max_abs_ref": scale}
        rows.append(r)
        print(f"{shape:10s} seq {seq} batch {batch:3d}: dsc {t_dsc:7.2f} ms ({r['dsc_seqs_per_s']:8.0f} seq/s)  "
              f"eager {t_eager:7.2f} ms (x{r['vs_eager']:.2f})  torch.compile {t_comp:7.2f} ms (x{r['vs_compile']:.2f}, "
              f"first call {compile_s:.0f} s)  max|diff| {diff:.3g} of {scale:.3g}; dsc without graphs {t_dsc_eager:.2f} ms "
              f"(graph vs eager max|diff| {graph_diff:.3g})", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_encoders.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
