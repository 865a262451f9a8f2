"""`dsc export-onnx`: standard ONNX ops, int8 weights as DequantizeLinear, onnxruntime matches.

Tolerance (compiler/onnx_export.py TOLERANCE_DB, docs/artifact.md): onnxruntime (CPU)
logits vs the dsc runtime (CPU) on the same tokens, SQNR >= 80 dB for fp32, >= 40 dB for fp16
(33 dB with W8A8, whose int8 activations flip a step where the runtimes' fp16 rounding differs),
>= 25 dB for a bf16 artifact exported with --fp32 (bf16 rounding in the dsc run).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dsc
from dsc.compiler.numerics import sqnr_db
from dsc.compiler.onnx_export import INPUTS, export_onnx, tolerance_db
from dsc.errors import UserError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


CASES = [
    pytest.param("llama-tiny", dict(dtype="fp16"), False, id="llama-fp16"),
    pytest.param("gpt2-tiny", dict(dtype="fp16"), False, id="gpt2-fp16"),
    pytest.param("llama-tiny", dict(dtype="fp16", int8=True), False, id="llama-fp16-w8a16"),
    pytest.param("gpt2-tiny", dict(dtype="fp16", int8=True, int8_mode="w8a8"), False, id="gpt2-fp16-w8a8"),
    pytest.param("llama-tiny", dict(dtype="bf16", int8=True, int8_group_size=16), True, id="llama-bf16-grouped-fp32"),
]


@pytest.mark.parametrize("shape, options, fp32", CASES)
def test_export_runs_in_onnxruntime_and_matches(compile_artifact, tmp_path, shape, options, fp32):
    art = compile_artifact(shape, **options)
    (report,) = export_onnx(art, tmp_path, fp32=fp32)
    assert report["ok"], report
    model = onnx.load(str(tmp_path / "rank0.onnx"))
    assert {n.domain for n in model.graph.node} <= {""}, "only standard ONNX ops"
    ops = {n.op_type for n in model.graph.node}
    assert ("DequantizeLinear" in ops) == bool(options.get("int8"))
    assert not ops & {"QLinearMatMul", "MatMulInteger"}  # QDQ, not pre-quantized operators

    # the documented contract, run by hand: a prefill from zero caches, then the caches it returns
    sess = ort.InferenceSession(str(tmp_path / "rank0.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    engine = dsc.load(art, device="cpu")
    assert names == [*INPUTS, *engine.kv_cache]
    assert [o.name for o in sess.get_outputs()] == ["logits", *(f"{c}.next" for c in engine.kv_cache)]
    prompt = [7, 3, 11, 2, 5]
    want = engine.prefill([prompt])  # [1, V]
    dtype = torch.float32 if fp32 else engine.dtype
    caches = [torch.zeros_like(t, dtype=dtype).numpy() for t in engine.kv_cache.values()]
    feeds = dict(zip(INPUTS, (np.array([prompt]), np.arange(5)[None], np.zeros(1, np.int64), np.array([4]))))
    logits, *next_caches = sess.run(None, {**feeds, **dict(zip(engine.kv_cache, caches))})
    tol = tolerance_db(engine, fp32)
    assert sqnr_db(want, torch.from_numpy(logits).float()) >= tol
    k0 = torch.from_numpy(next_caches[0]).float()  # [max_batch, kv_heads, max_seq, head_dim]
    assert k0[0, :, :5].abs().sum() > 0 and k0[0, :, 5:].abs().sum() == 0 and k0[1:].abs().sum() == 0


def test_tensor_parallel_export_keeps_the_collectives(compile_artifact, tmp_path):
    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)
    (r,) = export_onnx(art, tmp_path, ranks=[1])
    assert r["rank"] == 1 and [p.name for p in tmp_path.iterdir()] == ["rank1.onnx"]
    # checker passes; onnxruntime's CPU build has no collectives to run them
    assert r["nonstandard_ops"] == ["com.microsoft.AllGather", "com.microsoft.AllReduce"]
    assert "prefill" not in r
    with pytest.raises(UserError, match="rank 2 is out of range for tp=2"):
        export_onnx(art, tmp_path, ranks=[2])
