"""Ahead-of-time kernel binaries on a GPU: an artifact compiled with `--target sm_90` (on this
machine with the GPU hidden, or carried from a CPU box through AOT_ARTIFACTS) serves through
its cubins with no Triton JIT, and gives the tokens of the JIT path.

    pytest tests/gpu/test_gpu_binaries.py
    AOT_ARTIFACTS=DIR pytest ...     # also every artifact under DIR (compiled elsewhere)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_util import ROOT, write_summary

SHAPES = ("llama-tiny", "gpt2-tiny", "mixtral-odd", "qwen2-tiny")
RESULTS: dict = {}


def _compile_without_gpu(work: Path, shape: str) -> Path:
    """The artifact compiled in a child process that sees no GPU, as on a CI box."""
    code = (
        "import sys, dsc\nfrom dsc.compiler.random_checkpoint import make_random_checkpoint\n"
        f"ck = make_random_checkpoint({str(work / 'ckpt')!r}, {shape!r}, dtype='bfloat16')\n"
        f"dsc.compile(str(ck), {str(work / 'art')!r}, max_batch=8, max_seq=256, targets=('sm_90',))\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
    return work / "art"


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 37, 20, 130, 1, 64)]


def _tokens(art: Path, trust: bool) -> tuple[list[list[int]], dict, int, list[str]]:
    import dsc
    from dsc.kernels import binaries as B

    llm = dsc.LLM(art, device="cuda", kv_cache_memory=0.25, trust_kernels=trust)
    vocab = llm.engine.engine.vocab_size
    params = dsc.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(vocab)], params)
    launches = sum(b.launches for b in B.INSTALLED.values())
    status = dict(llm.engine.engine.kernel_binaries)
    warned = sorted(B._WARNED)
    del llm
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], status, launches, warned


def _check(art: Path, name: str) -> None:
    jit, s0, _, _ = _tokens(art, trust=False)
    aot, s1, launches, warned = _tokens(art, trust=True)
    RESULTS[name] = {
        "untrusted": s0["status"],
        "trusted": s1,
        "binary_launches": launches,
        "jit_fallbacks": warned,
        "tokens_equal": jit == aot,
    }
    write_summary("binaries", RESULTS)
    assert s0["status"] == "untrusted"
    assert s1["status"] == "loaded" and s1["binaries"] > 0
    assert launches > 0
    assert warned == [], f"kernels compiled with Triton despite the binaries: {warned}"
    assert aot == jit


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_binaries_compiled_without_a_gpu_serve_the_jit_tokens(tmp_path, shape):
    _check(_compile_without_gpu(tmp_path, shape), shape)


@pytest.mark.gpu
def test_carried_artifacts(request):
    root = os.environ.get("AOT_ARTIFACTS")
    if not root:
        pytest.skip("AOT_ARTIFACTS not set")
    for art in sorted(p.parent for p in Path(root).glob("*/manifest.json")):
        _check(art, f"carried:{art.name}")
