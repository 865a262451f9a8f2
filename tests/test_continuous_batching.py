"""Continuous batching (runtime/scheduler.py over the ragged program and a paged KV pool),
checked against transformers' own generate of each prompt alone, fp32, greedy.

Requests arrive at random steps while others run, more than fit at once; prompts are chunked
over steps (token budgets 1, 7, 64, 512), preempted when the pool runs short, and share cached
prefix blocks. After every test the KV pool holds no block (`_no_leak`).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from arrivals import run_arrivals, workload
from ranks import spawn_ranks

import dsc
from dsc.compiler.verify import reference_model
from dsc.errors import UserError
from dsc.runtime.llm import LLMEngine, SamplingParams


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate of one prompt alone, never stopping early."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return out[0, len(prompt) :].tolist()


def _no_leak(engine: LLMEngine) -> None:
    pool = engine.scheduler.pool
    pool.check()
    assert pool.num_used() == 0 and pool.num_free() == pool.num_blocks


FAMILIES = ["llama-tiny", "gpt2-tiny", "mistral-tiny", "qwen2-tiny", "mixtral-odd"]


@pytest.fixture(scope="module")
def references(make_checkpoint):
    return {}


def _reference(references, make_checkpoint, shape, reqs):
    if shape not in references:
        references[shape] = reference_model(make_checkpoint(shape), torch.float32)
    model = references[shape]
    return [hf_generate(model, p, m) for _, p, m in reqs]


# requests per family: Llama (GQA) and Mistral (sliding window) at 36; GPT-2 (learned positions),
# Qwen2 (a window on some layers) at 25 and Mixtral (experts routed per token of a ragged step) at 12,
# which keeps the suite within its CI budget
REQUESTS = {"llama-tiny": 36, "mistral-tiny": 36, "gpt2-tiny": 25, "qwen2-tiny": 25, "mixtral-odd": 12}


@pytest.mark.parametrize("shape", FAMILIES)
def test_requests_arriving_while_others_run_match_transformers(shape, compile_artifact, make_checkpoint, references):
    """REQUESTS[shape] requests, prompts of 1..400 tokens (longer than the sliding windows),
    1..64 new tokens, arriving at random steps; 8 sequences at most run at once."""
    art = compile_artifact(shape, dtype="fp32")
    eng = LLMEngine(art, device="cpu", max_num_seqs=8, max_num_batched_tokens=512)
    reqs = workload(eng.vocab_size, REQUESTS[shape], 400, 64)
    got = run_arrivals(eng, reqs)
    want = _reference(references, make_checkpoint, shape, reqs)
    assert [got[str(i)] for i in range(len(reqs))] == want
    _no_leak(eng)
    assert eng.stats()["generation_tokens_total"] == sum(m for _, _, m in reqs)


@pytest.mark.parametrize("budget, padded", [(1, False), (7, False), (64, False), (100, True)])
def test_chunked_prefill_at_any_token_budget_equals_unchunked(
    budget, padded, compile_artifact, make_checkpoint, references
):
    """padded: every step runs in its (token, sequence) bucket's static buffers, as CUDA graphs do."""
    art = compile_artifact("llama-tiny", dtype="fp32")
    n, longest = (6, 40) if budget == 1 else (16, 200)  # a budget of 1 computes one token per step
    reqs = workload(512, n, longest, 12, seed=budget)
    eng = LLMEngine(art, device="cpu", max_num_seqs=4, max_num_batched_tokens=budget, prefill_buckets=padded)
    got = run_arrivals(eng, reqs)
    assert [got[str(i)] for i in range(n)] == _reference(references, make_checkpoint, "llama-tiny", reqs)
    _no_leak(eng)


def test_preemption_when_the_pool_runs_short_keeps_tokens_equal(compile_artifact, make_checkpoint, references):
    art = compile_artifact("llama-tiny", dtype="fp32")
    reqs = workload(512, 12, 120, 48, seed=3)
    # 14 blocks of 16 tokens: any one request fits (<= 168 tokens), a few together do not
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # k and v, 2 layers, 2 kv heads, 16 tokens, head_dim 16, fp32
    eng = LLMEngine(art, device="cpu", max_num_seqs=8, kv_cache_memory=14 * block_bytes / 2**30)
    assert eng.scheduler.pool.num_blocks == 14
    got = run_arrivals(eng, reqs)
    assert eng.stats()["preemptions"] > 0
    assert [got[str(i)] for i in range(len(reqs))] == _reference(references, make_checkpoint, "llama-tiny", reqs)
    _no_leak(eng)


def test_prefix_caching_computes_a_shared_prefix_once(compile_artifact, make_checkpoint, references):
    art = compile_artifact("llama-tiny", dtype="fp32")
    rng = random.Random(5)
    system = [rng.randrange(512) for _ in range(70)]  # 4 full blocks of 16, and 6 tokens
    reqs = [(0 if i == 0 else 3, system + [rng.randrange(512) for _ in range(rng.randint(1, 20))], 8) for i in range(6)]
    eng = LLMEngine(art, device="cpu", max_num_seqs=8)
    got = run_arrivals(eng, reqs)
    assert [got[str(i)] for i in range(6)] == _reference(references, make_checkpoint, "llama-tiny", reqs)
    stats = eng.stats()
    assert stats["prefix_cache_hit_tokens"] == 5 * 64  # the 5 later requests reuse the 4 full blocks
    assert stats["prompt_tokens_total"] == sum(len(p) for _, p, _ in reqs) - 5 * 64
    _no_leak(eng)
    # off: every prompt computed in full, the same tokens
    eng = LLMEngine(art, device="cpu", max_num_seqs=8, enable_prefix_caching=False)
    assert run_arrivals(eng, reqs) == got and eng.stats()["prefix_cache_hit_tokens"] == 0
    _no_leak(eng)


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(compile_artifact):
    art = compile_artifact("llama-tiny", dtype="fp32")
    llm = dsc.LLM(art, device="cpu", max_num_seqs=8)
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], sp)[0].outputs[0].token_ids
    others = [[rng_tok % 500 + 2 for rng_tok in range(i, i + 9 + i)] for i in range(10)]
    mixed = llm.generate(
        others[:5] + [[5, 6, 7, 8]] + others[5:],
        [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(5)]
        + [sp]
        + [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 5,
    )
    assert mixed[5].outputs[0].token_ids == alone
    other_seed = llm.generate([[5, 6, 7, 8]], SamplingParams(**{**sp.__dict__, "seed": 99}))[0]
    assert other_seed.outputs[0].token_ids != alone
    _no_leak(llm.engine)


def test_the_offline_api(compile_artifact):
    """Text and token-id prompts, n, logprobs with alternatives, stop strings, finish reasons."""
    art = compile_artifact("llama-tiny", dtype="fp32")
    llm = dsc.LLM(art, device="cpu")
    tok = llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text, ids = "dsc is an ahead-of-time compiler", tok.encode("dsc is an ahead-of-time compiler").ids
    a, b = llm.generate([text, ids], greedy)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt == text and b.prompt is None
    assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids)
    assert a.outputs[0].finish_reason == "length" and a.finished
    # logprobs: the chosen token's and 3 alternatives, log-softmax of the logits
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for t, lp in zip(out.token_ids, out.logprobs):
        assert t in lp and len(lp) == 3 + (t not in sorted(lp, key=lp.get)[-3:])
        assert lp[t] == max(lp.values()) and lp[t] <= 0  # greedy: the chosen token is the most likely
    # a stop string cuts the text before it
    full = a.outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if stop.strip():
        cut = llm.generate([text], SamplingParams(max_tokens=12, temperature=0, stop=stop, ignore_eos=True))[0]
        assert cut.outputs[0].text == full[: full.index(stop)] and cut.outputs[0].finish_reason == "stop"
        assert cut.outputs[0].stop_reason == stop
    # n samples of one prompt
    many = llm.generate([ids], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))[0]
    assert [o.index for o in many.outputs] == [0, 1, 2] and all(len(o.token_ids) == 6 for o in many.outputs)
    _no_leak(llm.engine)


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(top_k=-3), "top_k"),
        (dict(logprobs=50), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[10**9]), "stop_token_ids"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_sampling_params_name_their_field(compile_artifact, params, field):
    eng = LLMEngine(compile_artifact("llama-tiny", dtype="fp32"), device="cpu")
    with pytest.raises(UserError, match=field):
        eng.add_request("r", [1, 2, 3], SamplingParams(**params))
    assert not eng.has_unfinished_requests()


def test_prompts_that_cannot_fit_are_refused_with_the_limit(compile_artifact):
    eng = LLMEngine(compile_artifact("llama-tiny", dtype="fp32", max_seq=64), device="cpu")
    with pytest.raises(UserError, match="max_seq is 64"):
        eng.add_request("long", list(range(2, 66)), SamplingParams(max_tokens=1))
    with pytest.raises(UserError, match="outside the vocabulary"):
        eng.add_request("bad", [1, 10**6], SamplingParams())
    with pytest.raises(UserError, match="empty"):
        eng.add_request("empty", [], SamplingParams())
    assert not eng.has_unfinished_requests()


def test_abort_frees_the_blocks_at_once(compile_artifact):
    eng = LLMEngine(compile_artifact("llama-tiny", dtype="fp32"), device="cpu")
    eng.add_request("a", list(range(2, 100)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.add_request("b", list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.scheduler.pool.num_used() > 0
    out = eng.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    eng.abort_request("b")
    _no_leak(eng)
    assert not eng.has_unfinished_requests()


def test_chat_applies_the_tokenizers_template(compile_artifact, make_checkpoint, tmp_path):
    art = compile_artifact("llama-tiny", dtype="fp32")
    llm = dsc.LLM(art, device="cpu")
    with pytest.raises(UserError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    # the same checkpoint with a chat template in its tokenizer_config.json
    import shutil

    ckpt = tmp_path / "chat"
    shutil.copytree(make_checkpoint("llama-tiny"), ckpt)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = dsc.LLM(dsc.compile(str(ckpt), tmp_path / "art", dtype="fp32"), device="cpu")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert llm.engine.apply_chat_template(msgs) == "<system>be brief\n<user>hi\n<assistant>"
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert (
        llm.chat(msgs, sp)[0].outputs[0].token_ids
        == llm.generate("<system>be brief\n<user>hi\n<assistant>", sp)[0].outputs[0].token_ids
    )


def test_generation_config_defaults_are_honoured(compile_artifact, make_checkpoint, tmp_path):
    import shutil

    ckpt = tmp_path / "gen"
    shutil.copytree(make_checkpoint("llama-tiny"), ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": [7, 9]}))
    eng = LLMEngine(dsc.compile(str(ckpt), tmp_path / "art", dtype="fp32"), device="cpu")
    assert eng.generation_defaults == {"temperature": 0.0} and eng.eos_token_ids == [7, 9]
    eng.add_request("r", [5, 6], SamplingParams(max_tokens=3))
    assert eng.scheduler.waiting[0].params.temperature == 0.0
    assert eng.scheduler.waiting[0].params.stop_token_ids == frozenset({7, 9})
    eng.abort_request("r")


def test_int8_equals_the_static_int8_path(compile_artifact):
    art = compile_artifact("llama-tiny", dtype="fp32", int8=True)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [400], [8, 9, 10, 300]]
    static = dsc.load(art, device="cpu").generate_static(prompts, max_new_tokens=10, stop_tokens=[]).tokens
    llm = dsc.LLM(art, device="cpu", max_num_batched_tokens=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == static
    _no_leak(llm.engine)


def _tp_work(rank, jobs):
    art, reqs = jobs
    llm = dsc.LLM(art, device="cpu", max_num_seqs=4, max_num_batched_tokens=32)
    outs = llm.generate(
        [p for _, p, _ in reqs], [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, _, m in reqs]
    )
    seeded = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True))
    eng = llm.engine.engine
    used = llm.engine.scheduler.pool.num_used()
    return [o.outputs[0].token_ids for o in outs + seeded], used, eng.rank


@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-tiny"])
def test_tp2_equals_tp1(shape, compile_artifact):
    reqs = workload(512, 10, 60, 10, seed=11)
    one = _tp_work(0, (compile_artifact(shape, dtype="fp32"), reqs))
    two = spawn_ranks(2, _tp_work, (str(compile_artifact(shape, dtype="fp32", tp=2)), reqs))
    assert two[0][0] == one[0] and two[0][1] == 0
    assert two[1][0] == [] and two[1][2] == 1  # rank 1 ran rank 0's steps and returns nothing


def test_engine_generate_under_tp_returns_on_every_rank(compile_artifact):
    got = spawn_ranks(2, _generate_work, str(compile_artifact("llama-tiny", dtype="fp32", tp=2)))
    want = (
        dsc.load(compile_artifact("llama-tiny", dtype="fp32"), device="cpu")
        .generate([[1, 2, 3], [4, 5]], max_new_tokens=4, stop_tokens=[])
        .tokens
    )
    assert got[0] == got[1] == want


def _generate_work(rank, art):
    return dsc.load(art, device="cpu").generate([[1, 2, 3], [4, 5]], max_new_tokens=4, stop_tokens=[]).tokens


def test_an_artifact_of_the_previous_format_version_is_one_clear_error(compile_artifact, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(compile_artifact("llama-tiny", dtype="fp32"), old)
    m = json.loads((old / "manifest.json").read_text())
    m["format_version"] = 1
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="format version 1, this dsc reads version 2"):
        dsc.load(old, device="cpu", verify=False)


@pytest.mark.parametrize("shape", ["llama-tiny", "granite-odd", "cohere-odd"])
def test_ragged_logits_equal_the_static_prefill(shape, compile_artifact):
    """The ragged program's logits (two prompts in one flat step) are the static prefill's,
    the head's logit epilogue included (Granite's scaling, Cohere's logit scale)."""
    from dsc.runtime.ragged import Step, pack

    engine = dsc.load(compile_artifact(shape, dtype="fp32"), device="cpu")
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 300]]
    want = engine.prefill(prompts)
    bs = engine.plan["kv_pool"]["block_size"]
    step = Step()
    for i, p in enumerate(prompts):
        step.query_start.append(len(step.input_ids))
        step.query_lens.append(len(p))
        step.cache_lens.append(0)
        step.block_tables.append([i])
        step.input_ids += p
        step.positions += range(len(p))
        step.slot_mapping += [i * bs + j for j in range(len(p))]
        step.logits_idx.append(len(step.input_ids) - 1)
    got = engine.ragged(pack(step)).float()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("shape, budget, blocks", [("llama-tiny", 7, None), ("mistral-tiny", 512, 14)])
def test_async_and_sync_stepping_give_the_same_tokens(shape, budget, blocks, compile_artifact):
    """Async scheduling (one step in flight, stops applied a step late) against sync stepping:
    chunked prompts, eos stops (random weights: some outputs hit eos), stop strings absent,
    and a pool short enough to preempt."""
    art = compile_artifact(shape, dtype="fp32")
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4
    kw = dict(
        device="cpu",
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        kv_cache_memory=blocks * block_bytes / 2**30 if blocks else None,
    )
    outs = {}
    for async_scheduling in (True, False):
        eng = LLMEngine(art, async_scheduling=async_scheduling, **kw)
        reqs = workload(eng.vocab_size, 16 if blocks else 10, 100 if blocks else 50, 40, seed=budget)
        params = [SamplingParams(max_tokens=m, temperature=0, stop_token_ids=[7, 11, 13]) for _, _, m in reqs]
        outs[async_scheduling] = (run_arrivals(eng, reqs, params), eng.stats()["preemptions"])
        _no_leak(eng)
    assert outs[True][0] == outs[False][0]
    if blocks:
        assert outs[True][1] > 0
