"""GPU check section `moe`: `dsc::moe`'s Triton kernels (kernels/fused_moe.py) against the
plain-torch reference (kernels/moe.py) at scaled-down Mixtral and Qwen3-MoE shapes, on a GPU.

    pytest tests/gpu/test_gpu_moe.py                                    # about a minute on an H200
    TRITON_INTERPRET=1 python tests/gpu/test_gpu_moe.py --smoke          # the same code, tiny shapes, CPU

Shapes: Mixtral-like H 1024, I 1536, 8 experts, top 2, and Qwen3-MoE-like H 1024, I 256, 64
experts, top 8, at T = 1, 7, 256, 2048 tokens; bf16 activations with bf16 and int8 (W8A16,
per-row scales) weights; expert parallelism (first_expert != 0: a rank holding 4 of 8 or 16 of 64
experts, the other ids contributing nothing); all tokens routed to one expert. The oracle is
the reference in fp32 (fp32 activations and weights, int8 dequantized in fp32).

Pass: max |got - ref| <= 3e-2 max |ref| and ||got - ref|| <= 1e-2 ||ref|| (bf16 rounds gate, up,
the activation, each expert's output and the sum, up to 2^-9 relative each: about 3e-3 rms in
all), and at most 2x the bf16 reference's own rms error + 1e-3 (the kernels keep its rounding
points); no NaN/inf, and a second call bit-identical to the first.
Also: `torch.ops.dsc.moe` dispatches to the kernels on CUDA (bit-equal), and a CUDA graph of the
op replays with new routing, weights and tokens copied into its input buffers, bit-equal to
eager calls on the same inputs (including routings that put every slot on one expert and
that route nothing to the rank). Writes $OUT/gpu_moe.json when OUT is set.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from gpu_util import write_summary

from dsc.kernels import fused_moe as FM
from dsc.kernels import int8 as Q
from dsc.kernels import moe as MOE

SMOKE = __name__ == "__main__" and "--smoke" in sys.argv
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # the interpreter emulates bf16
MAX_REL, RMS_REL = 3e-2, 1e-2

# name -> H, I, experts on this rank, top k, experts of the model, first_expert
SHAPES = {
    "mixtral": (1024, 1536, 8, 2, 8, 0),
    "qwen3": (1024, 256, 64, 8, 64, 0),
    "mixtral-ep": (1024, 1536, 4, 2, 8, 4),
    "qwen3-ep": (1024, 256, 16, 8, 64, 16),
}
SMOKE_SHAPES = {
    "mixtral": (40, 24, 5, 2, 5, 0),
    "qwen3": (40, 24, 8, 4, 8, 0),
    "mixtral-ep": (40, 24, 3, 2, 5, 2),
    "qwen3-ep": (40, 24, 4, 4, 8, 4),
}
TOKENS = (3, 37) if SMOKE else (1, 7, 256, 2048)


def shapes() -> dict:
    return SMOKE_SHAPES if SMOKE else SHAPES


def routing(g, t, k, model_experts, one_expert=None):
    """(topk_ids [t, k] global ids, topk_weights [t, k] fp32) from random router logits, softmax
    over the top k (Mixtral's normalization); one_expert: every token's first choice."""
    logits = torch.randn(t, model_experts, generator=g, device=DEVICE)
    if one_expert is not None:
        logits[:, one_expert] = 100.0
    top, ids = logits.topk(k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


def weights(g, h, inter, experts, int8: bool):
    """(gate_up, down, gate_up_scale, down_scale): bf16 weights, or int8 with per-row scales."""
    gu = torch.randn(experts * 2 * inter, h, generator=g, device=DEVICE) / h**0.5
    dn = torch.randn(experts * h, inter, generator=g, device=DEVICE) / inter**0.5
    if not int8:
        return gu.to(DTYPE), dn.to(DTYPE), None, None
    qg, qd = Q.quantize_weight(gu), Q.quantize_weight(dn)
    return qg["qweight"], qd["qweight"], qg["scale"].reshape(-1), qd["scale"].reshape(-1)


def errors(got, ref) -> tuple[float, float]:
    d = got.double() - ref.double()
    scale = float(ref.double().abs().max())
    return float(d.abs().max()) / max(scale, 1e-30), float(d.norm() / ref.double().norm().clamp(min=1e-30))


def case(name, t, int8, one_expert=None) -> dict:
    h, inter, experts, k, model_experts, first = shapes()[name]
    g = torch.Generator(device=DEVICE).manual_seed(t * 131 + int8)
    x = torch.randn(t, h, generator=g, device=DEVICE).to(DTYPE)
    ids, tw = routing(g, t, k, model_experts, one_expert)
    tw = tw.to(DTYPE)
    gu, dn, gs, ds = weights(g, h, inter, experts, int8)
    got = FM.fused_moe_triton(x, ids, tw, gu, dn, first, gs, ds)
    again = FM.fused_moe_triton(x, ids, tw, gu, dn, first, gs, ds)
    w32 = (gu, dn) if int8 else (gu.float(), dn.float())
    ref = MOE.moe_reference(x.float(), ids, tw.float(), *w32, first, gs, ds)
    ref16 = MOE.moe_reference(x, ids, tw, gu, dn, first, gs, ds)
    mx, rms = errors(got.float(), ref)
    mx16, rms16 = errors(ref16.float(), ref)
    problems = []
    if got.dtype != DTYPE or got.shape != x.shape:
        problems.append(f"output {got.dtype} {list(got.shape)}")
    if not torch.isfinite(got).all():
        problems.append("non-finite output")
    if not mx <= MAX_REL or not rms <= RMS_REL or not rms <= 2 * rms16 + 1e-3:
        problems.append(
            f"error max {mx:.3g} (<= {MAX_REL}), rms {rms:.3g} (<= {RMS_REL} and 2 x the bf16 "
            f"reference's {rms16:.3g} + 1e-3)"
        )
    if not torch.equal(got, again):
        problems.append("a second call differs")
    routed = ((ids >= first) & (ids < first + experts)).sum().item()
    return {
        "ok": not problems,
        "problems": problems,
        "max_rel": mx,
        "rms_rel": rms,
        "ref_bf16_max_rel": mx16,
        "ref_bf16_rms_rel": rms16,
        "routed_slots": routed,
        "slots": t * k,
    }


def cases() -> dict:
    out = {}
    for name in shapes():
        for t in TOKENS:
            if name.endswith("-ep") and t not in (TOKENS[1], TOKENS[-2]):
                continue
            out[f"{name} T={t} bf16"] = lambda name=name, t=t: case(name, t, False)
            if name in ("mixtral", "qwen3-ep") or t == TOKENS[1]:
                out[f"{name} T={t} int8"] = lambda name=name, t=t: case(name, t, True)
    out[f"mixtral T={TOKENS[-2]} one expert"] = lambda: case("mixtral", TOKENS[-2], False, one_expert=2)
    out[f"qwen3 T={TOKENS[1]} one expert int8"] = lambda: case("qwen3", TOKENS[1], True, one_expert=3)
    return out


def graph_replay() -> dict:
    """The op captured in a CUDA graph, then replayed after new tokens, routing and weights are copied
    into its buffers: bit-equal to eager calls on those inputs, for routings the capture never saw."""
    if DEVICE != "cuda":
        return {}
    res = {}
    for name, int8 in (("qwen3-ep", False), ("mixtral", True)):
        h, inter, experts, k, model_experts, first = SHAPES[name]
        g = torch.Generator(device=DEVICE).manual_seed(7)
        t = 64
        x = torch.randn(t, h, generator=g, device=DEVICE).to(DTYPE)
        ids, tw = routing(g, t, k, model_experts)
        tw = tw.to(DTYPE)
        gu, dn, gs, ds = weights(g, h, inter, experts, int8)
        op = lambda: torch.ops.dsc.moe(x, ids, tw, gu, dn, first, gs, ds)  # noqa: E731
        dispatch_equal = torch.equal(op(), FM.fused_moe_triton(x, ids, tw, gu, dn, first, gs, ds))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                op()  # compile and allocate outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op()
        checks = {}
        local = list(range(first, first + experts))
        others = [e for e in range(model_experts) if e not in local]
        for what in ("new routing", "one expert", "none routed here", "new weights"):
            x.copy_(torch.randn(t, h, generator=g, device=DEVICE).to(DTYPE))
            new_ids, new_w = routing(g, t, k, model_experts, one_expert=local[-1] if what == "one expert" else None)
            if what == "none routed here":
                if not others:
                    continue
                new_ids = torch.tensor(others, device=DEVICE)[
                    torch.randint(0, len(others), (t, k), generator=g, device=DEVICE)
                ]
            if what == "new weights":
                for dst, src in zip((gu, dn, gs, ds), weights(g, h, inter, experts, int8)):
                    if dst is not None:
                        dst.copy_(src)
            ids.copy_(new_ids)
            tw.copy_(new_w.to(DTYPE))
            graph.replay()
            torch.cuda.synchronize()
            eager = FM.fused_moe_triton(x, ids, tw, gu, dn, first, gs, ds)
            ref = MOE.moe_reference(
                x.float(), ids, tw.float(), *((gu, dn) if int8 else (gu.float(), dn.float())), first, gs, ds
            )
            mx, rms = errors(out.float(), ref)
            ok = torch.equal(out, eager) and mx <= MAX_REL and (rms <= RMS_REL or what == "none routed here")
            if what == "none routed here":
                ok = ok and not out.any()
            checks[what] = {"ok": bool(ok), "equal_to_eager": torch.equal(out, eager), "max_rel": mx, "rms_rel": rms}
        res[f"graph replay {name}{' int8' if int8 else ''} T={t}"] = {
            "ok": dispatch_equal and all(c["ok"] for c in checks.values()),
            "dispatch_equal": dispatch_equal,
            "replays": checks,
        }
    return res


def run_all() -> dict:
    results = {}
    for name, fn in cases().items():
        t0 = time.time()
        results[name] = r = fn()
        r["s"] = round(time.time() - t0, 2)
        print(
            f"{'ok ' if r['ok'] else 'FAIL'} {name:32s} max {r['max_rel']:.2e} rms {r['rms_rel']:.2e} "
            f"(bf16 reference: max {r['ref_bf16_max_rel']:.2e} rms {r['ref_bf16_rms_rel']:.2e}) "
            f"{r['routed_slots']}/{r['slots']} slots here" + ("" if r["ok"] else f"  {r['problems']}"),
            flush=True,
        )
    for name, r in graph_replay().items():
        results[name] = r
        print(f"{'ok ' if r['ok'] else 'FAIL'} {name}  {r}", flush=True)
    return results


@pytest.mark.gpu
def test_moe_kernels_match_reference_and_replay_from_graphs():
    results = run_all()
    write_summary("gpu_moe", {"device": torch.cuda.get_device_name(), "results": results})
    bad = {k: v for k, v in results.items() if not v["ok"]}
    assert not bad, bad


def main() -> int:
    t0 = time.time()
    results = run_all()
    bad = [k for k, v in results.items() if not v["ok"]]
    print(f"{len(results) - len(bad)}/{len(results)} passed on cpu (interpreter) in {time.time() - t0:.1f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    if not SMOKE or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run as: TRITON_INTERPRET=1 python tests/gpu/test_gpu_moe.py --smoke (on a GPU: pytest tests/gpu)")
    sys.exit(main())
