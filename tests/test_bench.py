"""`dsc bench` and its profiler on CPU: the table, the JSON, the bytes a decode step reads, and
the per-kernel profile's bookkeeping (the GPU timings themselves: scripts/bench_decode.py on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import dsc
from dsc.cli import app
from dsc.runtime.bench import decode_bytes
from dsc.runtime.plan import ATTENTION_OPS
from dsc.runtime.profile import _plan_launches, attribute


def _rank_bytes(art) -> dict[str, int]:
    with safe_open(art / "rank0.safetensors", "pt") as f:
        return {k: f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()}


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_bytes_counts_every_matmul_weight_once_and_gathered_rows(compile_artifact, batch):
    art = compile_artifact("llama-tiny", dtype="fp32")  # untied: the embedding is only gathered
    engine = dsc.load(art, device="cpu")
    sizes = _rank_bytes(art)
    emb = "model.embed_tokens.weight"
    vocab, hidden = engine.weights[emb].shape
    want_w = sum(sizes.values()) - sizes[emb] + batch * hidden * 4
    kv = engine.plan["kv_cache"]
    _, hkv, _, d = kv["shape"]
    want_kv = 2 * kv["layers"] * batch * hkv * 10 * d * 4
    got = decode_bytes(engine, batch, 10)
    assert (got["weights"], got["kv_cache"], got["total"]) == (want_w, want_kv, want_w + want_kv)
    assert sizes[emb] == vocab * hidden * 4


def test_decode_bytes_counts_a_vocab_parallel_ranks_embedding_as_gathered_rows(compile_artifact):
    """At tp=2 the embedding is a lookup in the rank's rows (`dsc.vocab_embedding`, here with its
    all-reduce and layer 0's norm fused in): a step reads at most a row per token of it (as of a
    replicated embedding), not the shard; in the profile's per-node bytes too, with the node's
    other weights (the rank's first id, the norm weight) whole."""
    from dsc.runtime.artifact import open_artifact
    from dsc.runtime.engine import Engine
    from dsc.runtime.profile import _plan_launches

    art_path = compile_artifact("llama-tiny", dtype="fp32", tp=2)
    art = open_artifact(str(art_path), ranks=[0], verify=False)
    engine = Engine(art, 0, art.tp, torch.device("cpu"), cuda_graphs=False)
    emb, lookup_op = "model.embed_tokens.weight", "dsc.vocab_embedding_all_reduce_rmsnorm.default"
    assert any(n.get("op") == lookup_op for n in engine.plan["programs"]["decode"]["nodes"])
    sizes = _rank_bytes(art_path)
    rows, hidden = engine.weights[emb].shape
    assert sizes[emb] == rows * hidden * 4
    kv = decode_bytes(engine, 2, 10)["kv_cache"]
    assert decode_bytes(engine, 2, 10)["weights"] == sum(sizes.values()) - sizes[emb] + 2 * hidden * 4
    plan = _plan_launches(engine, 2, 10)
    nodes = {n["name"]: n for n in engine.plan["programs"]["decode"]["nodes"]}
    lookup = [p for p in plan if nodes[p["node"]]["op"] == lookup_op]
    others = sizes["model.embed_tokens.vocab_start"] + sizes["model.layers.0.input_layernorm.weight"]
    assert [p["bytes"] for p in lookup] == [2 * hidden * 4 + others] and others == 8 + hidden * 4 and kv > 0


def test_bench_cli_writes_table_json_and_profile(compile_artifact, tmp_path):
    art = compile_artifact("llama-tiny", dtype="fp32")
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(
        app,
        [
            "bench",
            str(art),
            "--batch",
            "1",
            "--batch",
            "2",
            "--prefill",
            "8",
            "--context",
            "8",
            "--iters",
            "3",
            "--json",
            str(out),
            "--profile",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "ms/step" in r.output and "prefill     8 tokens" in r.output and "profile: decode batch 1" in r.output
    assert "pdl=off" in r.output  # programmatic dependent launch: Hopper GPUs only (kernels/launch.py)
    res = json.loads(out.read_text())
    assert set(res["decode"]) == {"1", "2"} and set(res["prefill"]) == {"8"}
    for d in res["decode"].values():
        assert d["ms_per_step"] > 0 and d["tokens_per_s"] > 0 and d["bytes"] == d["weight_bytes"] + d["kv_bytes"]
        assert d["ms_per_step_queued"] > 0
    assert "queued" in r.output
    prof = res["profile"]
    layers = json.loads((art / "plan.json").read_text())["model"]["layers"]
    ops = {r["name"]: r for r in prof["by_name"]}
    assert ops["dsc::rotary_attention"]["launches"] == layers  # one attention (rotary fused in) per layer per step
    assert 0 < prof["busy_us"] <= prof["step_us"] * 1.05


def test_profile_attributes_kernels_to_plan_nodes_only_when_they_line_up(compile_artifact):
    art = compile_artifact("llama-tiny", dtype="fp32")
    engine = dsc.load(art, device="cpu")
    plan = _plan_launches(engine, batch=1, context=9)
    nodes = engine.plan["programs"]["decode"]["nodes"]
    assert len(plan) == sum(n["kernel"]["launches"] for n in nodes if n["kind"] == "call")
    # two steps of fake kernels, each taking (launch index + 1) us
    kernels = [(f"k{i}", float(i + 1)) for _ in range(2) for i in range(len(plan))]
    rows = {r["node"]: r for r in attribute(kernels, plan, steps=2)}
    assert sum(r["us"] for r in rows.values()) == pytest.approx(sum(i + 1 for i in range(len(plan))))
    assert sum(r["bytes"] for r in rows.values()) == sum(p["bytes"] for p in plan)
    attn = next(n for n in nodes if n.get("op") in ATTENTION_OPS)
    kv = engine.plan["kv_cache"]
    # K and V of 9 positions, and the rotary tables' row of the one sequence (rot_pos), not the tables
    assert rows[attn["name"]]["bytes"] == 2 * kv["shape"][1] * 9 * kv["shape"][3] * 4 + 2 * kv["shape"][3] * 4
    lm_head = [r for r in rows.values() if r["bytes"] == engine.weights["lm_head.weight"].numel() * 4]
    assert lm_head and all(r["bw"] == pytest.approx(r["bytes"] / (r["us"] * 1e-6)) for r in lm_head)
    emb = next(n for n in nodes if n.get("op") == "aten.embedding.default")
    assert rows[emb["name"]]["bytes"] == engine.weights["model.embed_tokens.weight"][0].numel() * 4  # one row
    assert attribute(kernels[:-1], plan, steps=2) is None  # a launch the plan does not know of: no guessing
    assert attribute([], plan, steps=2) is None


def test_queued_timing_runs_every_step_it_divides_by():
    """`_time_queued`: one warm-up call, then `samples` runs of `reps` calls; the median run's
    seconds per call (each call here sleeps 2 ms, so no run can be shorter)."""
    import time

    from dsc.runtime.bench import _time_queued

    calls = []

    def step():
        calls.append(1)
        time.sleep(0.002)

    s = _time_queued(step, torch.device("cpu"), reps=4, samples=3)
    assert len(calls) == 1 + 4 * 3
    assert 0.002 <= s < 0.05


def test_bench_on_a_missing_artifact_is_one_clear_line(tmp_path):
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "nope")])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert str(tmp_path / "nope") in r.output


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_bench_of_a_tp_artifact_runs_every_rank_and_reports_each(compile_artifact, tmp_path):
    """`dsc bench` on a tp=2 artifact starts its ranks (gloo on CPU), names the all-reduce
    path, and reports every rank's memory share (on CPU: none, no GPU memory to report)."""
    import os
    import subprocess
    import sys

    art = compile_artifact("gpt2-tiny", dtype="fp32", tp=2)
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsc",
            "bench",
            str(art),
            "--device",
            "cpu",
            "--batch",
            "1",
            "--prefill",
            "8",
            "--context",
            "8",
            "--iters",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tp=2" in r.stdout and "all_reduce=gloo" in r.stdout
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["all_reduce"] == "gloo" and res["rank"] == 0
    assert res["memory_per_rank"] == [None, None] and res["decode"]["1"]["ms_per_step"] > 0
    assert res["decode"]["1"]["ms_per_step_queued"] > 0  # every rank queued the same steps (no hang)
    # batch 1: engine.generate per token too, pipelined, every rank in its loop (the token broadcast)
    assert res["generate"]["ms_per_token"] > 0
    assert "generate, batch 1, greedy:" in r.stdout


def test_profile_busy_time_is_the_union_of_overlapping_kernels():
    """With PDL a kernel starts before its predecessor ends: busy time counts the overlap once."""
    from dsc.runtime.profile import _union_us

    assert _union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert _union_us([(0, 5), (5, 6), (1, 2)]) == 6
    assert _union_us([]) == 0


def test_profile_averages_each_launch_of_the_step_in_order():
    """`launches`: the i-th kernel of every step averaged (start after the step's first kernel,
    own time, exposed time), so one launch of a layer can be told from the others of its kernel."""
    from types import SimpleNamespace

    from dsc.runtime.profile import _per_launch

    def ev(name, a, b):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=a, end=b, elapsed_us=lambda: b - a))

    # two steps of [gemv, attention, gemv]; the second gemv starts before attention ends (PDL)
    evs = [ev("g", 0, 10), ev("a", 10, 14), ev("g", 13, 20), ev("g", 100, 112), ev("a", 112, 118), ev("g", 117, 126)]
    rows = _per_launch(evs, [10, 4, 6, 12, 6, 8], steps=2)
    assert [r["name"] for r in rows] == ["g", "a", "g"]
    assert [r["start_us"] for r in rows] == [0, 11, 15]
    assert [r["us"] for r in rows] == [11, 5, 8]
    assert [r["exposed_us"] for r in rows] == [11, 5, 7]


def test_generate_ms_per_token_is_the_span_of_one_run_never_negative(monkeypatch):
    """Each token takes 1 ms on a fake clock and each run's prefill a different, larger time (the
    noise that, subtracted between runs, gave negative times): the measure is exactly 1 ms."""
    import itertools

    from dsc.runtime import bench as bench_mod

    clock = [0.0]
    prefills = itertools.cycle([0.050, 0.001, 0.030, 0.200])
    runs = []

    class FakeEngine:
        vocab_size = 50

        def generate_static(self, prompts, max_new_tokens, stop_tokens, callback):
            runs.append(max_new_tokens)
            clock[0] += next(prefills)
            for step in range(max_new_tokens):
                clock[0] += 0.001
                callback(step, [7])

    monkeypatch.setattr(bench_mod.time, "perf_counter", lambda: clock[0])
    res = bench_mod.generate_ms_per_token(FakeEngine(), 16, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert res["ms_per_token"] == pytest.approx(1.0) and res["tokens"] == [8, 40]
    assert runs == [40] * 4  # a warm-up and the best of 3, each of the long length
