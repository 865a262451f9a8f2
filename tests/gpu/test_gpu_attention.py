"""GPU check section `attention`: the Triton attention kernels against the reference at real
shapes, and the prefill attention's TMA path through the runtime.

    pytest tests/gpu/test_gpu_attention.py                                  # about a minute and a half on an H200
    TRITON_INTERPRET=1 python tests/gpu/test_gpu_attention.py --smoke        # the kernel cases, tiny shapes, CPU

Shapes: Llama-3-8B attention (hidden 4096: 32 query heads, 8 kv heads, head_dim 128), bf16,
contexts up to 8192, batch 1/8/32. Each case poisons the output and every cache slot the call
must not read (NaN), runs the kernel, and checks
  - out: relative error ||out - ref|| / ||ref|| against an fp32 reference, within
    max(1e-2, 2 x the error of the same reference computed in bf16), and no NaN;
  - the cache: the new tokens' k/v written exactly where the reference writes them, and
    nothing else touched (the poison is still there).
Also: the `dsc::attention` op dispatches to the kernels on CUDA, and a decode step captured
in a CUDA graph gives the right answer when replayed with new cache positions. The prefill
variant rows (kernels/attention.py PREFILL_VARIANTS: TMA and DEFER_PV at other tilings) are
each checked on the default's prefill cases; the summary counts failures per launch config.
Writes $OUT/gpu_attention.json and $OUT/gpu_tma_prefill.json when OUT is set.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_util import ROOT, cpu_smoke, out_problems, run_smoke, write_summary

from dsc.kernels import attention as A

H, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
SHRINK = 1  # --smoke divides every length by 128


def n(length: int) -> int:
    return max(1, length // SHRINK)


def make(B, S, Smax, cache_pos, Bmax=None, seed=0, window=0):
    """Inputs with NaN in every cache slot this call must not read or write."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    Bmax = Bmax or B
    rand = lambda *shape: torch.randn(*shape, generator=g, device=DEVICE, dtype=DTYPE)  # noqa: E731
    q, k, v = rand(B, H, S, D), rand(B, HKV, S, D), rand(B, HKV, S, D)
    k_cache, v_cache = rand(Bmax, HKV, Smax, D), rand(Bmax, HKV, Smax, D)
    cache_pos = torch.tensor(cache_pos, device=DEVICE, dtype=torch.int64)
    unread = torch.ones(Bmax, Smax, dtype=torch.bool, device=DEVICE)
    unread[:B] = torch.arange(Smax, device=DEVICE)[None, :] >= (cache_pos[:, None] + S)
    if window:  # below the first new token's window
        unread[:B] |= torch.arange(Smax, device=DEVICE)[None, :] <= cache_pos[:, None] - window
    k_cache.masked_fill_(unread[:, None, :, None], float("nan"))
    v_cache.masked_fill_(unread[:, None, :, None], float("nan"))
    return q, k, v, k_cache, v_cache, cache_pos


def reference(q, k, v, k_cache, v_cache, cache_pos, dtype, window=0):
    """(out, k_cache, v_cache) of attention_reference computed in `dtype` on clean copies."""
    kc, vc = k_cache.nan_to_num().to(dtype), v_cache.nan_to_num().to(dtype)
    out = A.attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), kc, vc, cache_pos, D**-0.5, window)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    A.write_kv_cache_reference(k, v, want_k, want_v, cache_pos)
    return out, want_k, want_v


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def variant_tag(cfg):
    """A launch config in a few characters: M128 N64 w8 s3 +tma+defer_pv."""
    keys = "".join(f" +{k.lower()}" for k in ("TMA", "DEFER_PV", "WS") if cfg.get(k))
    ws = "".join(f" {k[3:].lower()}={v}" for k, v in cfg.items() if k.startswith("WS_"))
    return f"M{cfg['BLOCK_M']} N{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}{keys}{ws}"


def check(name, run, B, S, Smax, cache_pos, Bmax=None, window=0, config="default"):
    t0 = time.time()
    q, k, v, k_cache, v_cache, pos = make(B, S, Smax, cache_pos, Bmax, window=window)
    ref32, want_k, want_v = reference(q, k, v, k_cache, v_cache, pos, torch.float32, window)
    ref16 = reference(q, k, v, k_cache, v_cache, pos, DTYPE, window)[0]
    out = torch.full((B, S, H, D), float("nan"), device=DEVICE, dtype=DTYPE)
    run(q, k, v, k_cache, v_cache, pos, D**-0.5, window, out=out)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    err, err_bf16 = rel_err(out, ref32), rel_err(ref16, ref32)
    limit = max(1e-2, 2 * err_bf16)
    problems = out_problems(out, err, limit, (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)))
    row = dict(
        case=name,
        config=config,
        B=B,
        S=S,
        Smax=Smax,
        rel_err=err,
        bf16_reference_rel_err=err_bf16,
        ok=not problems,
        problems=problems,
        seconds=round(time.time() - t0, 2),
    )
    print(
        f"{'ok  ' if not problems else 'FAIL'} {name:44s} rel_err {err:.2e} (reference in {str(DTYPE)[6:]}: "
        f"{err_bf16:.2e})"
        f"  {'; '.join(problems)}",
        flush=True,
    )
    return row


def lengths(B, Smax, seed):
    """Per-sequence cache positions: the edges (Smax-1, 0, 1) then random ones."""
    g = torch.Generator().manual_seed(seed)
    edge = [Smax - 1, 0, 1, Smax // 2 + 3]
    return (edge + torch.randint(0, Smax, (B,), generator=g).tolist())[:B]


def check_op_dispatch():
    """torch.ops.dsc.attention on CUDA runs the Triton kernels (same bits as the wrappers)."""
    rows = []
    for S, pos in ((1, [100, 5000]), (300, [0, 0])):
        inputs = make(2, S, 8192, pos)
        mine = [t.clone() for t in inputs]
        via_op = torch.ops.dsc.attention(*inputs, D**-0.5)
        run = A.decode_attention if S == 1 else A.prefill_attention
        direct = run(*mine, D**-0.5)
        ok = torch.equal(via_op, direct) and torch.equal(inputs[3].nan_to_num(7.0), mine[3].nan_to_num(7.0))
        print(f"{'ok  ' if ok else 'FAIL'} op dispatch S={S}", flush=True)
        rows.append(dict(case=f"op-dispatch-S{S}", ok=ok, problems=[] if ok else ["op != wrapper"]))
    return rows


def check_cuda_graph():
    """Capture one decode step; replay with new cache positions; compare with the reference."""
    B, Smax = 8, 8192
    q, k, v, k_cache, v_cache, pos = make(B, 1, Smax, [10] * B)
    k_cache.normal_(), v_cache.normal_()  # every slot holds data: replays move the positions
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        torch.ops.dsc.attention(q, k, v, k_cache, v_cache, pos, D**-0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsc.attention(q, k, v, k_cache, v_cache, pos, D**-0.5)
    rows = []
    for step, new_pos in enumerate(([3, 4000, 8191, 77, 0, 1, 2048, 6000], [8191] * B)):
        pos.copy_(torch.tensor(new_pos))
        q.normal_(), k.normal_(), v.normal_()
        ref, want_k, _ = reference(q, k, v, k_cache, v_cache, pos, torch.float32)
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        ok = err < 1e-2 and torch.equal(k_cache, want_k)
        print(f"{'ok  ' if ok else 'FAIL'} cuda graph replay {step}: rel_err {err:.2e}", flush=True)
        rows.append(dict(case=f"cuda-graph-replay-{step}", rel_err=err, ok=ok, problems=[] if ok else ["mismatch"]))
    return rows


def run_cases(smoke: bool) -> list[dict]:
    """Every case's row (the module's shapes set for the run: real ones, or tiny under smoke)."""
    global H, HKV, D, DTYPE, DEVICE, SHRINK
    if smoke:  # the script's own test: interpreter on CPU (fp16: the interpreter's bf16 dot is wrong)
        H, HKV, D, DTYPE, DEVICE, SHRINK = 6, 2, 16, torch.float16, "cpu", 128
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {A._triton().__version__}")
    dev = torch.device(DEVICE)
    print(
        "launch configs:",
        A.attention_config("prefill", D, A.arch_of(dev)),
        A.attention_config("decode", D, A.arch_of(dev)),
    )
    rows = []
    P, Dd = A.prefill_attention, A.decode_attention
    rows.append(check("prefill B1 S2048 fresh", P, 1, n(2048), n(8192), [0]))
    rows.append(check("prefill B1 S8192 fresh (full cache)", P, 1, n(8192), n(8192), [0]))
    rows.append(check("prefill B8 S1000 right-padded batch", P, 8, n(1000), n(4096), [0] * 8, Bmax=9))
    rows.append(check("prefill B2 S777 chunked (cache_pos>0)", P, 2, n(777), n(8192), [n(3001), n(6000)]))
    rows.append(check("prefill B3 S512 past the cache end", P, 3, n(512), n(8192), [n(7900), 0, n(8100)]))
    for B in (1, 8, 32):
        for Smax in (n(1024), n(8192)):
            rows.append(
                check(f"decode B{B} Smax{Smax} varied lengths", Dd, B, 1, Smax, lengths(B, Smax, B), Bmax=B + 1)
            )
    rows.append(check("decode B1 Smax8192 len 5001", Dd, 1, 1, n(8192), [n(5000)]))
    rows.append(check("decode B32 Smax8192 full", Dd, 32, 1, n(8192), [n(8192) - 1] * 32))
    rows.append(
        check("decode B4 Smax8192 past the cache end", Dd, 4, 1, n(8192), [n(8192), n(9000), n(8192) - 1, n(100)])
    )
    rows.append(
        check(
            "decode B8 Smax8192 one split",
            lambda *a, **kw: A.decode_attention(*a, num_splits=1, **kw),
            8,
            1,
            n(8192),
            lengths(8, n(8192), 5),
        )
    )
    # sliding window (Mistral-7B-v0.1: 4096): prompts and contexts longer than the window
    W = n(4096)
    rows.append(check("prefill B1 S8192 fresh, window 4096", P, 1, n(8192), n(8192), [0], window=W))
    rows.append(check("prefill B2 S777 chunked, window 4096", P, 2, n(777), n(8192), [n(3001), n(6000)], window=W))
    # the same with the sm_90 table config named (on an H200 the default anyway), at lengths that
    # --smoke shrinks less: windowed loops many key tiles long, where a cache write fused into
    # the pipelined loop read a V tile already overwritten by a later one (wrong out on H200)
    m = (lambda length: length) if SHRINK == 1 else (lambda length: max(1, length // 16))  # noqa: E731
    sm90 = lambda *a, **kw: A.prefill_attention(*a, config=A.PREFILL_CONFIGS[("sm_90", 128)], **kw)  # noqa: E731
    rows.append(
        check(
            f"prefill B1 S{m(8192)} fresh, window {m(4096)}, sm_90 config",
            sm90,
            1,
            m(8192),
            m(8192),
            [0],
            window=m(4096),
        )
    )
    rows.append(
        check(
            f"prefill B2 S{m(777)} chunked, window {m(4096)}, sm_90 config",
            sm90,
            2,
            m(777),
            m(8192),
            [m(3001), m(6000)],
            window=m(4096),
        )
    )
    rows.append(
        check(
            "decode B8 Smax8192 varied lengths, window 4096",
            Dd,
            8,
            1,
            n(8192),
            lengths(8, n(8192), 8),
            Bmax=9,
            window=W,
        )
    )
    rows.append(
        check(
            "decode B1 Smax8192 len 8000, window 4096, one split",
            lambda *a, **kw: A.decode_attention(*a, num_splits=1, **kw),
            1,
            1,
            n(8192),
            [n(8000)],
            window=W,
        )
    )
    # launch configs other than the table's that scripts/bench_kernels.py attention --sweep may pick: a
    # 128-key tile, one warpgroup of 64 rows; fresh, chunked and windowed prompts
    for cfg in (
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    ):
        tag = f"M{cfg['BLOCK_M']} N{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
        run = lambda *a, cfg=cfg, **kw: A.prefill_attention(*a, config=cfg, **kw)  # noqa: E731
        rows.append(check(f"prefill B1 S2048 fresh, {tag}", run, 1, n(2048), n(8192), [0]))
        rows.append(check(f"prefill B2 S777 chunked, {tag}", run, 2, n(777), n(8192), [n(3001), n(6000)]))
        rows.append(
            check(
                f"prefill B2 S777 chunked, window 1000, {tag}",
                run,
                2,
                n(777),
                n(8192),
                [n(3001), n(6000)],
                window=n(1000),
            )
        )
    # one query head per kv head (GPT-2-XL: 25 heads of 64) at the sm_90 table's 128 x 64 tiles:
    # a row tile spans 3 key tiles of its own tokens, so the cache write takes a loop of its own
    # (fused into the masked loop it would be the pipelined-loop race above)
    saved = H, HKV, D
    H, HKV, D = (25, 25, 64) if not smoke else (3, 3, 16)
    mha = lambda *a, **kw: A.prefill_attention(*a, config=A.PREFILL_CONFIGS[("sm_90", 64)], **kw)  # noqa: E731
    rows.append(check(f"prefill B2 S{m(1000)} fresh, MHA {H}x{D}, sm_90 config", mha, 2, m(1000), m(1024), [0, 0]))
    rows.append(
        check(f"prefill B2 S{m(300)} chunked, MHA {H}x{D}, sm_90 config", mha, 2, m(300), m(1024), [m(200), m(700)])
    )
    # the prefill variant at each candidate row: the default's prefill cases (fresh, full cache,
    # right-padded batch, chunked, past the cache end), a windowed call at the first row (the
    # wrapper runs the default code there), and the MHA cases at the head_dim-64 rows
    for i, cfg in enumerate(A.PREFILL_VARIANTS[("sm_90", 128)][: 2 if smoke else None]):  # smoke: two rows
        tag = variant_tag(cfg)
        run = lambda *a, cfg=cfg, **kw: A.prefill_attention(*a, config=cfg, **kw)  # noqa: E731
        for name, args in (
            ("B1 S2048 fresh", (1, n(2048), n(8192), [0])),
            ("B1 S8192 fresh (full cache)", (1, n(8192), n(8192), [0])),
            ("B8 S1000 right-padded batch", (8, n(1000), n(4096), [0] * 8, 9)),
            ("B2 S777 chunked (cache_pos>0)", (2, n(777), n(8192), [n(3001), n(6000)])),
            ("B3 S512 past the cache end", (3, n(512), n(8192), [n(7900), 0, n(8100)])),
        ):
            rows.append(check(f"prefill {name}, {tag}", run, *args, config=tag))
        if i == 0:
            rows.append(
                check(
                    f"prefill B2 S777 chunked, window 4096, {tag}",
                    run,
                    2,
                    n(777),
                    n(8192),
                    [n(3001), n(6000)],
                    window=W,
                    config=tag,
                )
            )
    H, HKV, D = (25, 25, 64) if not smoke else (3, 3, 16)
    for cfg in A.PREFILL_VARIANTS[("sm_90", 64)][: 1 if smoke else None]:
        tag = f"{variant_tag(cfg)} (D64 row)"
        run = lambda *a, cfg=cfg, **kw: A.prefill_attention(*a, config=cfg, **kw)  # noqa: E731
        rows.append(
            check(f"prefill B2 S{m(1000)} fresh, MHA {H}x{D}, {tag}", run, 2, m(1000), m(1024), [0, 0], config=tag)
        )
        rows.append(
            check(
                f"prefill B2 S{m(300)} chunked, MHA {H}x{D}, {tag}",
                run,
                2,
                m(300),
                m(1024),
                [m(200), m(700)],
                config=tag,
            )
        )
    H, HKV, D = saved
    if not smoke:
        rows += check_op_dispatch()
        rows += check_cuda_graph()
    return rows


def summarize(rows) -> list[str]:
    """Print the per-launch-config summary; the failed cases."""
    failed = [r["case"] for r in rows if not r["ok"]]
    print('\nper launch config ("default": the table\'s and the other configs named in the case):')
    for tag in dict.fromkeys(r.get("config", "default") for r in rows):
        mine = [r for r in rows if r.get("config", "default") == tag]
        bad = [r["case"] for r in mine if not r["ok"]]
        print(f"  {tag:34s} {len(mine) - len(bad)}/{len(mine)} passed" + (f"; FAILED: {bad}" if bad else ""))
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed" + (f"; FAILED: {failed}" if failed else ""))
    return failed


@pytest.mark.gpu
def test_attention_kernels_match_reference():
    rows = run_cases(smoke=False)
    write_summary("gpu_attention", rows)
    failed = summarize(rows)
    assert not failed, [r for r in rows if not r["ok"]]


@cpu_smoke
def test_attention_section_smoke_in_interpreter():
    """This file's kernel cases at tiny shapes in the Triton interpreter (fp16)."""
    out = run_smoke(ROOT / "tests" / "gpu" / "test_gpu_attention.py", "--smoke")
    assert "FAIL" not in out and "checks passed" in out


# -- the prefill attention's TMA path through the runtime ------------------------------------------
# A random Llama with Llama-8B's attention (head_dim 128, 4 query heads per kv head; fewer and
# narrower layers, so it compiles in seconds) is compiled in bf16, then run twice in one process:
# with the sm_90 table's prefill row (TMA: K/V tiles through tensor descriptors, q/k/v as the
# runtime passes them, strided views of the fused projection) and with the same row without TMA
# (per-thread pointer loads). Prefill runs eagerly, so switching the table row in between changes
# the kernel. Checked: prefill logits of a right-padded batch (prompts of 700, 300 and 1 tokens),
# a chunked prefill (a second prompt chunk on top of the cached first) and greedy tokens; the two
# paths do the same arithmetic in the same order, so they agree to the last bit or nearly.
def chunk(e, parts, start):
    """Prefill `parts` at cache positions `start` (a chunked prefill: the runtime's prefill
    program with cache_pos > 0); the last token's logits."""
    L = max(max(map(len, parts)), 2)
    ids = torch.zeros(len(parts), L, dtype=torch.long)
    for i, p in enumerate(parts):
        ids[i, : len(p)] = torch.tensor(p)
    cache_pos = torch.tensor(start)
    pos = cache_pos[:, None] + torch.arange(L)[None, :]
    last = torch.tensor([len(p) - 1 for p in parts])
    return e.run("prefill", *(t.to(e.device) for t in (ids, pos, cache_pos, last)))


def run_engine(art, prompts, new_tokens):
    import dsc

    e = dsc.load(art, device="cuda" if torch.cuda.is_available() else "cpu")
    logits = e.prefill(prompts).float().cpu()
    e.reset()
    long = [p for p in prompts if len(p) > 1]
    e.prefill([p[: len(p) // 2] for p in long])  # first chunks, then the rest on top of them
    chunked = chunk(e, [p[len(p) // 2 :] for p in long], [len(p) // 2 for p in long])
    tokens = e.generate(prompts, max_new_tokens=new_tokens, stop_tokens=[]).tokens
    return logits, chunked.float().cpu(), tokens


def tma_prefill_report(work: Path, smoke: bool) -> dict:
    """The TMA and plain paths' prefill logits, chunked-prefill logits and tokens compared (smoke:
    a tiny model on the CPU, the code path only)."""
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    t = time.perf_counter()
    layers = (
        dict(
            num_hidden_layers=2,
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            intermediate_size=512,
        )
        if smoke
        else dict(
            num_hidden_layers=4,
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=4096,
        )
    )
    ckpt = make_random_checkpoint(
        work / "ckpt", "llama-1b", dtype="bfloat16", device="cuda" if torch.cuda.is_available() else "cpu", **layers
    )
    art = work / "art"
    dsc.compile(str(ckpt), art, max_batch=4, max_seq=64 if smoke else 2048)
    print(f"checkpoint + compile {time.perf_counter() - t:.1f}s ({layers})", flush=True)
    g = torch.Generator().manual_seed(0)
    lens = (20, 9, 1) if smoke else (700, 300, 1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lens]

    key = ("sm_90", 128)
    row = dict(A.PREFILL_CONFIGS[key])
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "table_row": row,
        "model": layers,
        "prompt_lengths": list(lens),
    }
    made = []  # the TMA path ran: descriptors were made (None: a tensor TMA cannot address)
    descriptors = A._kv_descriptors
    A._kv_descriptors = lambda *a, **k: made.append(descriptors(*a, **k)) or made[-1]
    # the row without its warp-specialized kernel (WS: its own check is the attention section's),
    # so that the Triton prefill kernel runs, with TMA, then without
    A.PREFILL_CONFIGS[key] = {k: v for k, v in row.items() if not k.startswith("WS")}
    try:
        tma = run_engine(art, prompts, 8)
    finally:
        A._kv_descriptors = descriptors
        A.PREFILL_CONFIGS[key] = row
    report["tma_calls"] = sum(d is not None for d in made)
    report["tma_fell_back"] = sum(d is None for d in made)
    A.PREFILL_CONFIGS[key] = {k: v for k, v in row.items() if k != "TMA" and not k.startswith("WS")}
    try:
        plain = run_engine(art, prompts, 8)
    finally:
        A.PREFILL_CONFIGS[key] = row
    for name, a, b in (("prefill", tma[0], plain[0]), ("chunked_prefill", tma[1], plain[1])):
        report[f"{name}_max_abs_diff"] = float((a - b).abs().max())
        report[f"{name}_max_abs"] = float(b.abs().max())
    report["tokens_equal"] = tma[2] == plain[2]
    report["ok"] = (
        report["tokens_equal"]
        and (report["tma_calls"] > 0 or smoke)
        and all(
            report[f"{n}_max_abs_diff"] <= 1e-2 * max(1.0, report[f"{n}_max_abs"])
            for n in ("prefill", "chunked_prefill")
        )
    )
    print(report, flush=True)
    return report


@pytest.mark.gpu
def test_tma_prefill_matches_plain_loads(tmp_path):
    report = tma_prefill_report(tmp_path, smoke=False)
    write_summary("gpu_tma_prefill", report)
    assert report["ok"], report


def test_tma_prefill_code_path_on_cpu(tmp_path):
    """The TMA check's own path on the CPU (a tiny model; no TMA there: both runs agree exactly)."""
    report = tma_prefill_report(tmp_path, smoke=True)
    assert report["ok"] and report["tokens_equal"] and report["prefill_max_abs_diff"] == 0, report


if __name__ == "__main__":
    if "--smoke" not in sys.argv or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(
            "run as: TRITON_INTERPRET=1 python tests/gpu/test_gpu_attention.py --smoke (on a GPU: pytest tests/gpu)"
        )
    sys.exit(1 if summarize(run_cases(smoke=True)) else 0)
