"""GPU check section `fp8`: dsc::linear_fp8 on CUDA (kernels/fp8.py) and an --fp8 artifact on a GPU.

    pytest tests/gpu/test_gpu_fp8.py        # under a minute on an H200

- the Triton activation quantizer equals the plain-torch one bit for bit (e4m3 values and
  scales), bf16 / fp16 / fp32 inputs, rows of 1 to 2,048 tokens;
- the cuBLASLt fp8 matmul against the reference's fp32 product of the same e4m3 operands:
  SQNR >= 40 dB (the output is rounded to bf16), with bias, M = 1 to 2,048, Llama-8B sizes,
  sizes cuBLASLt refuses (not multiples of 16: the reference's arithmetic on the device);
  replayed from a CUDA graph with new inputs;
- a bf16 --fp8 artifact of a random Llama (hidden 256) on the GPU: its prefill logits as close
  to the unquantized fp32 model's (SQNR) as the CPU runtime's of the same artifact, within 1 dB;
  dsc.LLM's paged path (CUDA graphs, continuous batching) gives the static programs' tokens.
Writes $OUT/gpu_fp8.json when OUT is set.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_util import write_summary

from dsc.kernels import fp8

pytestmark = pytest.mark.gpu
RESULTS: dict = {}


def sqnr(ref, got) -> float:
    noise = (ref.double() - got.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 4096), (7, 14336), (2048, 4096), (33, 200)])
def test_quantize_rows_equals_the_reference(m, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = (torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-2, 2, m, device="cuda")[:, None]).to(dtype)
    x[0, :3] = 0
    q, s = fp8.quantize_rows(x)
    rq, rs = fp8.quantize_activation(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 8, 64, 2048])
@pytest.mark.parametrize("k,n,bias", [(4096, 6144, False), (14336, 4096, False), (4096, 1024, True), (200, 72, True)])
def test_matmul_against_the_reference(m, k, n, bias):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    w = torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)
    p = fp8.quantize_weight(w)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    ref = fp8.linear_fp8_reference(x.float(), p["qweight"], p["scale"], None if b is None else b.float())
    got = torch.ops.dsc.linear_fp8(x, p["qweight"], p["scale"], b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    s = sqnr(ref, got.float())
    RESULTS.setdefault("matmul_sqnr_db", {})[f"M{m}_K{k}_N{n}{'_bias' if bias else ''}"] = s
    assert s >= 40, s


def test_cuda_graph_replay_with_new_inputs():
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(1024, 4096, device="cuda", generator=g) / 64
    p = fp8.quantize_weight(w)
    x = torch.randn(8, 4096, device="cuda", generator=g).bfloat16()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.ops.dsc.linear_fp8(x, p["qweight"], p["scale"], None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.dsc.linear_fp8(x, p["qweight"], p["scale"], None)
    for _ in range(3):
        x.copy_(torch.randn(8, 4096, device="cuda", generator=g).bfloat16())
        graph.replay()
        want = torch.ops.dsc.linear_fp8(x, p["qweight"], p["scale"], None)
        assert torch.equal(y, want)


def test_artifact_on_the_gpu(tmp_path):
    """fp8 rounds each activation, so two correct runs of one fp8 artifact (CPU and GPU, bf16
    each) differ by more than their 16-bit rounding; what must hold is that the GPU path is
    as close to the unquantized model as the CPU reference path is."""
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    ck = make_random_checkpoint(tmp_path / "ck", "llama-demo", dtype="bfloat16")
    art = dsc.compile(str(ck), tmp_path / "art", dtype="bf16", fp8=True)
    ref_art = dsc.compile(str(ck), tmp_path / "ref", dtype="fp32")
    prompts = [[5, 17, 300, 2, 99, 41, 7, 250, 3, 8, 60, 12, 13], [400, 12, 9, 77, 1, 33, 501], [42, 6, 210]]
    ref = dsc.load(ref_art, device="cpu").prefill(prompts).float()
    cpu, gpu = dsc.load(art, device="cpu"), dsc.load(art, device="cuda")
    s_cpu, s_gpu = sqnr(ref, cpu.prefill(prompts).float()), sqnr(ref, gpu.prefill(prompts).float().cpu())
    tg = gpu.generate(prompts, max_new_tokens=16, stop_tokens=[]).tokens
    del gpu
    llm = dsc.LLM(str(art), device="cuda")
    outs = llm.generate(prompts, dsc.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    tp = [list(o.outputs[0].token_ids) for o in outs]
    RESULTS["artifact"] = {
        "cpu_fp8_vs_fp32_logits_sqnr_db": s_cpu,
        "gpu_fp8_vs_fp32_logits_sqnr_db": s_gpu,
        "paged_equals_static_tokens": tp == tg,
    }
    write_summary("gpu_fp8", RESULTS)
    assert s_gpu >= s_cpu - 1.0, RESULTS["artifact"]
    assert tp == tg, RESULTS["artifact"]
