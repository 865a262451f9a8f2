"""Weight offload on a GPU: layers streamed through the ring of device buffers on a copy stream
(from pinned host memory, or from the rank file through pinned staging buffers) give the
resident engine's greedy tokens, through continuous batching.

    pytest tests/gpu/test_gpu_offload.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_util import ROOT, write_summary

SHAPES = {"llama-tiny": {"num_hidden_layers": 7}, "gpt2-tiny": {"n_layer": 7}}
RESULTS: dict = {}


def _compile(work: Path, shape: str) -> Path:
    code = (
        "import dsc\nfrom dsc.compiler.random_checkpoint import make_random_checkpoint\n"
        f"ck = make_random_checkpoint({str(work / 'ckpt')!r}, {shape!r}, dtype='bfloat16', **{SHAPES[shape]!r})\n"
        f"dsc.compile(str(ck), {str(work / 'art')!r}, max_batch=8, max_seq=256)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT)
    return work / "art"


def _tokens(art: Path, **kw):
    import dsc

    llm = dsc.LLM(art, device="cuda", kv_cache_memory=0.25, **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 37, 20, 130, 1, 64)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], dsc.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    ring = llm.engine.engine.ring
    facts = {"offload": llm.engine.engine.offload, "loads": ring.loads if ring else 0}
    del llm
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], facts


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_streamed_layers_give_the_resident_tokens_on_a_gpu(tmp_path, shape):
    art = _compile(tmp_path, shape)
    want, _ = _tokens(art)
    for where in ("cpu", "disk"):
        got, facts = _tokens(art, offload=where)
        RESULTS[f"{shape}/{where}"] = {"tokens_equal": got == want, **facts}
        write_summary("offload", RESULTS)
        assert facts["offload"]["streamed_layers"] == 7 and facts["loads"] > 7
        assert got == want, where
