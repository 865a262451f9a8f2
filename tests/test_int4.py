"""--int4: 4-bit weights in groups (W4A16, kernels/int4.py), the quantize pass's int4 rule, the
artifact and its report.

The oracle is transformers' own model on the same checkpoint with every linear weight of the
blocks rounded as the scheme says (per group of input features: min and (max - min) / 15 in
fp16, q = round((w - min) / scale) in [0, 15]), written here independently: dsc's greedy
tokens equal its tokens. The Triton kernels run in the interpreter (a child process:
`python tests/test_int4.py interpret OUT.json`) against the reference, and are built for sm_90
without a GPU (`aot`).
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_child import child_fixtures

INT4_CKPT = {"intermediate_size": 192}  # llama-tiny with an MLP width that groups of 32 and 64 divide
PROMPTS = [[5, 17, 300, 2, 99, 41, 7, 250, 3, 8, 60], [400, 12, 9, 77, 1, 33, 501], [42, 6, 210]]


def fake_quant(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    f = w.float().reshape(n, k // group, group)
    lo, hi = f.amin(-1, keepdim=True), f.amax(-1, keepdim=True)
    s = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo)).half().float()
    m = lo.half().float()
    q = torch.round((f - m) / s).clamp(0, 15)
    return (q * s + m).reshape(n, k).to(w.dtype)


def header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


# -- the scheme ----------------------------------------------------------------------------
@pytest.mark.parametrize("group", [32, 128])
def test_quantize_rounds_each_group_to_sixteen_levels(group):
    from dsc.kernels import int4

    g = torch.Generator().manual_seed(group)
    w = torch.randn(40, 256, generator=g) * torch.logspace(-2, 1, 40)[:, None]
    w[3] = 0.5  # a constant row: scale 1, every value its min
    parts = int4.quantize_weight(w, group)
    q, s, m = parts["qweight"], parts["scale"], parts["min"]
    assert q.dtype == torch.uint8 and q.shape == (40, 128) and s.dtype == m.dtype == torch.float16
    assert s.shape == m.shape == (40, 256 // group)
    assert torch.equal(int4.pack(int4.unpack(q)), q) and int(int4.unpack(q).max()) <= 15
    deq = int4.dequantize_weight(q, s, m)
    assert torch.equal(deq, fake_quant(w, group))
    step = s.float().repeat_interleave(group, 1)
    assert ((deq - w).abs() <= step / 2 + 1e-3 * (w.abs() + step)).all()
    assert torch.equal(deq[3], w[3])


def test_reference_linear_is_the_dequantized_matmul():
    from dsc.kernels import int4

    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 4, 128, generator=g), torch.randn(48, 128, generator=g), torch.randn(48, generator=g)
    p = int4.quantize_weight(w, 64)
    y = torch.ops.dsc.linear_w4a16(x, p["qweight"], p["scale"], p["min"], b, 64)
    torch.testing.assert_close(y, F.linear(x, fake_quant(w, 64), b), rtol=1e-5, atol=1e-5)


# -- the artifact --------------------------------------------------------------------------
@pytest.mark.parametrize("shape,group", [("llama-tiny", 32), ("gpt2-tiny", 64)])
def test_tokens_equal_transformers_on_the_rounded_weights(shape, group, compile_artifact, make_checkpoint, monkeypatch):
    import dsc
    from dsc.compiler import verify

    kw = INT4_CKPT if shape == "llama-tiny" else {}
    art = compile_artifact(shape, ckpt_kwargs=kw, dtype="fp32", int4=True, int4_group_size=group)

    def rounded(ck, dtype):
        model = real(ck, dtype)
        for name, mod in model.named_modules():
            if (
                re.search(r"\.\d+\.", name)
                and hasattr(mod, "weight")
                and mod.weight.dim() == 2
                and type(mod).__name__ in ("Linear", "Conv1D")
            ):
                conv = type(mod).__name__ == "Conv1D"  # GPT-2 stores [in, out]
                w = mod.weight.data.T if conv else mod.weight.data
                mod.weight.data = fake_quant(w, group).T.contiguous() if conv else fake_quant(w, group)
        return model

    real = verify.reference_model
    monkeypatch.setattr(verify, "reference_model", rounded)
    report = verify.verify_artifact(art, make_checkpoint(shape, **kw), prompts=PROMPTS, new_tokens=8)
    assert report.tokens_equal, report.summary()
    assert report.max_rel_err <= 1e-4, report.summary()
    outs = dsc.LLM(str(art), device="cpu").generate(
        PROMPTS, dsc.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == report.dsc_tokens


def test_rank_file_holds_a_quarter_of_the_bytes_plus_scales(compile_artifact):
    bf16 = header(Path(compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="bf16")) / "rank0.safetensors")
    art = Path(compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="bf16", int4=True))
    h = header(art / "rank0.safetensors")
    q = {k: v for k, v in h.items() if k.endswith(".qweight")}
    assert q and all(v["dtype"] == "U8" for v in q.values())
    n_k, groups = 0, 0
    for k, v in q.items():
        base = k.removesuffix(".qweight")
        n, half = v["shape"]
        k_in = bf16[base]["shape"][1]
        assert half * 2 == k_in and bf16[base]["shape"][0] == n
        group = 64 if k_in % 128 else 128  # the largest of 128, 64, 32 dividing the layer's input features
        for part in ("scale", "min"):
            assert h[f"{base}.{part}"]["dtype"] == "F16" and h[f"{base}.{part}"]["shape"] == [n, k_in // group]
        n_k += n * k_in
        groups += n * k_in // group
    nbytes = lambda hdr, keys: sum(hdr[k]["data_offsets"][1] - hdr[k]["data_offsets"][0] for k in keys)  # noqa: E731
    assert nbytes(bf16, [k for k in bf16 if k not in h]) == 2 * n_k
    assert nbytes(h, [k for k in h if k not in bf16]) == n_k // 2 + 4 * groups  # nibbles, fp16 scale and min
    plan = json.loads((art / "plan.json").read_text())
    assert {
        n["kernel"]["name"]
        for p in plan["programs"].values()
        for n in p["nodes"]
        if n.get("op") == "dsc.linear_w4a16.default"
    } == {"triton.w4a16"}
    rep = json.loads((art / "manifest.json").read_text())["int8_report"]
    assert rep["mode"] == "int4" and rep["memory"]["bytes_16bit"] == 4 * rep["memory"]["int8_bytes"]


def test_onnx_export_refuses_int4_in_one_line(compile_artifact, tmp_path):
    from dsc.compiler.onnx_export import export_onnx
    from dsc.errors import UserError

    art = compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="fp32", int4=True, int4_group_size=32)
    with pytest.raises(UserError, match="--int4 weights, which dsc does not export to ONNX"):
        export_onnx(art, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_tp2_equals_tp1(compile_artifact):
    """Weight-only: every rank's groups are groups of the whole weight, so tp 2 is tp 1 up to
    the all-reduce's order of summation."""
    from test_int8 import position_logits, simulate_artifact

    one = compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="fp32", int4=True, int4_group_size=32)
    two = compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="fp32", int4=True, int4_group_size=32, tp=2)
    a, b = position_logits(one, PROMPTS, 6), simulate_artifact(two, PROMPTS)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_group_size_errors(make_checkpoint, tmp_path):
    import dsc
    from dsc.errors import UserError

    ck = str(make_checkpoint("llama-tiny"))  # MLP width 176: no multiple of 32 divides it
    with pytest.raises(UserError, match=r"does not divide the 176 input features of model.layers.0.mlp.down_proj"):
        dsc.compile(ck, tmp_path / "a", int4=True)
    with pytest.raises(UserError, match="not a multiple of 32"):
        dsc.compile(ck, tmp_path / "b", int4=True, int4_group_size=48)
    with pytest.raises(UserError, match="give one"):
        dsc.compile(ck, tmp_path / "c", int4=True, fp8=True)
    with pytest.raises(UserError, match="--int4-group-size needs --int4"):
        dsc.compile(ck, tmp_path / "d", int4_group_size=64)
    assert not any(tmp_path.iterdir())
    art = dsc.compile(ck, tmp_path / "e", dtype="fp32", int4=True, int8_skip=("*.down_proj",))
    h = header(Path(art) / "rank0.safetensors")
    assert "model.layers.0.mlp.down_proj.weight" in h and "model.layers.0.mlp.gate_up_proj.weight.qweight" in h


# -- Triton kernels (child processes) ------------------------------------------------------
KERNEL_CASES = {  # name: (M, K, N, group, bias, config or None = default)
    "gemv-M1K128N47-g32": (1, 128, 47, 32, False, {"kernel": "w4a16_gemv", "BLOCK_N": 8, "BLOCK_K": 32}),
    "gemv-bias-M1K256N33-g128": (1, 256, 33, 128, True, None),
    "gemv-M1K192N40-g64-k32": (1, 192, 40, 64, True, {"kernel": "w4a16_gemv", "BLOCK_N": 4, "BLOCK_K": 32}),
    "mma-M3K128N47-g32": (3, 128, 47, 32, False, None),
    "mma-bias-M19K256N33-g128": (19, 256, 33, 128, True, None),
    "mma-M37K192N40-g64": (
        37,
        192,
        40,
        64,
        False,
        {"kernel": "w4a16_mma", "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32},
    ),
    "mma-M16K128N40-g128": (16, 128, 40, 128, True, None),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def run_interpreted(out: str) -> None:
    from dsc.kernels import int4

    res = {}
    for name, (m, k, n, group, bias, cfg) in KERNEL_CASES.items():
        for dname, dtype in DTYPES.items():
            g = torch.Generator().manual_seed(len(name))
            w = torch.randn(n, k, generator=g) / k**0.5
            p = int4.quantize_weight(w, group)
            x = torch.randn(m, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            want = int4.linear_w4a16_reference(
                x.float(), p["qweight"], p["scale"], p["min"], None if b is None else b.float(), group
            )
            try:
                got = int4.w4a16_matmul(x, p["qweight"], p["scale"], p["min"], b, group, config=cfg)
                tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
                assert got.dtype == dtype and got.shape == (m, n)
                torch.testing.assert_close(got.float(), want, **tol)
                res[f"{name}-{dname}"] = {"ok": True}
            except Exception as e:  # noqa: BLE001 - reported by the test
                res[f"{name}-{dname}"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    Path(out).write_text(json.dumps(res))


def run_aot(out: str) -> None:
    """The default kernel configs at Llama-8B sizes (one and eight rows), built for sm_90 without a GPU."""
    from dsc.kernels import int4
    from dsc.kernels.launch import compile_for_arch

    res = {}
    common = {"X": "*bf16", "W": "*u8", "S": "*fp16", "MN": "*fp16", "B": "*bf16", "Y": "*bf16"}
    for m in (1, 8):
        cfg = int4.w4a16_config(m, 4096, 4096, 128)
        kernel = cfg.pop("kernel")
        opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
        if kernel == "w4a16_gemv":
            fn, types = int4._w4a16_gemv_kernel, {**common, "N": "i32", "K": "i32", "G": "i32"}
        else:
            fn = int4._w4a16_mma_kernel
            types = {**common, **{a: "i32" for a in ("M", "N", "K", "G", "stride_xm", "stride_ym")}}
            cfg["PRECISION"] = "tf32"
        k = compile_for_arch(
            fn,
            types,
            {"GROUP": 128, "HAS_BIAS": False, **cfg},
            num_warps=opts.get("num_warps", 4),
            num_stages=opts.get("num_stages"),
            aligned=("X", "W", "S", "MN", "Y"),
        )
        res[f"{kernel}-M{m}"] = {"ok": bool(k.asm.get("cubin")), "mma": "mma" in k.asm["ptx"]}
    Path(out).write_text(json.dumps(res))


interpreted, compiled = child_fixtures(__file__, "int4")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_reference_in_interpreter(case, dtype, interpreted):
    r = interpreted[f"{case}-{dtype}"]
    assert r["ok"], r.get("error")


def test_kernels_build_for_sm90(compiled):
    assert set(compiled) == {"w4a16_gemv-M1", "w4a16_mma-M8"}
    assert all(v["ok"] for v in compiled.values()), compiled
    assert compiled["w4a16_mma-M8"]["mma"], compiled


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])


def test_real_weights_from_a_q4_1_file_are_reproduced(smollm2, tmp_path):
    """SmolLM2-135M-Instruct's GGUF file stores its linears as Q4_1 (blocks of 32: w = d q + m,
    d = (max - min) / 15, both fp16): --int4 takes groups of 32 for such weights and rounds the
    dequantized weights onto the very same levels, so the artifact's weights and logits are the file's."""
    import dsc
    from dsc.compiler.evaluate import evaluate

    gguf, fp32 = smollm2
    art = dsc.compile(str(gguf), tmp_path / "int4", dtype="fp32", int4=True, max_seq=256)
    assert json.loads((art / "plan.json").read_text())["notes"]["int4"]["group_sizes"] == [32]
    rep = json.loads((art / "manifest.json").read_text())["int8_report"]
    assert rep["mode"] == "int4" and rep["weight_sqnr_db"]["min"] == 999.0, rep["weight_sqnr_db"]
    ev = evaluate(art, against=str(fp32), seq=128, max_tokens=256)
    assert ev["against"]["top1_agreement"] == 1.0 and ev["perplexity"] == pytest.approx(
        ev["against"]["perplexity"], rel=1e-5
    ), ev
