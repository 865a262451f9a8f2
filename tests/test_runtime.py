"""The thin runtime: loads an artifact with torch + safetensors alone, and generates.

Greedy equality with transformers is in test_compile.py; here: what generate() promises
(sampling, stop tokens, streaming, limits) and what the runtime must not import.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import dsc
from dsc.compiler.verify import reference_greedy, reference_model
from dsc.errors import UserError
from dsc.runtime.sampling import sample

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [400], [8, 9, 10, 300]]


@pytest.fixture(scope="module")
def engine(compile_artifact):
    return dsc.load(compile_artifact("llama-tiny", dtype="fp32"), device="cpu")


@pytest.fixture(scope="module")
def small_engine(compile_artifact):
    """max_seq 16, max_batch 2: for the limits."""
    return dsc.load(compile_artifact("llama-tiny", dtype="fp32", max_seq=16, max_batch=2), device="cpu")


@pytest.fixture(scope="module")
def greedy(engine):
    return engine.generate(PROMPTS, max_new_tokens=10, stop_tokens=[]).tokens


def test_runtime_never_imports_transformers_or_the_compiler(compile_artifact):
    """In a fresh process where importing transformers, dsc.compiler or dsc.passes fails (as on a
    production box without them), load an artifact and generate, through the API and the CLI."""
    art = compile_artifact("llama-tiny", dtype="fp32")
    code = textwrap.dedent("""
        import sys
        BLOCKED = ("transformers", "dsc.compiler", "dsc.passes")

        class Block:
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                    raise ImportError(f"the runtime imported {name}")

        sys.meta_path.insert(0, Block())
        import dsc
        engine = dsc.load(sys.argv[1], device="cpu")
        print(engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=4).tokens)
        from dsc.cli import app
        app(["generate", sys.argv[1], "--prompt", "Hello world", "--max-new-tokens", "3", "--json"],
        standalone_mode=False)
        loaded = [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]
        assert not loaded, loaded
        print("clean")
    """)
    r = subprocess.run([sys.executable, "-c", code, str(art)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("clean") and '"text"' in r.stdout


# -- sampling ------------------------------------------------------------------------------


def test_sampling_is_reproducible_with_a_seed(engine):
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, stop_tokens=[])
    a = engine.generate(PROMPTS, seed=7, **kw).tokens
    assert engine.generate(PROMPTS, seed=7, **kw).tokens == a
    assert engine.generate(PROMPTS, seed=8, **kw).tokens != a


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)])
def test_sampling_restricted_to_the_top_token_is_greedy(engine, greedy, kw):
    got = engine.generate(PROMPTS, max_new_tokens=10, temperature=1.3, seed=3, stop_tokens=[], **kw)
    assert got.tokens == greedy


def test_greedy_is_repeatable_and_independent_of_the_batch(engine, greedy):
    assert engine.generate(PROMPTS, max_new_tokens=10, stop_tokens=[]).tokens == greedy
    for p, want in zip(PROMPTS, greedy):
        assert engine.generate([p], max_new_tokens=10, stop_tokens=[]).tokens == [want]


def test_top_k_and_top_p_keep_only_their_tokens():
    # probabilities 0.5, 0.3, 0.2, then ~0 for the rest of a 10-token vocabulary
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * 7])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    for kw, allowed in [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.6), {0, 1}),
        (dict(top_p=0.5), {0}),
        (dict(top_k=3, top_p=0.9), {0, 1, 2}),
    ]:
        drawn = set(sample(logits, temperature=1.0, generator=g, **kw).tolist())
        assert drawn == allowed, kw
    counts = torch.bincount(sample(logits, temperature=1.0, generator=g), minlength=10)[:3] / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


# -- stopping, streaming, limits ------------------------------------------------------------


def test_stop_tokens_end_each_sequence_at_its_own_stop(engine, greedy):
    stop = greedy[0][3]
    res = engine.generate(PROMPTS, max_new_tokens=10, stop_tokens=[stop])
    for want, got, reason in zip(greedy, res.tokens, res.finish_reasons):
        if stop in want:
            assert got == want[: want.index(stop) + 1] and reason == "stop"
        else:
            assert got == want and reason == "length"
    assert res.finish_reasons[0] == "stop"


def test_default_stop_tokens_are_the_models_eos(engine):
    assert engine.eos_token_ids == [1]  # the checkpoint's "</s>"
    t = engine.generate([PROMPTS[0]], max_new_tokens=4, stop_tokens=[]).tokens[0]
    assert engine.generate([PROMPTS[0]], max_new_tokens=4, stop_tokens=None).tokens[0] == (
        t[: t.index(1) + 1] if 1 in t else t
    )


def test_streaming_callback_sees_every_token_as_it_is_made(engine, greedy):
    stop = greedy[1][2]
    events = []
    res = engine.generate(
        PROMPTS, max_new_tokens=8, stop_tokens=[stop], callback=lambda step, toks: events.append((step, list(toks)))
    )
    assert [s for s, _ in events] == list(range(len(events)))
    for i, toks in enumerate(res.tokens):
        column = [t[i] for _, t in events]
        assert [t for t in column if t is not None] == toks
        assert all(t is None for t in column[len(toks) :])  # nothing after a sequence finished


def _unpipelined(engine, prompts, n, stop, **kw):
    """generate_static() as a plain loop: sample, read the tokens back, then decode the next step."""
    gen = torch.Generator().manual_seed(kw.pop("seed")) if kw.get("temperature", 0) > 0 else None
    engine.reset()
    out, done, lens = [[] for _ in prompts], [False] * len(prompts), torch.tensor([len(p) for p in prompts])
    logits = engine.prefill(prompts)
    for step in range(n):
        tok = sample(logits, generator=gen, **kw)
        for i, t in enumerate(tok.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = t in stop
        if all(done) or step == n - 1:
            return out, step + 1
        logits = engine.decode(tok, lens + step)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.9, top_k=50, top_p=0.9, seed=5)])
def test_pipelined_static_generate_gives_the_plain_loops_tokens_and_one_step_more_at_most(
    engine, greedy, kw, monkeypatch
):
    """generate_static() queues step t + 1 before it reads step t's tokens: the same tokens (sampled
    ones too: the generator is drawn in the same order), and when every sequence has stopped
    early it has decoded one step more than the plain loop, never more."""
    stop = [greedy[0][2], greedy[1][4], greedy[2][3], greedy[3][5]] if not kw else []
    want, steps = _unpipelined(engine, PROMPTS, 9, set(stop), **dict(kw))
    calls = []
    decode = engine.decode
    monkeypatch.setattr(engine, "decode", lambda tok, pos: calls.append(1) or decode(tok, pos))
    got = engine.generate_static(PROMPTS, max_new_tokens=9, stop_tokens=stop, **kw)
    assert got.tokens == want
    if stop:
        assert steps < 9 and all(t[-1] in stop for t in got.tokens)  # every sequence stopped early
        assert len(calls) == steps  # the plain loop's steps - 1 decodes, and the one queued
    else:
        assert len(calls) == 8  # max_new_tokens - 1: nothing queued past the last step


@pytest.mark.parametrize("n", [1, 5])
def test_max_new_tokens(engine, greedy, n):
    res = engine.generate(PROMPTS, max_new_tokens=n, stop_tokens=[])
    assert res.tokens == [g[:n] for g in greedy] and res.finish_reasons == ["length"] * len(PROMPTS)


@torch.no_grad()
def test_prompts_at_the_max_seq_boundary(small_engine, make_checkpoint):
    ref = reference_model(make_checkpoint("llama-tiny"), torch.float32)
    edge, short = list(range(20, 35)), [3, 4, 5]  # 15 tokens = max_seq - 1; 3 tokens
    res = small_engine.generate([edge, short], max_new_tokens=5, stop_tokens=[])
    assert res.tokens[0] == reference_greedy(ref, edge, 1)[0]  # one token fills the cache
    assert res.tokens[1] == reference_greedy(ref, short, 5)[0]  # the full row did not disturb it
    assert res.finish_reasons == ["length", "length"]
    res = small_engine.generate([edge[:-1]], max_new_tokens=10, stop_tokens=[])
    assert res.tokens[0] == reference_greedy(ref, edge[:-1], 2)[0]  # prompt + generated == max_seq
    with pytest.raises(UserError, match="max_seq"):
        small_engine.generate([list(range(16))], max_new_tokens=1)
    with pytest.raises(UserError, match="max_batch"):
        small_engine.generate_static([[1], [2], [3]], max_new_tokens=1)
    # the scheduler takes more prompts than max_batch, as its KV pool allows
    res = small_engine.generate([[1], [2], [3]], max_new_tokens=3, stop_tokens=[])
    assert res.tokens == [reference_greedy(ref, [i], 3)[0] for i in (1, 2, 3)]
