"""GPU check of the runtime (run on a CUDA machine; writes under $OUT when set).

1. A Llama-1B-shaped random checkpoint compiles and generates on the GPU, and its greedy
   tokens and logits match the same artifact run on the CPU.
2. CUDA-graph replay gives exactly the tokens of the eager runtime, for a batch of prompts of
   mixed lengths (bucket padding included): the eager engine prefills in the same length
   buckets (load's prefill_buckets=True). The eager runtime's own exact-length prefill is
   reported beside it, not checked: a GEMM's rounding can depend on its row count, and on an
   H100 its bf16 prefill logits differed from the bucket's by 0.07, which flipped tokens of the
   random-weight model (session 20: scripts/gpu_check_graph_eager.py, docs/results/s20-h100).
3. Reports ms/token at batch 1 with and without graphs, and with graphs with the generate loop
   unpipelined (DSC_PIPELINE=off: each step's tokens read back before the next is queued).

    python scripts/gpu_check_runtime.py --shape llama-1b --dtype bfloat16
    python scripts/gpu_check_runtime.py --shape llama-8b --layers 2 --batch 6 --int8   # 8-row bucket
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model and prompt arguments this script and gpu_check_graph_eager.py share."""
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--work", default=None)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's)")
    ap.add_argument("--batch", type=int, default=3, help="prompts decoded together (3: a 4-row bucket)")


def mixed_prompts(vocab_size: int, batch: int, g: torch.Generator) -> list[list[int]]:
    """`batch` random prompts of mixed lengths (37, 5, 20, 38, 6, ...): the first prefills in a
    64-token bucket, and the batch decodes in a padded batch bucket (3 in 4)."""
    lengths = [(37, 5, 20)[i % 3] + i // 3 for i in range(batch)]
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def main() -> int:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--cpu-check", action="store_true", help="also run the artifact on CPU and compare")
    args, extra = ap.parse_known_args()
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    work = Path(args.work or tempfile.mkdtemp(prefix="dsc-gpu-"))
    ckpt = work / (f"ckpt-{args.shape}" + (f"-{args.layers}l" if args.layers else ""))
    art = work / f"art-{args.shape}"
    t = time.perf_counter()
    if not (ckpt / "config.json").exists():
        layers = {"num_hidden_layers": args.layers} if args.layers else {}
        make_random_checkpoint(ckpt, args.shape, dtype=args.dtype, device="cuda", **layers)
    print(f"checkpoint {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    opts = dict(max_batch=8, max_seq=256)
    for kv in extra:
        k, _, v = kv.lstrip("-").partition("=")
        opts[k.replace("-", "_")] = json.loads(v) if v else True
    dsc.compile(str(ckpt), art, **opts)
    print(f"compile {time.perf_counter() - t:.1f}s  options {opts}", flush=True)

    g = torch.Generator().manual_seed(0)
    eng = dsc.load(art, device="cuda")
    V = eng.vocab_size
    prompts = mixed_prompts(V, args.batch, g)
    res_graph = eng.generate(prompts, max_new_tokens=args.new_tokens, stop_tokens=[]).tokens
    eager = dsc.load(art, device="cuda", cuda_graphs=False, prefill_buckets=True)
    res_eager = eager.generate(prompts, max_new_tokens=args.new_tokens, stop_tokens=[]).tokens
    ok_graph = res_graph == res_eager
    exact = dsc.load(art, device="cuda", cuda_graphs=False)  # prefills at the prompts' exact length
    res_exact = exact.generate(prompts, max_new_tokens=args.new_tokens, stop_tokens=[]).tokens
    del exact
    print(f"graph replay == eager tokens: {ok_graph} (eager prefill at the exact length, not checked: "
          f"{res_graph == res_exact})", flush=True)
    report = {"shape": args.shape, "layers": args.layers or None, "batch": args.batch, "dtype": args.dtype,
              "options": opts, "graph_equals_eager": ok_graph, "graph_equals_eager_exact_length": res_graph == res_exact,
              "device": torch.cuda.get_device_name()}

    # ms/token at batch 1 (greedy decode loop incl. sampling and host readback); "graphs-unpipelined":
    # DSC_PIPELINE=off, each step's tokens read back before the next step is queued
    # (`dsc bench`'s measure: (64 tokens - 8 tokens) / 56 from a prompt of the first prompt's length)
    from dsc.runtime.bench import generate_ms_per_token

    for name, e in (("graphs", eng), ("graphs-unpipelined", eng), ("eager", eager)):
        os.environ["DSC_PIPELINE"] = "off" if name.endswith("unpipelined") else "on"
        ms = generate_ms_per_token(e, len(prompts[0]), torch.device("cuda"), g, long=64)["ms_per_token"]
        report[f"ms_per_token_{name}"] = ms
        print(f"{name}: {ms:.3f} ms/token (batch 1, generate loop)", flush=True)
    os.environ.pop("DSC_PIPELINE")

    if args.cpu_check:
        cpu = dsc.load(art, device="cpu")
        res_cpu = cpu.generate(prompts, max_new_tokens=args.new_tokens, stop_tokens=[]).tokens
        lg = eager.prefill(prompts).cpu()
        lc = cpu.prefill(prompts)
        err = float((lg - lc).abs().max())
        rel = err / float(lc.abs().max())
        agree = sum(a == b for r, c in zip(res_graph, res_cpu) for a, b in zip(r, c)) / sum(map(len, res_cpu))
        first = all(r[0] == c[0] for r, c in zip(res_graph, res_cpu))
        report.update(cpu_tokens_equal=res_graph == res_cpu, cpu_token_agreement=agree, cpu_first_token_equal=first,
                      prefill_logits_max_abs_err=err, prefill_logits_rel_err=rel)
        print(f"GPU vs CPU: tokens equal {res_graph == res_cpu} (agreement {agree:.1%}, first tokens equal {first}); "
              f"prefill logits max abs err {err:.3g} (relative {rel:.3g})", flush=True)
    out = os.environ.get("OUT")
    if out:
        name = args.shape + (f"-{args.layers}l" if args.layers else "") + (f"-b{args.batch}" if args.batch != 3 else "")
        Path(out, f"gpu_check_{name}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if ok_graph else 1


if __name__ == "__main__":
    sys.exit(main())
