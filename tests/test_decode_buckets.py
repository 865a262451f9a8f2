"""Decode buckets, padding and the static memory plan (runtime/decode.py, runtime/memory_plan.py)."""

from __future__ import annotations

import json

import pytest
import torch

from dsc.runtime.decode import choose_bucket
from dsc.runtime.memory_plan import plan_memory


@pytest.mark.parametrize("batch,bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 6), (6, 6)])
def test_choose_bucket_smallest_that_fits(batch, bucket):
    assert choose_bucket((1, 2, 4, 6), batch) == bucket


def test_choose_bucket_rejects_oversize():
    with pytest.raises(ValueError, match="exceeds the largest decode bucket 6"):
        choose_bucket((1, 2, 4, 6), 7)


def test_default_buckets_are_powers_of_two_up_to_max_batch():
    from dsc.compiler.options import make_options

    assert make_options(max_batch=64).buckets() == (1, 2, 4, 8, 16, 32, 64)
    assert make_options(max_batch=6).buckets() == (1, 2, 4, 6)
    assert make_options(max_batch=8, decode_buckets=(2, 8)).buckets() == (2, 8)


@pytest.mark.parametrize("shape", ["llama-odd", "gpt2-odd"])
def test_padded_bucket_step_equals_exact_batch(compile_artifact, shape):
    """A batch of 3 runs in bucket 4: its logits equal the program run at batch 3, and the
    padding row does not disturb the live sequences' KV-cache rows."""
    import dsc

    art = compile_artifact(shape, dtype="fp32", max_batch=6, decode_buckets=(1, 4, 6))
    e = dsc.load(art, device="cpu")
    assert e.buckets == (1, 4, 6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, e.vocab_size, (n,), generator=g).tolist() for n in (7, 3, 5)]
    e.prefill(prompts)
    tok = torch.tensor([5, 6, 7])
    pos = torch.tensor([7, 3, 5])
    before = {k: v[:3].clone() for k, v in e.kv_cache.items()}
    padded = e.decode(tok, pos)  # bucket 4
    # the same step, run directly at batch 3 on a cache restored to the pre-step state
    for k, v in e.kv_cache.items():
        v[:3].copy_(before[k])
    exact = e.run("decode", tok[:, None], pos[:, None], pos, torch.zeros(3, dtype=torch.long))
    assert e._decode.steps[4].logits.shape[0] == 4
    # equal up to the matmul's batch-dependent summation order (fp32)
    torch.testing.assert_close(padded, exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(-1), exact.argmax(-1))


def test_generate_uses_buckets_and_matches_without_padding(compile_artifact):
    import dsc

    art = compile_artifact("llama-tiny", dtype="fp32", max_batch=4, decode_buckets=(4,))
    e = dsc.load(art, device="cpu")
    prompts = [[1, 2, 3, 4], [5, 6]]
    together = e.generate(prompts, max_new_tokens=6, stop_tokens=[]).tokens
    alone = [e.generate([p], max_new_tokens=6, stop_tokens=[]).tokens[0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_memory_plan_never_overlaps_live_buffers(compile_artifact, batch):
    art = compile_artifact("llama-odd", dtype="fp32", max_batch=8)
    plan = json.loads((art / "plan.json").read_text())
    for program, sizes in (("decode", {"batch": batch}), ("prefill", {"batch": batch, "seq": 9})):
        arena, bufs = plan_memory(plan["programs"][program]["nodes"], sizes)
        total = sum(b.nbytes for b in bufs)
        assert 0 < max(b.nbytes for b in bufs) <= arena < total  # reuse happened
        for i, a in enumerate(bufs):
            assert a.offset >= 0 and a.offset + a.nbytes <= arena
            for b in bufs[i + 1 :]:
                live_together = a.start <= b.end and b.start <= a.end
                disjoint = a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
                assert not live_together or disjoint or 0 in (a.nbytes, b.nbytes), (a, b)


def test_memory_plan_grows_with_batch(compile_artifact):
    art = compile_artifact("llama-odd", dtype="fp32", max_batch=8)
    plan = json.loads((art / "plan.json").read_text())
    a1, _ = plan_memory(plan["programs"]["decode"]["nodes"], {"batch": 1})
    a8, _ = plan_memory(plan["programs"]["decode"]["nodes"], {"batch": 8})
    assert a8 > a1


@pytest.mark.parametrize("max_batch", [1, 2])
def test_every_symbolic_size_in_the_plan_is_named(compile_artifact, max_batch):
    """Plan shapes use only `batch` and `seq`: with --max-batch 1 (a batch range of 1..2) export
    gave each input its own batch symbol, and sizing the workspace (`dsc bench`) failed on it."""
    import re

    from dsc.runtime.memory_plan import workspace_bytes

    art = compile_artifact("llama-tiny", dtype="fp32", max_batch=max_batch, max_seq=64)
    plan = json.loads((art / "plan.json").read_text())
    for program in ("prefill", "decode"):
        for n in plan["programs"][program]["nodes"]:
            shape = n.get("shape") if isinstance(n.get("shape"), list) else []
            for d in shape:
                assert isinstance(d, int) or not re.search(r"\bs\d+\b", str(d)), (program, n["name"], n["shape"])
    assert workspace_bytes(plan, "decode", max_batch) > 0


def test_prefill_length_buckets():
    from dsc.runtime.prefill import length_buckets

    assert length_buckets(100) == (16, 32, 64, 100)
    assert length_buckets(64) == (16, 32, 64)
    assert length_buckets(10) == (10,)


@pytest.mark.parametrize("shape", ["llama-odd", "gpt2-odd", "mistral-tiny"])
def test_padded_prefill_equals_exact_length(compile_artifact, shape):
    """The GPU's prefill path (prompts right-padded to a length bucket, runtime/prefill.py), run
    eagerly on CPU (load's prefill_buckets=True): the last real tokens' logits and every real
    KV-cache slot equal those of the prefill at the exact length, and greedy decoding afterwards
    gives the same tokens. mistral-tiny has an 8-token sliding window, shorter than these prompts."""
    import dsc

    art = compile_artifact(shape, dtype="fp32", max_batch=4, max_seq=64)
    e = dsc.load(art, device="cpu")
    g = torch.Generator().manual_seed(2)
    lens = (19, 5, 12)  # the batch's longest (19) runs in bucket 32
    prompts = [torch.randint(0, e.vocab_size, (n,), generator=g).tolist() for n in lens]
    exact_tokens = e.generate(prompts, max_new_tokens=5, stop_tokens=[]).tokens
    e.reset()
    exact = e.prefill(prompts)
    exact_cache = {k: v[:3].clone() for k, v in e.kv_cache.items()}

    assert not e._prefill.pad  # on CPU, by default, prefills run at the exact length
    e = dsc.load(art, device="cpu", prefill_buckets=True)  # the padded path, eagerly (as the GPU's graphs)
    padded = e.prefill(prompts)
    assert list(e._prefill.steps) == [(3, 32)]
    torch.testing.assert_close(padded, exact, rtol=1e-5, atol=1e-5)
    for k, v in exact_cache.items():
        for i, n in enumerate(lens):  # slots 0..n-1 of each live row; later ones hold padding
            torch.testing.assert_close(e.kv_cache[k][i, :, :n], v[i, :, :n], rtol=1e-5, atol=1e-5)
    assert e.generate(prompts, max_new_tokens=5, stop_tokens=[]).tokens == exact_tokens
    assert list(e._prefill.steps) == [(3, 32)]  # the same shape again: the same static step


def test_run_checks_its_input_shapes(compile_artifact):
    """Engine.run takes [batch, seq] ids and positions and [batch] cache positions / last
    indices: anything else is one clear ValueError, not a view error from inside the program
    (a [1, 1, n] prompt once made a GPU bench fail that way)."""
    import dsc

    e = dsc.load(compile_artifact("llama-tiny", dtype="fp32"), device="cpu")
    ids, zero = torch.tensor([[1, 2, 3]]), torch.zeros(1, dtype=torch.long)
    pos = torch.arange(3)[None]
    assert e.run("prefill", ids, pos, zero, torch.tensor([2])).shape == (1, e.vocab_size)
    with pytest.raises(ValueError, match=r"input_ids and position_ids must both be \[batch, seq\], got \[1, 1, 3\]"):
        e.run("prefill", ids[None], pos, zero, torch.tensor([2]))
    with pytest.raises(ValueError, match=r"cache_pos and last_idx must be \[batch\] = \[1\]"):
        e.run("prefill", ids, pos, zero, torch.tensor(2))
    with pytest.raises(ValueError, match="no program 'decoder'"):
        e.run("decoder", ids, pos, zero, torch.tensor([2]))


def test_prefill_capture_failure_falls_back_to_eager(compile_artifact, monkeypatch, capsys):
    """A prefill whose CUDA-graph capture raises (an op that cannot be captured) says so in one
    line and runs eagerly at its exact length from then on (simulated on CPU)."""
    import dsc
    from dsc.runtime.prefill import PrefillRunner, PrefillStep

    e = dsc.load(compile_artifact("llama-tiny", dtype="fp32"), device="cpu")
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    want = e.prefill(prompts)
    runner = PrefillRunner(e._prefill.program, e.max_seq, e.device, cuda_graphs=False, buckets=True)
    runner.graphs = True  # as on CUDA
    monkeypatch.setattr(runner, "_pool", object())

    def fail(self, pool):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(PrefillStep, "capture", fail)
    e._prefill = runner
    e.reset()
    torch.testing.assert_close(e.prefill(prompts), want, rtol=0, atol=0)
    err = capsys.readouterr().err
    assert "capturing the prefill of 2 x 16 tokens failed (RuntimeError: operation not permitted" in err
    assert "more detail" not in err and not runner.steps and not runner.graphs


def test_returned_logits_are_not_the_static_buffers(compile_artifact):
    """fp32 logits from prefill and decode do not share memory with the static steps' outputs,
    which a CUDA graph's next replay overwrites (fp32's .float() would return them as they are)."""
    import dsc
    from dsc.runtime.prefill import PrefillRunner

    e = dsc.load(compile_artifact("llama-tiny", dtype="fp32"), device="cpu")
    e._prefill = PrefillRunner(e._prefill.program, e.max_seq, e.device, cuda_graphs=False, buckets=True)
    got = e.prefill([[1, 2, 3]])
    static = e._prefill.steps[(1, 16)].logits
    assert static.dtype == torch.float32 and got.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()
    got = e.decode(torch.tensor([7]), torch.tensor([3]))
    static = e._decode.steps[1].logits
    assert static.dtype == torch.float32 and got.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()
