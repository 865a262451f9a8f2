"""`dsc diff`: structural diffs of artifacts and pass dumps, and `--numeric` per-node SQNR.

Structural: two compiles diff empty; adjacent pass dumps name exactly what the pass rewrote;
16-bit vs int8 names every quantized linear and nothing else (but the decode MLP nodes that
each fuses into its own gate_up + SwiGLU op, dsc.linear_swiglu and dsc.linear_w8a16_swiglu). Numeric: every node the
two artifacts share gets
max abs error and SQNR; the first divergence is the first node that differs; tp=2 gathers its
ranks' values back (gloo processes) and matches tp=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dsc
from dsc.cli import app
from dsc.compiler.diff import diff, mentioned_names, rank_tensors
from dsc.compiler.numerics import gather, numeric_diff, value_twins


def nodes(art: Path, program: str = "prefill") -> list[dict]:
    return json.loads((art / "plan.json").read_text())["programs"][program]["nodes"]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory, make_checkpoint):
    """llama-tiny fp16 compiled with --dump-passes: (artifact, dump folder)."""
    d = tmp_path_factory.mktemp("dumps")
    art = dsc.compile(str(make_checkpoint("llama-tiny")), d / "artifact", dtype="fp16", dump_passes=d / "passes")
    return art, d / "passes"


def test_two_compiles_diff_empty(dumped, compile_artifact):
    other = compile_artifact("llama-tiny", dtype="fp16")  # another folder, no dumps
    d = diff(dumped[0], other)
    assert d["identical"] and not mentioned_names(d)
    res = CliRunner().invoke(app, ["diff", str(dumped[0]), str(other)])
    assert res.exit_code == 0 and "identical" in res.output


def test_adjacent_pass_dumps_name_exactly_what_bind_kv_cache_rewrote(dumped):
    by_pass = {p.name.split("_", 1)[1]: p for p in sorted(dumped[1].iterdir())}
    before, after = by_pass["canonicalize"], by_pass["bind_kv_cache"]
    assert int(after.name[:2]) == int(before.name[:2]) + 1  # adjacent
    d = diff(before, after)
    named: set[str] = set()
    for prog, p in d["programs"].items():
        traced, bound, cache = (
            ("dsc.ragged_attention.default", "dsc.paged_attention.default", "kv_pool.")
            if prog == "ragged"
            else ("dsc.causal_attention.default", "dsc.attention.default", "kv_cache.")
        )
        old = [n["name"] for n in nodes(before, prog) if n.get("op") == traced]
        new = [n["name"] for n in nodes(after, prog) if n.get("op") == bound]
        caches = [n["name"] for n in nodes(after, prog) if n.get("target", "").startswith(cache)]
        assert len(old) == len(new) == 2 and len(caches) == 4
        assert [(r["a"]["name"], r["b"]["name"]) for r in p["replaced"]] == list(zip(old, new))
        assert [n["name"] for n in p["added"]] == caches
        assert not p["removed"] and not p["changed"]  # the attention's readers are not "changed"
        assert p["op_counts"] == {bound: [0, 2], traced: [2, 0]}
        named |= set(old + new + caches)
    assert mentioned_names(d) == named
    assert d["plan"]["counters.bind_kv_cache.attention"] == [None, 4]  # prefill and decode
    assert d["plan"]["counters.bind_kv_cache.paged_attention"] == [None, 2]  # the ragged program


def test_diff_reports_dtype_change_and_exit_code(compile_artifact):
    a, b = compile_artifact("llama-tiny", dtype="fp32"), compile_artifact("llama-tiny", dtype="fp16")
    res = CliRunner().invoke(app, ["diff", str(a), str(b), "--json"])
    assert res.exit_code == 1
    d = json.loads(res.output)
    assert d["manifest"]["options.dtype"] == ["fp32", "fp16"]
    w = d["weights"]["rank0"]["changed"]
    assert {x["name"] for x in w} == {
        k for k, v in rank_tensors(b / "rank0.safetensors").items() if v["dtype"] == "F16"
    }
    assert all(x["fields"]["dtype"] == ["F32", "F16"] and "sha256" in x["fields"] for x in w)
    text = CliRunner().invoke(app, ["diff", str(a), str(b)]).output
    assert "options.dtype: fp32 -> fp16" in text and "op counts that differ" in text


def test_diff_errors_exit_2(tmp_path, dumped):
    res = CliRunner().invoke(app, ["diff", str(dumped[1]), str(tmp_path)])
    assert res.exit_code == 2 and "--dump-passes folder" in res.output


@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-tiny"])
def test_int8_diff_names_every_quantized_linear_and_nothing_else(compile_artifact, shape):
    a, b = compile_artifact(shape, dtype="fp16"), compile_artifact(shape, dtype="fp16", int8=True)
    d = diff(a, b)
    quantized = {
        n["name"].rsplit(".", 1)[0]
        for prog in ("prefill", "decode")
        for n in nodes(b, prog)
        if n.get("op") in ("dsc.linear_w8a16.default", "dsc.linear_w8a8.default")
    }
    assert quantized
    # and the MLPs whose decode gate_up GEMV is fused with its swiglu (decode_linears): 16-bit into
    # dsc.linear_swiglu, int8 into dsc.linear_w8a16_swiglu, which the diff pairs as a replacement
    mlps = {n["name"].rsplit(".", 1)[0] for n in nodes(a, "decode") if n.get("op") == "dsc.linear_swiglu.default"}
    assert mlps == {
        n["name"].rsplit(".", 1)[0] for n in nodes(b, "decode") if n.get("op") == "dsc.linear_w8a16_swiglu.default"
    }
    assert bool(mlps) == (shape == "llama-tiny")  # GPT-2's MLP: gelu, nothing fused
    swiglu = {
        n["name"]
        for art in (a, b)
        for n in nodes(art, "decode")
        if any(n["name"].startswith(m + ".") for m in mlps)
        and n.get("op") in ("dsc.linear_swiglu.default", "dsc.linear_w8a16_swiglu.default")
    }
    outside = sorted(
        name
        for name in mentioned_names(d)
        if name not in swiglu and not any(name.startswith(m + ".") for m in quantized)
    )
    assert not outside, f"names outside the quantized linears: {outside}"
    for prog, p in d["programs"].items():  # every quantized linear shows as the op it replaced
        linears = ("aten.linear.default", "dsc.linear.default")  # decode's and ragged's 16-bit linears are dsc.linear
        fused = {f"{m}.gate_up_proj" for m in mlps} if prog in ("decode", "ragged") else set()
        assert {
            r["a"]["name"].rsplit(".", 1)[0] for r in p["replaced"] if r["a"].get("op") in linears
        } == quantized - fused


# -- numeric -------------------------------------------------------------------------------
def test_numeric_diff_of_an_artifact_with_itself_is_exact(compile_artifact):
    a = compile_artifact("llama-tiny", dtype="fp16")
    d = numeric_diff(a, a, program="decode", prompts=[[5, 7, 11, 13]])
    assert d["nodes"] and all(r["exact"] for r in d["nodes"])
    assert d["first_divergent"] is None and d["worst"] is None


def test_numeric_diff_across_dtypes_names_the_first_divergence(compile_artifact):
    a, b = compile_artifact("llama-tiny", dtype="fp32"), compile_artifact("llama-tiny", dtype="fp16")
    d = numeric_diff(a, b, threshold=200.0)
    tensors = [n["name"] for n in nodes(a) if n["kind"] == "call" and "dtype" in n]  # not ints, tuples
    assert [r["a"] for r in d["nodes"]] == tensors + ["output"] and not d["skipped"]
    first_lossy = next(r for r in d["nodes"] if not r["exact"])
    assert d["first_divergent"] == first_lossy
    assert d["worst"]["sqnr_db"] == min(r["sqnr_db"] for r in d["nodes"] if r["sqnr_db"] is not None)
    assert 45 < d["output"]["sqnr_db"] < 90  # fp16 vs fp32 logits
    res = CliRunner().invoke(app, ["diff", "--numeric", str(a), str(b), "--token-ids", "1,2,3", "--top", "3"])
    assert res.exit_code == 0 and "worst node" in res.output and "no node below 30.0 dB" in res.output


def test_numeric_diff_int8_reports_sqnr_per_quantized_linear(compile_artifact):
    a, b = compile_artifact("llama-tiny", dtype="fp16"), compile_artifact("llama-tiny", dtype="fp16", int8=True)
    d = numeric_diff(a, b, threshold=100.0)
    q = [r for r in d["nodes"] if r["op"].startswith("dsc.linear_w8a")]
    int8_nodes = [n["name"] for n in nodes(b) if n.get("op", "").startswith("dsc.linear_w8a")]
    assert [r["b"] for r in q] == int8_nodes and all(r["a"].endswith(".linear") for r in q)
    assert all(15 < r["sqnr_db"] < 70 for r in q)
    # everything before the first int8 linear is computed identically
    assert d["first_divergent"]["b"] == int8_nodes[0]
    assert d["worst"]["sqnr_db"] <= min(r["sqnr_db"] for r in q)
    assert d["output"]["sqnr_db"] > 15


def test_value_twins_follow_the_readers():
    a = [
        {"name": "x", "kind": "input"},
        {"name": "lin", "kind": "call", "op": "aten.linear.default", "args": [{"node": "x"}]},
        {"name": "add", "kind": "call", "op": "aten.add.Tensor", "args": [{"node": "lin"}, {"node": "x"}]},
    ]
    b = a[:2] + [
        {"name": "lin.all_reduce", "kind": "call", "op": "dsc.all_reduce.default", "args": [{"node": "lin"}]},
        {"name": "add", "kind": "call", "op": "aten.add.Tensor", "args": [{"node": "lin.all_reduce"}, {"node": "x"}]},
    ]
    assert value_twins(a, b) == {"x": "x", "lin": "lin.all_reduce", "add": "add"}


def test_value_twins_keep_integer_values_a_rank_rewrites():
    """--ep: each rank's moe reads its local expert ids (the router's ids minus its first
    expert), which are not the router's value: the ids are compared with the ids."""
    ids = {"name": "ids", "kind": "call", "op": "operator.getitem", "dtype": "int64", "args": []}
    a = [ids, {"name": "moe", "kind": "call", "op": "dsc.moe.default", "dtype": "float32", "args": [{"node": "ids"}]}]
    b = [
        ids,
        {"name": "sub", "kind": "call", "op": "aten.sub.Tensor", "dtype": "int64", "args": [{"node": "ids"}]},
        {"name": "moe", "kind": "call", "op": "dsc.moe.default", "dtype": "float32", "args": [{"node": "sub"}]},
    ]
    assert value_twins(a, b) == {"ids": "ids", "moe": "moe"}


def test_gather_rebuilds_tensor_parallel_values():
    full = torch.arange(24.0).reshape(2, 3, 4)
    assert torch.equal(gather(list(full.chunk(2, -1)), full.shape)[0], full)  # column-parallel
    assert torch.equal(gather([full, full], full.shape)[0], full)  # replicated
    parts = [full * 0.25, full * 0.75]  # partial sums before an all-reduce
    assert torch.allclose(gather(parts, full.shape)[0], full)
    assert gather(list(full.chunk(3, 1)), torch.Size([2, 3, 5]))[0] is None


def test_numeric_diff_tp2_matches_tp1(compile_artifact):
    a, b = compile_artifact("llama-tiny", dtype="fp32"), compile_artifact("llama-tiny", dtype="fp32", tp=2)
    d = numeric_diff(a, b, prompts=[[3, 1, 4, 1, 5, 9]], threshold=80.0)
    assert not d["skipped"] and d["first_divergent"] is None
    assert any(r["op"] == "dsc.all_gather.default" for r in d["nodes"])  # lm_head vs its gathered logits
    assert any(r.get("gathered", "").startswith("sharded") for r in d["nodes"])  # column-parallel outputs
    # row-parallel outputs are compared after their all-reduce; where fuse_add_norm folded the
    # all-reduce into the norm (every Llama layer), no node holds the reduced value and the
    # ranks' partial sums are summed instead
    nodes_b = json.loads((b / "plan.json").read_text())["programs"]["prefill"]["nodes"]
    fused_in = {
        a["node"]
        for n in nodes_b
        if n.get("op") == "dsc.all_reduce_add_rmsnorm.default"
        for a in n["args"]
        if isinstance(a, dict)
    }
    summed = [r for r in d["nodes"] if r.get("gathered") == "partial sums, summed"]
    assert summed and all(r["b"] in fused_in for r in summed)
    # the vocab-parallel lookup, reduced, and layer 0's input norm: the outputs of the one node
    # fuse_add_norm made of them and the all-reduce, each the same bits as tp=1's value
    by_b, by_a = {n["name"]: n for n in nodes_b}, {r["a"]: r for r in d["nodes"]}
    for i, a in enumerate(("model.embed_tokens.embedding", "model.layers.0.input_layernorm.rmsnorm")):
        out = by_b[by_a[a]["b"]]
        assert out["args"] == [{"node": "model.embed_tokens.vocab_embedding_all_reduce_rmsnorm"}, i], out
        assert by_a[a]["exact"], by_a[a]
