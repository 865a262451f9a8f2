"""GPU check section `families`: every decoder family beyond Llama and GPT-2 on the GPU against
the CPU runtime, which tests/test_families.py checks against transformers.

    pytest tests/gpu/test_gpu_families.py      # $OUT/gpu_families_<shape>.json when OUT is set

Each family's tiny random checkpoint (compiler/random_checkpoint.py: the `*-odd` shapes, sizes
that are not powers of two, sliding windows shorter than the prompts) compiled in fp32, run on
both devices through both paths:
  - static programs (their Triton prefill and decode kernels, decode graphs): greedy tokens equal
    transformers' on the CPU, teacher-forced logits within FP32_ATOL (compiler/verify.py);
  - paged: dsc.LLM (the ragged program, the paged-attention kernels, CUDA graphs), requests
    arriving while others run, prompts chunked at a 32-token budget: greedy tokens equal the
    CPU runtime's.
"""

from __future__ import annotations

import random

import pytest
from gpu_util import write_summary

FP32_ATOL = 1e-4  # the CPU tests' tolerance (tests/test_compile.py)
# Llama and GPT-2: tests/gpu/test_gpu_serving.py and test_gpu_runtime.py
SKIP = {"llama-odd", "gpt2-odd"}


def _family_shapes() -> list[str]:
    from dsc.compiler.random_checkpoint import SHAPES

    return [s for s in SHAPES if s.endswith("-odd") and s not in SKIP] + ["gpt_neox-tiny", "gptj-tiny", "phi3-tiny"]


def _requests(vocab: int, n: int, longest: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(1, longest))], rng.randint(1, 12)) for _ in range(n)]


def _paged(art, device: str, reqs) -> list[list[int]]:
    import dsc
    from dsc.runtime.llm import SamplingParams

    llm = dsc.LLM(art, device=device, max_num_seqs=6, max_num_batched_tokens=32)
    outs = llm.generate(
        [p for p, _ in reqs], [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    )
    assert llm.engine.scheduler.pool.num_used() == 0, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _family_shapes())
def test_family_on_the_gpu_equals_the_cpu_and_transformers(shape, tmp_path):
    import dsc
    from dsc.compiler.random_checkpoint import SHAPES, make_random_checkpoint
    from dsc.compiler.verify import verify_artifact
    from dsc.runtime.engine import load

    vocab = SHAPES[shape][1].get("vocab_size", 512)
    ck = make_random_checkpoint(tmp_path / shape, shape, dtype="float32")
    art = dsc.compile(str(ck), tmp_path / f"a-{shape}", max_batch=6, max_seq=128)
    reqs = _requests(vocab, 16, 40)
    static = verify_artifact(art, ck, prompts=[p for p, _ in reqs[:6]], new_tokens=8, engine=load(art, device="cuda"))
    paged = {dev: _paged(art, dev, reqs) for dev in ("cpu", "cuda")}
    row = {
        "static_tokens_equal_transformers": static.tokens_equal,
        "static_max_abs_err": static.max_abs_err,
        "paged_equal_cpu": paged["cuda"] == paged["cpu"],
        "paged_agreement": sum(a == b for a, b in zip(paged["cuda"], paged["cpu"])) / len(reqs),
    }
    write_summary(f"gpu_families_{shape}", row)
    assert static.tokens_equal and static.max_abs_err <= FP32_ATOL and row["paged_equal_cpu"], row
