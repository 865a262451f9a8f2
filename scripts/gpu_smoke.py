"""Quick GPU smoke test: tiny Llama/GPT-2 in fp32/fp16/bf16 compile, run on CUDA (graphs and
eager) and agree with the CPU runtime. Prints one line per case; the traceback tail on error.

    python scripts/gpu_smoke.py
"""
from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    work = Path(tempfile.mkdtemp(prefix="dsc-smoke-"))
    fails = 0
    for shape in ("llama-tiny", "gpt2-tiny", "mistral-tiny"):  # mistral: an 8-token sliding window
        for dt in ("float32", "float16", "bfloat16"):
            tag = f"{shape} {dt}"
            try:
                ck = make_random_checkpoint(work / f"{shape}-{dt}", shape, dtype=dt)
                art = dsc.compile(str(ck), work / f"a-{shape}-{dt}", max_batch=4, max_seq=64)
                prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
                outs = {}
                for name, kw in (("cpu", dict(device="cpu")), ("cuda-graphs", dict(device="cuda")),
                                 ("cuda-eager", dict(device="cuda", cuda_graphs=False))):
                    e = dsc.load(art, **kw)
                    outs[name] = (e.generate(prompts, max_new_tokens=6, stop_tokens=[]).tokens, e.prefill(prompts).cpu())
                g, c = outs["cuda-graphs"], outs["cpu"]
                err = float((g[1] - c[1]).abs().max() / c[1].abs().max())
                print(f"ok   {tag}: graphs==eager {g[0] == outs['cuda-eager'][0]}, tokens==cpu {g[0] == c[0]}, "
                      f"prefill logits rel err vs cpu {err:.2e}", flush=True)
            except Exception:
                fails += 1
                print(f"FAIL {tag}:\n" + "".join(traceback.format_exc().splitlines(True)[-8:]), flush=True)
    # the batch-1 GEMV (kernels/linear.py) inside whole models: DSC_GEMV=all runs it at every
    # 16-bit decode linear (tiny shapes have no tuning rows), against cuBLAS (off) and the CPU
    import os
    for shape in ("llama-tiny", "gpt2-tiny"):
        for dt in ("float16", "bfloat16"):
            tag = f"gemv {shape} {dt}"
            try:
                art = work / f"a-{shape}-{dt}"
                toks, steps = {}, {}
                for mode in ("all", "off"):
                    os.environ["DSC_GEMV"] = mode
                    e = dsc.load(art, device="cuda")
                    toks[mode] = e.generate([[3, 1, 4, 1, 5]], max_new_tokens=8, stop_tokens=[]).tokens
                    e.prefill([[3, 1, 4, 1, 5]])
                    steps[mode] = e.decode(torch.tensor([9], device="cuda"), torch.tensor([5], device="cuda")).cpu()
                os.environ.pop("DSC_GEMV")
                cpu = dsc.load(art, device="cpu").generate([[3, 1, 4, 1, 5]], max_new_tokens=8, stop_tokens=[]).tokens
                err = float((steps["all"] - steps["off"]).abs().max() / steps["off"].abs().max())
                ok = toks["all"] == toks["off"] and err < 2e-2
                fails += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {tag}: gemv tokens == cublas {toks['all'] == toks['off']}, "
                      f"== cpu {toks['all'] == cpu}, decode logits rel err vs cublas {err:.2e}", flush=True)
            except Exception:
                fails += 1
                print(f"FAIL {tag}:\n" + "".join(traceback.format_exc().splitlines(True)[-8:]), flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
