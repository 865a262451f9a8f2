"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers.

Each random checkpoint (compiler/random_checkpoint.py, one tensor per expert and projection as
save_pretrained writes them) has 6 experts of widths that are not powers of two, 2 or 3 of
them routed per token; Qwen2-MoE adds a sigmoid-gated shared expert and Qwen's second layer is
a dense MLP. Tolerances are test_compile.py's (fp32: greedy tokens identical, teacher-forced
logits within 1e-4); --tp 2 and --ep 2 against tp 1 as in test_tp.py; int8 by the compile-time
report's logits SQNR.
"""

from __future__ import annotations

import json

import pytest
import torch
from ranks import spawn_ranks
from test_compile import FP32_ATOL, prompts
from test_fusion import check_golden
from test_tp import PROMPTS, _rank_work, teacher_forced

from dsc.compiler.verify import verify_artifact

SHAPES = ["mixtral-odd", "qwen2_moe-odd", "qwen3_moe-odd", "olmoe-odd"]
MOE_LAYERS = {"mixtral-odd": 2, "qwen2_moe-odd": 1, "qwen3_moe-odd": 1, "olmoe-odd": 2}
INT8_MIN_SQNR = 20.0  # test_families.py's


def _plan(art) -> dict:
    return json.loads((art / "plan.json").read_text())


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_generation_matches_transformers(shape, compile_artifact, make_checkpoint):
    art = compile_artifact(shape, dtype="fp32")
    report = verify_artifact(art, make_checkpoint(shape), prompts=prompts(vocab=510), new_tokens=8)
    assert report.tokens_equal, f"greedy tokens differ:\n{report.ref_tokens}\n{report.dsc_tokens}"
    assert report.max_abs_err <= FP32_ATOL, report.summary()
    for program in _plan(art)["programs"].values():  # the experts are one op per MoE layer
        assert sum(n.get("op") == "dsc.moe.default" for n in program["nodes"]) == MOE_LAYERS[shape]


# Qwen2-MoE's shared expert is a dense MLP, split under --tp as any other: its case is --ep
PARALLEL = [("mixtral-odd", "tp"), ("mixtral-odd", "ep"), ("qwen2_moe-odd", "ep")]


@pytest.fixture(scope="module")
def parallel_runs(compile_artifact):
    """tp=1 references, and the tp=2 and ep=2 artifacts run on 2 gloo ranks in one spawn."""
    import dsc

    ref, jobs = {}, {}
    for shape, mode in PARALLEL:
        if shape not in ref:
            e = dsc.load(compile_artifact(shape, dtype="fp32"), device="cpu")
            tokens = e.generate(PROMPTS, max_new_tokens=6, stop_tokens=[]).tokens
            ref[shape] = (tokens, teacher_forced(e, tokens))
        jobs[(shape, mode)] = (str(compile_artifact(shape, dtype="fp32", **{mode: 2})), ref[shape][0])
    return ref, spawn_ranks(2, _rank_work, jobs)


@pytest.mark.parametrize("shape, mode", PARALLEL)
def test_tp2_and_ep2_match_tp1(shape, mode, parallel_runs, compile_artifact):
    ref, ranks = parallel_runs
    for r in range(2):
        greedy, logits, sampled, rank, world = ranks[r][(shape, mode)]
        assert (rank, world) == (r, 2)
        assert greedy == ref[shape][0], f"rank {r}"
        assert (torch.from_numpy(logits) - ref[shape][1]).abs().max() <= 1e-4, f"rank {r}"
    assert ranks[0][(shape, mode)][2] == ranks[1][(shape, mode)][2]  # sampled alike on both ranks
    plan = _plan(compile_artifact(shape, dtype="fp32", **{mode: 2}))
    assert plan["passes"][f"shard_tensor_parallel.experts_{mode}"] == len(plan["programs"]) * MOE_LAYERS[shape]
    note = plan["notes"]["tp"]["experts"]
    assert note.startswith(
        "expert-parallel: each rank holds 3 of the 6 experts" if mode == "ep" else "tensor-parallel inside the experts"
    )
    # the routers stay replicated by design; only Qwen2-MoE's [1, hidden] shared-expert gate is listed
    assert plan["notes"]["tp"].get("replicated_linears", []) == (
        ["model.layers.0.mlp.shared_expert_gate.weight"] if shape == "qwen2_moe-odd" else []
    )


def test_expert_parallel_ranks_hold_whole_experts(compile_artifact, make_checkpoint):
    """--ep 2: rank r's experts weights are experts 3r..3r+2 of the checkpoint, whole."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    art = compile_artifact("mixtral-odd", dtype="fp32", ep=2)
    with safe_open(make_checkpoint("mixtral-odd") / "model.safetensors", framework="pt") as f:
        w2 = [f.get_tensor(f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight") for e in range(6)]
    for r in range(2):
        held = load_file(art / f"rank{r}.safetensors")
        assert torch.equal(held["model.layers.1.mlp.experts.down_proj"], torch.cat(w2[3 * r : 3 * r + 3]))
        assert held["model.layers.1.mlp.experts.first_expert"].tolist() == [3 * r]


def test_int8_experts_report_sqnr_and_keep_the_router(compile_artifact):
    """--int8: the experts' rows int8 (layer 1's kept by --int8-skip), the routers 16-bit."""
    art = compile_artifact("mixtral-odd", dtype="fp32", int8=True, int8_skip=("*.layers.1.mlp.experts",))
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["int8_report"]["logits"]["sqnr_db"] >= INT8_MIN_SQNR
    plan = _plan(art)
    assert plan["passes"]["quantize_int8.experts"] == len(plan["programs"])
    assert plan["passes"]["quantize_int8.keep_router"] == len(plan["programs"]) * 2
    moe = [n for n in plan["programs"]["decode"]["nodes"] if n.get("op") == "dsc.moe.default"]
    assert [a["node"].rsplit(".", 1)[-1] for a in moe[0]["args"][3:5]] == ["qweight", "qweight"]
    assert len(moe[1]["args"]) == 6  # layer 1: float experts, no scales
    weights = {n["name"]: n["dtype"] for n in plan["programs"]["decode"]["nodes"] if n["kind"] == "weight"}
    assert weights["model.layers.0.mlp.experts.gate_up_proj.qweight"] == "int8"
    assert "model.layers.0.mlp.experts.gate_up_proj" not in weights
    assert weights["model.layers.1.mlp.experts.gate_up_proj"] == "float32"
    assert weights["model.layers.0.mlp.gate.weight"] == "float32"


@pytest.mark.parametrize("shape", SHAPES)
def test_golden_plan(shape, compile_artifact):
    check_golden(shape, _plan(compile_artifact(shape, dtype="fp32")))


@pytest.mark.parametrize(
    "shape, overrides, args, message",
    [
        ("llama-tiny", {}, ["--ep", "2"], "--ep 2: model_type 'llama'"),
        ("mixtral-odd", {"num_local_experts": 5}, ["--ep", "2"], "--ep 2 does not divide the 5 experts"),
        ("mixtral-odd", {}, ["--ep", "2", "--tp", "6"], "ep 2 must equal tp 6"),
        ("mixtral-odd", {"intermediate_size": 57}, ["--tp", "2"], "--tp 2 does not divide intermediate_size=57"),
    ],
)
def test_bad_parallel_options_are_one_line(shape, overrides, args, message, make_checkpoint, tmp_path):
    from typer.testing import CliRunner

    from dsc.cli import app

    r = CliRunner().invoke(app, ["compile", str(make_checkpoint(shape, **overrides)), "-o", str(tmp_path / "a"), *args])
    assert r.exit_code != 0 and not (tmp_path / "a").exists()
    (line,) = r.stderr.strip().splitlines()
    assert message in line, line


def test_a_missing_expert_is_one_line(make_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    import dsc
    from dsc.errors import UserError

    src = make_checkpoint("olmoe-odd")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    sd = load_file(src / "model.safetensors")
    save_file({k: v for k, v in sd.items() if ".experts.5.down_proj" not in k}, ck / "model.safetensors")
    with pytest.raises(UserError, match=r"'model.layers.0.mlp.experts.down_proj' has 5 per-expert tensors"):
        dsc.compile(str(ck), tmp_path / "art", dtype="fp32")
    assert not (tmp_path / "art").exists()


def test_dense_moe_equals_the_reference():
    """kernels/moe.py's two plain-torch forms (per-expert token lists; every expert on every
    token, zero-weighted where not routed: the ONNX export's) agree, int8 rows and another
    rank's experts included."""
    from dsc.kernels.moe import moe_dense, moe_reference

    g = torch.Generator().manual_seed(0)
    T, H, inter, experts, k = 9, 20, 12, 5, 2
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(T)])  # global ids 0..7: 3 elsewhere
    w = torch.rand(T, k, generator=g)
    gate_up = torch.randint(-127, 128, (experts * 2 * inter, H), generator=g, dtype=torch.int8)
    down = torch.randint(-127, 128, (experts * H, inter), generator=g, dtype=torch.int8)
    scales = (torch.rand(experts * 2 * inter, 1, generator=g) / 100, torch.rand(experts * H, 1, generator=g) / 100)
    for first in (0, 3):
        want = moe_reference(x, ids, w, gate_up, down, first, *scales)
        assert torch.allclose(moe_dense(x, ids, w, gate_up, down, first, *scales), want, atol=1e-5, rtol=1e-5)
    assert moe_reference(x, ids + 100, w, gate_up, down, 0, *scales).abs().max() == 0  # no local expert
