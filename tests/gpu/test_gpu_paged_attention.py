"""GPU check section `paged`: dsc::paged_attention's Triton kernels (kernels/paged_attention.py)
against the plain-torch reference at real shapes.

    pytest tests/gpu/test_gpu_paged_attention.py                                 # on a CUDA machine
    TRITON_INTERPRET=1 python tests/gpu/test_gpu_paged_attention.py --smoke       # the same cases, tiny shapes, CPU

Shapes: Llama-3-8B attention (32 query heads, 8 kv heads, head_dim 128) in bf16, block sizes 16
and 32, contexts up to 8192; also GPT-2-XL's heads (25 of 64, one per kv head) in fp16, an odd
head_dim (80) and an fp32 step. Steps come from tests/paged_steps.py: blocks handed out in a
random order, rows in a shuffled sequence order, padding sequences and padding rows, NaN in
every pool slot the step must not read. Each case poisons the output (NaN), runs the op's
Triton wrapper, and checks
  - out: relative error ||out - ref|| / ||ref|| against an fp32 reference within
    max(1e-2, 2 x the error of the same reference computed in the step's dtype), no NaN
    (padding rows are zeros);
  - the pools: the new tokens' k/v written exactly where the reference writes them, nothing else.
Decode steps (T == N: the decode kernel, split-K) at batch 1 to 128, with padding sequences, a
sliding window and one split forced; mixed steps (the varlen kernel): a fresh 2048-token chunk
with 63 decode tokens, chunks on cached prefixes, a window, and the varlen kernel on a decode
step. Also: `torch.ops.dsc.paged_attention` dispatches to the kernels on CUDA (bit-equal to the
wrapper), and a step captured in a CUDA graph per (T, N) bucket, decode and mixed, replays right
with other lengths, block tables and padding. Writes $OUT/gpu_paged_attention.json when OUT is set.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from gpu_util import ROOT, cpu_smoke, out_problems, run_smoke, write_summary

sys.path.insert(0, str(ROOT / "tests"))  # tests/paged_steps.py: the steps the CPU tests build too
from paged_steps import Case, args_of, build, decode_case, expected, pool_problems  # noqa: E402

from dsc.kernels import paged_attention as P  # noqa: E402

HKV, G, D = 8, 4, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
SHRINK = 1  # --smoke divides every length by 128


def n(length: int) -> int:
    return max(1, length // SHRINK)


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def check(name: str, case: Case, dtype=None, run=None) -> dict:
    """One step: the wrapper (or `run`) against the references; a summary row."""
    t0 = time.time()
    dtype = dtype or DTYPE
    step = build(case, dtype, seed=len(name), device=DEVICE)
    ref32, want_k, want_v = expected(step)
    ref_low = expected(step, dtype)[0]
    out = torch.full_like(ref32, float("nan"), dtype=dtype)
    (run or P.paged_attention_triton)(
        *args_of(step),
        out=out,
        path=case.path,
        config=case.config,
        decode_config=case.decode_config,
        num_splits=case.num_splits,
    )
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    err, err_low = rel_err(out, ref32), rel_err(ref_low, ref32)
    limit = max(1e-2, 2 * err_low)
    problems = pool_problems(step, want_k, want_v) + out_problems(out, err, limit)
    T, N = step["q"].shape[2], len(case.seqs)
    row = dict(
        case=name,
        T=T,
        N=N,
        dtype=str(dtype)[6:],
        rel_err=err,
        low_precision_reference_rel_err=err_low,
        ok=not problems,
        problems=problems,
        seconds=round(time.time() - t0, 2),
    )
    print(
        f"{'ok  ' if not problems else 'FAIL'} {name:52s} rel_err {err:.2e} (reference in {str(dtype)[6:]}: "
        f"{err_low:.2e})  {'; '.join(problems)}",
        flush=True,
    )
    return row


def contexts(B: int, longest: int, seed: int) -> list[int]:
    """Cached tokens per sequence: the edges (longest - 1, 0, 1, half) then random ones."""
    g = torch.Generator().manual_seed(seed)
    edge = [longest - 1, 0, 1, longest // 2 + 3]
    return (edge + torch.randint(0, longest, (B,), generator=g).tolist())[:B]


def heads(**kw) -> dict:
    return dict(Hkv=HKV, G=G, D=D, **kw)


def decode_seqs(B: int, longest: int, seed: int, padding: int = 0) -> tuple:
    """B sequences with one token each, then `padding` padding sequences."""
    return tuple((c, 1) for c in contexts(B, longest, seed)) + ((0, 0),) * padding


def cases() -> dict:
    """name -> (Case, dtype or None)."""
    out = {}
    for B, longest in ((1, 8192), (8, 8192), (32, 2048), (64, 2048), (128, 2048))[: 3 if SHRINK > 1 else None]:
        for BS in (16, 32):  # (smoke: the interpreter's time goes to the other cases)
            out[f"decode B{B} ctx<={longest} BS{BS}"] = (
                decode_case(decode_seqs(B, n(longest), B), BS=BS, **heads()),
                None,
            )
    out["decode B32 ctx 2047 full"] = (decode_case(((n(2048) - 1, 1),) * 32, BS=16, **heads()), None)
    out["decode B61 + 3 padding sequences"] = (
        decode_case(decode_seqs(61, n(4096), 7, padding=3), BS=16, **heads()),
        None,
    )
    out["decode B8 window 4096"] = (decode_case(decode_seqs(8, n(8192), 8), BS=16, window=n(4096), **heads()), None)
    out["decode B8 one split"] = (decode_case(decode_seqs(8, n(8192), 5), BS=16, num_splits=1, **heads()), None)
    for path in ("mixed", "varlen"):
        out[f"decode step on the {path} path"] = (
            decode_case(decode_seqs(16, n(4096), 9, padding=2), BS=16, path=path, **heads()),
            None,
        )
    decodes = tuple((c, 1) for c in contexts(63, n(2048), 3))
    out["mixed 2048 fresh + 63 decodes, padded to 2304"] = (
        Case(seqs=((0, n(2048)),) + decodes, pad_rows=max(n(2304) - n(2048) - 63, 3), BS=16, **heads()),
        None,
    )
    out["mixed chunks on cached prefixes + decodes"] = (
        Case(seqs=((n(3001), n(777)), (n(6000), n(500)), (0, 0)) + decodes[:13], pad_rows=5, BS=32, **heads()),
        None,
    )
    out["mixed window 4096"] = (
        Case(seqs=((n(6000), n(512)), (0, n(2048)), (n(5000), 1)), BS=16, window=n(4096), **heads()),
        None,
    )
    out["mixed head_dim 80"] = (
        Case(seqs=((n(1000), n(300)), (0, n(700)), (n(2000), 1)), BS=16, Hkv=HKV, G=G, D=80),
        None,
    )
    out["mixed fp32"] = (Case(seqs=((n(1000), n(300)), (0, n(200)), (n(2000), 1)), BS=16, **heads()), torch.float32)
    out["mixed, the varlen kernel for every sequence"] = (
        Case(seqs=((0, n(2048)),) + decodes[:31], pad_rows=7, BS=16, path="varlen", **heads()),
        None,
    )
    mha = dict(Hkv=25, G=1, D=64) if SHRINK == 1 else dict(Hkv=3, G=1, D=16)
    out["mixed MHA 25x64 fp16 (GPT-2-XL)"] = (
        Case(seqs=((0, n(1000)), (n(700), n(300)), (n(900), 1)), BS=16, **mha),
        torch.float16,
    )
    out["decode MHA 25x64 fp16 (GPT-2-XL)"] = (decode_case(decode_seqs(8, n(1024), 4), BS=16, **mha), torch.float16)
    return out


def check_op_dispatch() -> list[dict]:
    """torch.ops.dsc.paged_attention on CUDA runs the kernels: the wrapper's bits, out and pools."""
    rows = []
    for name, case in (
        ("decode", decode_case(decode_seqs(8, 4096, 1, padding=2), BS=16, **heads())),
        ("mixed", Case(seqs=((0, 300), (500, 1)), pad_rows=3, BS=16, **heads())),
    ):
        step = build(case, DTYPE, seed=11, device=DEVICE)
        mine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in step.items()}
        via_op = torch.ops.dsc.paged_attention(*args_of(step))
        direct = P.paged_attention_triton(*args_of(mine))
        ok = torch.equal(via_op, direct) and all(
            torch.equal(step[k].nan_to_num(7.0), mine[k].nan_to_num(7.0)) for k in ("k_pool", "v_pool")
        )
        print(f"{'ok  ' if ok else 'FAIL'} op dispatch, {name} step", flush=True)
        rows.append(dict(case=f"op-dispatch-{name}", ok=ok, problems=[] if ok else ["op != wrapper"]))
    return rows


def check_cuda_graph(name: str, first: Case, then: Case) -> list[dict]:
    """One (T, N) bucket captured in a CUDA graph with `first`'s step, replayed with `first` and
    `then` (other lengths, block tables and padding; the same shapes)."""
    steps = [build(case, DTYPE, seed=20 + i, device=DEVICE) for i, case in enumerate((first, then))]
    live = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in steps[0].items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles, allocates the split counters) outside the capture
        torch.ops.dsc.paged_attention(*args_of(live))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsc.paged_attention(*args_of(live))
    rows = []
    for i, step in enumerate(steps):
        ref, want_k, want_v = expected(step)
        for key, value in step.items():
            if isinstance(value, torch.Tensor):
                live[key].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        problems = pool_problems(live, want_k, want_v) + ([f"relative error {err:.3g}"] if err > 1e-2 else [])
        print(
            f"{'ok  ' if not problems else 'FAIL'} cuda graph, {name} bucket, replay {i}: rel_err {err:.2e}  "
            f"{'; '.join(problems)}",
            flush=True,
        )
        rows.append(dict(case=f"cuda-graph-{name}-replay-{i}", rel_err=err, ok=not problems, problems=problems))
    return rows


def graph_checks() -> list[dict]:
    same = dict(BS=16, num_blocks=4400, max_blocks=260, **heads())
    rows = check_cuda_graph(
        "decode T=N=16",
        decode_case(decode_seqs(16, 4096, 30), **same),
        decode_case(decode_seqs(12, 4000, 31, padding=4)[::-1], **same),
    )
    mixed = ((0, 200), (4000, 1), (100, 40), (0, 0)) + ((77, 1),) * 12
    rows += check_cuda_graph(
        "mixed T=256 N=16",
        Case(seqs=mixed, pad_rows=256 - 253, **same),
        Case(seqs=((3000, 1),) * 15 + ((10, 241),), **same),
    )
    return rows


def run_cases(smoke: bool) -> list[dict]:
    """Every case's row (real shapes, or tiny ones in the interpreter under smoke)."""
    global HKV, G, D, DTYPE, DEVICE, SHRINK
    if smoke:  # the script's own test: interpreter on CPU (fp16: the interpreter's bf16 dot is wrong)
        HKV, G, D, DTYPE, DEVICE, SHRINK = 2, 3, 16, torch.float16, "cpu", 128
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {P.A._triton().__version__}")
    dev = torch.device(DEVICE)
    print(
        "launch configs:",
        P.paged_attention_config("prefill", D, P.arch_of(dev)),
        P.paged_attention_config("decode", D, P.arch_of(dev)),
    )
    rows = [check(name, case, dtype) for name, (case, dtype) in cases().items()]
    if not smoke:
        rows += check_op_dispatch()
        rows += graph_checks()
    return rows


def summarize(rows) -> list[str]:
    failed = [r["case"] for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed" + (f"; FAILED: {failed}" if failed else ""))
    return failed


@pytest.mark.gpu
def test_paged_attention_kernels_match_reference():
    rows = run_cases(smoke=False)
    write_summary("gpu_paged_attention", rows)
    assert not summarize(rows), [r for r in rows if not r["ok"]]


@cpu_smoke
def test_paged_section_smoke_in_interpreter():
    """This file's cases at tiny shapes in the Triton interpreter (fp16)."""
    out = run_smoke(ROOT / "tests" / "gpu" / "test_gpu_paged_attention.py", "--smoke")
    assert "FAIL" not in out and "checks passed" in out


if __name__ == "__main__":
    if "--smoke" not in sys.argv or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(
            "run as: TRITON_INTERPRET=1 python tests/gpu/test_gpu_paged_attention.py --smoke "
            "(on a GPU: pytest tests/gpu)"
        )
    sys.exit(1 if summarize(run_cases(smoke=True)) else 0)
