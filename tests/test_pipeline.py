"""Pipeline parallelism (runtime/pipeline.py): the ragged program cut into stages of consecutive
layers, each stage on its own (tensor-parallel) ranks, activations passed with gloo send/recv on
the CPU, one micro-batch per stage in flight (runtime/executor.py's PipelineCore). Tokens must
equal one rank's, through continuous batching, `dsc generate` and `dsc serve`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import openai
import pytest
from arrivals import run_arrivals, workload
from ranks import spawn_ranks
from typer.testing import CliRunner

from dsc.cli import app
from dsc.errors import UserError
from dsc.runtime.artifact import open_artifact
from dsc.runtime.llm import LLMEngine, SamplingParams
from dsc.runtime.pipeline import program_layers, split_layers, stage_program

LAYERS = {"llama-tiny": {"num_hidden_layers": 6}, "gpt2-tiny": {"n_layer": 5}}
ENV = {"OMP_NUM_THREADS": "1"}


def _art(compile_artifact, shape: str, **options):
    return compile_artifact(shape, ckpt_kwargs=LAYERS[shape], dtype="fp32", **options)


def _serve(engine: LLMEngine, reqs) -> list[list[int]]:
    done = run_arrivals(engine, reqs)
    return [done[str(i)] for i in range(len(reqs))]


def _stage_work(rank, job):
    """Every rank loads its stage; rank 0 serves the arrivals, the others follow its steps."""
    art, pp, reqs, offload = job
    eng = LLMEngine(
        art, device="cpu", max_num_seqs=4, max_num_batched_tokens=32, pipeline_parallel_size=pp, offload=offload
    )
    inner = eng.engine
    facts = {
        "stage": inner.stage,
        "tp_rank": inner.tp_rank,
        "weights": sorted(inner.weights),
        "kv_layers": sorted(inner.kv_pool),
        "streamed": (inner.offload or {}).get("streamed_layers", 0),
    }
    if rank != 0:
        eng.follow()
        return facts
    try:
        tokens = _serve(eng, reqs)
        parts = getattr(eng.scheduler, "parts", [eng.scheduler])
        return {
            **facts,
            "tokens": tokens,
            "peak": getattr(eng.core, "peak_in_flight", 1),
            "parts": [p.stats()["generation_tokens_total"] for p in parts],
        }
    finally:
        eng.shutdown()


def _jobs(rank, jobs):
    """Several engines, one after another, in one spawned world."""
    return {name: _stage_work(rank, job) for name, job in jobs.items()}


REQS = workload(500, 6, 60, 8, seed=3)
LAYERS_OF = {"llama-tiny": 6, "gpt2-tiny": 5, "llama-8": 8}


def _reference(art) -> list[list[int]]:
    return _serve(LLMEngine(str(art), device="cpu", max_num_seqs=4, max_num_batched_tokens=32), REQS)


@pytest.fixture(scope="module")
def two_ranks(compile_artifact):
    """One world of two gloo ranks running: Llama and GPT-2 in two stages; an 8-layer Llama in
    two stages of 4, each streaming its layers from the rank file (offload); a tp=2 Llama with
    offload. Returns {job: ({rank: what it saw}, one rank's tokens)}."""
    arts = {
        "llama-tiny": _art(compile_artifact, "llama-tiny"),
        "gpt2-tiny": _art(compile_artifact, "gpt2-tiny"),
        "llama-8": compile_artifact("llama-tiny", ckpt_kwargs={"num_hidden_layers": 8}, dtype="fp32"),
    }
    jobs = {
        "llama-tiny": (str(arts["llama-tiny"]), 2, REQS, None),
        "gpt2-tiny": (str(arts["gpt2-tiny"]), 2, REQS, None),
        "llama-8": (str(arts["llama-8"]), 2, REQS, "disk"),
        "tp2-offload": (str(_art(compile_artifact, "llama-tiny", tp=2)), 1, REQS, "disk"),
    }
    got = spawn_ranks(2, _jobs, jobs)
    want = {"tp2-offload": "llama-tiny"}
    return {name: ({r: got[r][name] for r in got}, _reference(arts[want.get(name, name)])) for name in jobs}


def _check_stages(got: dict, want: list[list[int]], shape: str, tp: int, pp: int) -> None:
    assert got[0]["tokens"] == want
    # one micro-batch per stage in flight at once, each with its share of the requests
    assert got[0]["peak"] == pp and len(got[0]["parts"]) == pp and all(got[0]["parts"])
    assert [got[r]["stage"] for r in range(tp * pp)] == [r // tp for r in range(tp * pp)]
    layer_weights = [{w for w in got[r]["weights"] if re.match(r".*\.\d+\.", w)} for r in range(0, tp * pp, tp)]
    assert not any(a & b for i, a in enumerate(layer_weights) for b in layer_weights[i + 1 :])
    kv = [set(got[r]["kv_layers"]) for r in range(0, tp * pp, tp)]
    assert sum(len(k) for k in kv) == 2 * LAYERS_OF[shape] and not set.intersection(*kv)


@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-tiny"])
def test_two_stages_give_one_ranks_tokens_through_continuous_batching(shape, two_ranks):
    """Requests arriving while others run, prompts chunked at a budget of 32 tokens: one rank's
    tokens; each stage holds its own layers' weights and KV pool only."""
    got, want = two_ranks[shape]
    assert all(got[r]["weights"] for r in got) and not any(got[r]["streamed"] for r in got)
    _check_stages(got, want, shape, tp=1, pp=2)


def test_tp2_times_two_stages_give_one_ranks_tokens(compile_artifact):
    jobs = {"tp2-pp2": (str(_art(compile_artifact, "llama-tiny", tp=2)), 2, REQS, None)}
    got = spawn_ranks(4, _jobs, jobs)
    _check_stages(
        {r: got[r]["tp2-pp2"] for r in got}, _reference(_art(compile_artifact, "llama-tiny")), "llama-tiny", tp=2, pp=2
    )


def test_a_stage_streams_its_own_layers_with_offload(two_ranks):
    """8 layers in two stages of 4, each stage streaming its layers from the rank file through
    its three layer buffers."""
    got, want = two_ranks["llama-8"]
    assert got[0]["streamed"] == got[1]["streamed"] == 4
    _check_stages(got, want, "llama-8", tp=1, pp=2)


def test_tp2_with_offload_equals_tp1(two_ranks):
    got, want = two_ranks["tp2-offload"]
    assert got[0]["tokens"] == want and got[0]["streamed"] == got[1]["streamed"] == 6


def test_the_split_is_contiguous_balanced_and_hands_over_what_the_next_stages_read(compile_artifact):
    art = open_artifact(_art(compile_artifact, "llama-tiny"), ranks=[], verify=False)
    nodes = art.plan["programs"]["ragged"]["nodes"]
    header = art.rank_header(0)
    layers = program_layers(nodes)
    assert layers == [f"model.layers.{i}" for i in range(6)]
    for pp in (2, 3, 6):
        split = split_layers(nodes, header, pp)
        stages = [split[k] for k in layers]
        assert stages == sorted(stages) and set(stages) == set(range(pp))  # contiguous, every stage used
        cuts = [stage_program(nodes, split, s) for s in range(pp)]
        for s in range(1, pp):
            assert [v for v, _ in cuts[s].recv] == list(cuts[s - 1].send)
            # between layers of a Llama the residual stream is two tensors: the layer's output and the sum
            assert len(cuts[s].recv) == 2
        assert not cuts[-1].send and not cuts[0].recv
        assert "model.embed_tokens.weight" in cuts[0].weights and "lm_head.weight" in cuts[-1].weights
        assert all("lm_head.weight" not in c.weights for c in cuts[:-1])
    # embedding and head (16 layers' worth each, as tiny models go) pull the split's cuts inward
    split = split_layers(nodes, header, 2)
    assert [split[k] for k in layers].count(0) == 3


def test_stage_counts_are_one_line_naming_the_flag(compile_artifact):
    art = str(_art(compile_artifact, "llama-tiny"))
    for bad, text in (("0", "expected an integer 1..64"), ("7", "7 stages for 6 layers")):
        r = CliRunner().invoke(app, ["generate", art, "--token-ids", "1,2", "--device", "cpu", "--pp", bad])
        assert r.exit_code != 0 and "Traceback" not in r.output, r.output
        assert r.output.strip().startswith("error: --pipeline-parallel-size") and text in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
    with pytest.raises(UserError, match="--pipeline-parallel-size"):
        LLMEngine(art, device="cpu", pipeline_parallel_size=True)


def test_inspect_shows_where_the_stages_cut(compile_artifact):
    art = str(_art(compile_artifact, "llama-tiny"))
    r = CliRunner().invoke(app, ["inspect", art, "--pp", "3"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    for s, (a, b) in enumerate([(0, 1), (2, 3), (4, 5)]):
        assert f"pipeline stage {s}: 2 layers (model.layers.{a} .. model.layers.{b})" in text, text


def test_an_encoder_does_not_run_in_stages(compile_artifact):
    art = str(compile_artifact("bert-odd", dtype="fp32"))
    r = CliRunner().invoke(app, ["serve", art, "--device", "cpu", "--pp", "2"])
    assert r.exit_code != 0 and "only decoders run in pipeline stages" in r.output, r.output


def test_dsc_generate_starts_the_stages_itself(compile_artifact):
    art = str(_art(compile_artifact, "gpt2-tiny"))
    prompts = [[5, 6, 7, 8], [9]]
    cmd = [
        sys.executable,
        "-m",
        "dsc",
        "generate",
        art,
        "--json",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
        "--pp",
        "2",
        *sum((["--token-ids", ",".join(map(str, p))] for p in prompts), []),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**env, **ENV})
    assert two.returncode == 0, two.stderr
    lines = [json.loads(x) for x in two.stdout.splitlines() if x.startswith("{")]
    want = LLMEngine(art, device="cpu")
    for i, p in enumerate(prompts):
        want.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0))
    done = {}
    while want.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in want.step() if o.finished})
    assert [line["tokens"] for line in lines] == [done["0"], done["1"]]  # printed by rank 0 only


def test_dsc_serve_in_two_stages_answers_like_one_rank(compile_artifact):
    art = _art(compile_artifact, "llama-tiny")
    want = LLMEngine(str(art), device="cpu")
    prompt = [7, 99, 301, 45, 12]
    want.add_request("a", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    expect = None
    while want.has_unfinished_requests():
        for out in want.step():
            if out.finished:
                expect = out.outputs[0].token_ids
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsc", "serve", str(art), "--port", "0", "--device", "cpu", "--pp", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **ENV},
    )
    try:
        line = proc.stdout.readline()
        port = int(re.search(r":(\d+)/v1", line).group(1)) if "/v1" in line else pytest.fail(line + proc.stderr.read())
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        r = client.completions.create(
            model=art.name,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert r.choices[0].model_extra["token_ids"] == expect
        proc.terminate()
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()
