"""GPU check section `serving`: continuous batching (dsc.LLM over the ragged program, the paged
KV pool, CUDA graphs per decode bucket) on the GPU against the CPU runtime and against itself.

    pytest tests/gpu/test_gpu_serving.py      # $OUT/gpu_serving_*.json when OUT is set

1. Tiny Llama / GPT-2 / Mistral (an 8-token sliding window) in fp32: requests arriving while
   others run, prompts longer than the window, chunked at a 48-token budget; the GPU's greedy
   tokens (graphs captured) equal the CPU runtime's, which tests/test_continuous_batching.py
   checks against transformers.
2. A 2-layer model with Llama-8B's attention dims in bf16: the decode buckets' CUDA-graph
   replays give the eager engine's tokens (cuda_graphs=False), with and without --int8.
"""

from __future__ import annotations

import random
import traceback

import pytest
from gpu_util import write_summary


def _requests(vocab: int, n: int, longest: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(1, longest))], rng.randint(1, 24)) for _ in range(n)]


def _greedy(llm, reqs) -> list[list[int]]:
    from dsc.runtime.llm import SamplingParams

    outs = llm.generate(
        [p for p, _ in reqs], [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    )
    pool = llm.engine.scheduler.pool
    assert pool.num_used() == 0, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
def test_tiny_models_on_the_gpu_equal_the_cpu(tmp_path):
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    rows, fails = {}, []
    for shape in ("llama-tiny", "gpt2-tiny", "mistral-tiny"):
        try:
            ck = make_random_checkpoint(tmp_path / shape, shape, dtype="float32")
            art = dsc.compile(str(ck), tmp_path / f"a-{shape}", max_batch=8, max_seq=256)
            reqs = _requests(512, 30, 120)
            got = {}
            for name, kw in (("cpu", dict(device="cpu")), ("cuda", dict(device="cuda"))):
                llm = dsc.LLM(art, max_num_seqs=8, max_num_batched_tokens=48, **kw)
                got[name] = _greedy(llm, reqs)
                if name == "cuda":
                    assert llm.engine.engine.ragged.captured, "decode buckets not captured"
            rows[shape] = {
                "tokens_equal_cpu": got["cuda"] == got["cpu"],
                "agreement": sum(a == b for a, b in zip(got["cuda"], got["cpu"])) / len(reqs),
            }
            assert got["cuda"] == got["cpu"], shape
            print(f"ok   {shape}: {rows[shape]}", flush=True)
        except Exception:  # noqa: BLE001  every case runs; the failures are listed at the end
            fails.append(f"{shape}:\n" + "".join(traceback.format_exc().splitlines(True)[-8:]))
    write_summary("gpu_serving_tiny", rows)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_llama_8b_dims_graph_buckets_equal_eager(tmp_path, int8):
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    ck = make_random_checkpoint(tmp_path / "ck", "llama-8b", dtype="bfloat16", num_hidden_layers=2, tokenizer=False)
    art = dsc.compile(str(ck), tmp_path / "art", max_batch=16, max_seq=512, int8=int8 or None)
    reqs = _requests(128256, 40, 300, seed=1)
    graphs = _greedy(dsc.LLM(art, device="cuda", max_num_seqs=32, kv_cache_memory=2), reqs)
    eager = _greedy(dsc.LLM(art, device="cuda", max_num_seqs=32, kv_cache_memory=2, cuda_graphs=False), reqs)
    agree = sum(a == b for a, b in zip(graphs, eager)) / len(reqs)
    write_summary(f"gpu_serving_8b_dims{'_int8' if int8 else ''}", {"agreement": agree})
    assert graphs == eager
