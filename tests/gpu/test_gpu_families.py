"""GPU check section `families`: the families whose attention carries a variant (Gemma 2's
soft-cap and alternating windows, BLOOM's ALiBi slopes) and Falcon-7B's multi-query layout, as
tiny random models compiled in fp32 and run on CUDA (graphs and eager) beside the CPU runtime.

    pytest tests/gpu/test_gpu_families.py      # well under a minute on an H200; $OUT/gpu_families_<shape>.json when OUT is set

Checked: greedy tokens of CUDA graphs == CUDA eager == CPU (fp32, prompts longer than the
windows), prefill logits within 1e-3 relative of the CPU's; reported: that error. The CPU
runtime itself is checked against transformers in tests/test_families.py.
"""
from __future__ import annotations

import pytest

from gpu_util import write_summary

SHAPES = ["gemma2-odd", "bloom-odd", "falcon-odd"]
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 8, 250, 11, 4, 60], [11, 12], [400, 401, 402, 403, 9], [7]]


def run_on(art, devices: list[tuple[str, dict]]) -> dict:
    """Greedy tokens (8 new) and prefill logits [B, V] on the CPU of each (name, load options)."""
    import dsc

    out = {}
    for name, kw in devices:
        e = dsc.load(art, **kw)
        out[name] = (e.generate(PROMPTS, max_new_tokens=8, stop_tokens=[]).tokens, e.prefill(PROMPTS).float().cpu())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_family_on_cuda_matches_cpu(shape, tmp_path):
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    art = dsc.compile(str(make_random_checkpoint(tmp_path / "ckpt", shape)), tmp_path / "art", dtype="fp32",
                      max_batch=4, max_seq=64)
    outs = run_on(art, [("cpu", dict(device="cpu")), ("cuda-graphs", dict(device="cuda")),
                        ("cuda-eager", dict(device="cuda", cuda_graphs=False))])
    cpu = outs["cpu"]
    rel = {k: float((v[1] - cpu[1]).abs().max() / cpu[1].abs().max()) for k, v in outs.items() if k != "cpu"}
    row = {"tokens_equal_cpu": {k: v[0] == cpu[0] for k, v in outs.items()}, "prefill_rel_err_vs_cpu": rel}
    print(f"{shape}: {row}", flush=True)
    write_summary(f"gpu_families_{shape}", row)
    assert all(row["tokens_equal_cpu"].values()), (shape, {k: v[0] for k, v in outs.items()})
    assert max(rel.values()) <= 1e-3, rel
