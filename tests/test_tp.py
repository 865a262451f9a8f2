"""Tensor parallelism on CPU with gloo: the shard_tensor_parallel pass, tp validation, rank
files, and the runtime (Python API under spawned ranks, torchrun, and `dsc generate`'s relaunch).

Ranks are spawned processes joined by a gloo file store. One spawn per tp loads every model's
artifact, so process start-up is paid once per tp, not once per case. References come from
the tp=1 artifact of the same checkpoint (fp32): greedy tokens, and teacher-forced logits
(every step fed the tp=1 tokens, so one early near-tie cannot derail the comparison).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from ranks import ENV, spawn_ranks
from safetensors import safe_open

import dsc
from dsc.errors import UserError
from dsc.runtime.plan import ATTENTION_OPS

PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 8, 250, 11], [11, 12], [400, 401, 402, 403, 9], [7]]
NEW = 6
CASES = [
    ("llama-tiny", 2),
    ("llama-tiny", 4),
    ("gpt2-tiny", 2),
    ("gpt2-tiny", 4),
    ("llama-odd", 2),
    ("opt-tiny", 2),
    ("phi-tiny", 2),
    ("gemma-tiny", 2),
]


def teacher_forced(engine, ref_tokens: list[list[int]]) -> torch.Tensor:
    """Logits [NEW, B, V]: prefill, then decode steps fed the reference tokens."""
    out = [engine.prefill(PROMPTS)]
    lens = torch.tensor([len(p) for p in PROMPTS])
    for step in range(NEW - 1):
        out.append(engine.decode(torch.tensor([r[step] for r in ref_tokens]), lens + step))
    return torch.stack(out)


def _rank_work(rank: int, jobs: dict) -> dict:
    """One rank: load each artifact through the Python API and run the same work as tp=1."""
    out = {}
    for name, (art, ref_tokens) in jobs.items():
        e = dsc.load(art, device="cpu")
        greedy = e.generate(PROMPTS, max_new_tokens=NEW, stop_tokens=[]).tokens
        logits = teacher_forced(e, ref_tokens).numpy()
        # a different seed on every rank: only the broadcast from rank 0 keeps them in step
        sampled = e.generate(
            PROMPTS, max_new_tokens=NEW, temperature=0.9, top_k=50, top_p=0.95, seed=100 + rank, stop_tokens=[]
        ).tokens
        out[name] = (greedy, logits, sampled, e.rank, e.world)
    return out


@pytest.fixture(scope="module")
def reference(compile_artifact):
    """tp=1 greedy tokens and teacher-forced logits per model."""
    ref = {}
    for shape in {s for s, _ in CASES}:
        e = dsc.load(compile_artifact(shape, dtype="fp32"), device="cpu")
        tokens = e.generate(PROMPTS, max_new_tokens=NEW, stop_tokens=[]).tokens
        ref[shape] = (tokens, teacher_forced(e, tokens))
    return ref


@pytest.fixture(scope="module")
def ranks(compile_artifact, reference):
    """{tp: {rank: {shape: (greedy, logits, sampled, rank, world)}}}, one spawn per tp."""
    out = {}
    for tp in sorted({tp for _, tp in CASES}):
        jobs = {s: (str(compile_artifact(s, dtype="fp32", tp=tp)), reference[s][0]) for s, t in CASES if t == tp}
        out[tp] = spawn_ranks(tp, _rank_work, jobs)
    return out


def plan(art: Path) -> dict:
    return json.loads((Path(art) / "plan.json").read_text())


def config(art: Path) -> dict:
    return json.loads(
        (Path(json.loads((Path(art) / "manifest.json").read_text())["source"]["model"]) / "config.json").read_text()
    )


# -- numerics -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape, tp", CASES)
def test_greedy_tokens_match_tp1(shape, tp, ranks, reference):
    for r in range(tp):
        greedy, _, _, rank, world = ranks[tp][r][shape]
        assert (rank, world) == (r, tp)
        assert greedy == reference[shape][0], f"rank {r}"


@pytest.mark.parametrize("shape, tp", CASES)
def test_logits_match_tp1_and_are_identical_on_every_rank(shape, tp, ranks, reference):
    want = reference[shape][1]
    first = torch.from_numpy(ranks[tp][0][shape][1])
    assert first.shape == want.shape
    assert (first - want).abs().max() <= 1e-4
    for r in range(1, tp):
        assert torch.equal(torch.from_numpy(ranks[tp][r][shape][1]), first), f"rank {r} logits differ from rank 0"


@pytest.mark.parametrize("shape, tp", CASES)
def test_sampled_tokens_are_the_same_on_every_rank(shape, tp, ranks):
    sampled = [ranks[tp][r][shape][2] for r in range(tp)]
    assert all(s == sampled[0] for s in sampled)


# -- the pass and the plan ----------------------------------------------------------------


@pytest.mark.parametrize("shape, tp", CASES)
def test_plan_shows_collectives_and_local_shapes(shape, tp, compile_artifact):
    art = compile_artifact(shape, dtype="fp32", tp=tp)
    p, cfg = plan(art), config(art)
    layers = p["model"]["layers"]
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    kv = cfg.get("num_key_value_heads", heads)
    vocab_split = cfg["vocab_size"] % tp == 0
    assert p["tp"] == tp
    assert p["passes"]["shard_tensor_parallel.row"] == len(p["programs"]) * 2 * layers  # attention + mlp
    assert p["passes"].get("shard_tensor_parallel.vocab_lm_head", 0) == len(p["programs"]) * vocab_split
    assert p["kv_cache"]["shape"][1] == (kv // tp if kv >= tp else 1)
    for name, prog in p["programs"].items():
        ops = [n["op"] for n in prog["nodes"] if n["kind"] == "call"]
        fused = ops.count("dsc.all_reduce_add_rmsnorm.default")
        embedding = ops.count("dsc.vocab_embedding_all_reduce_rmsnorm.default")
        # RMSNorm models: every layer's two all-reduces carry the residual add + norm after them,
        # and the vocab-parallel embedding's carries its lookup and layer 0's input norm
        assert fused == (2 * layers if "llama" in shape else 0), name
        assert embedding == (vocab_split if "llama" in shape else 0), name
        assert ops.count("dsc.all_reduce.default") + fused + embedding == 2 * layers + vocab_split, name
        assert ops.count("dsc.all_gather.default") == vocab_split, name
        kernels = {
            n["kernel"]["name"]: n["kernel"]["launches"]
            for n in prog["nodes"]
            if n.get("op") == "dsc.all_reduce.default"
        }
        # decode: the one-shot all-reduce (one launch); prefill: NCCL (clone + all-reduce)
        assert kernels == (
            {}
            if "dsc.all_reduce.default" not in ops
            else {"symm_mem.one_shot_all_reduce": 1}
            if name == "decode"
            else {"nccl.all_reduce": 2}
        ), name
        kernels = {
            n["kernel"]["name"]: n["kernel"]["launches"]
            for n in prog["nodes"]
            if n.get("op") == "dsc.all_reduce_add_rmsnorm.default"
        }
        # decode: one fused kernel; prefill: NCCL (2) + the add_rmsnorm kernel
        assert kernels == (
            {}
            if not fused
            else {"triton.all_reduce_add_rmsnorm": 1}
            if name == "decode"
            else {"nccl.all_reduce + triton.add_rmsnorm": 3}
        ), name
        kernels = {
            n["kernel"]["name"]: n["kernel"]["launches"]
            for n in prog["nodes"]
            if n.get("op") == "dsc.vocab_embedding_all_reduce_rmsnorm.default"
        }
        # decode: one push kernel; prefill: the lookup, NCCL (2) and the rmsnorm kernel
        assert kernels == (
            {}
            if not embedding
            else {"triton.vocab_embedding_all_reduce_rmsnorm": 1}
            if name == "decode"
            else {"triton.vocab_embedding + nccl.all_reduce + triton.rmsnorm": 4}
        ), name
        attn = [n for n in prog["nodes"] if n.get("op") in ATTENTION_OPS]
        assert len(attn) == layers and all(n["shape"][2] == heads // tp for n in attn)
        by_name = {n["name"]: n for n in prog["nodes"]}
        logits = by_name[prog["nodes"][-1]["args"]["node"]]
        rows = "seqs" if name == "ragged" else "batch"  # the ragged program: one row per sequence
        assert logits["shape"] == [rows, cfg["vocab_size"]]  # full logits on every rank
    note = p["notes"]["tp"]
    assert note["vocab"].startswith("vocab-parallel" if vocab_split else "replicated")
    assert "replicated_linears" not in note


def _fp16_logits(rank: int, jobs: dict) -> dict:
    art, ref_tokens = jobs["art"]
    return teacher_forced(dsc.load(art, device="cpu"), ref_tokens).float().numpy()


def test_16bit_decode_fuses_the_row_parallel_linear_into_the_all_reduce(compile_artifact):
    """16-bit Llama at tp=2: the decode program's o_proj / down_proj GEMV and the all-reduce +
    add + RMSNorm after it become one dsc.linear_all_reduce_add_rmsnorm (on GPUs the GEMV then
    pushes its rows to the peers), prefill keeps the unfused pair, and the ranks (gloo, where
    the op is the GEMV's F.linear and the two ops) give tp=1's logits."""
    tp1 = compile_artifact("llama-tiny", dtype="fp16")
    art = compile_artifact("llama-tiny", dtype="fp16", tp=2)
    p = plan(art)
    layers = p["model"]["layers"]
    assert p["passes"]["decode_linears.all_reduce"] == 2 * layers
    decode = [n for n in p["programs"]["decode"]["nodes"] if n["kind"] == "call"]
    ops = [n["op"] for n in decode]
    assert ops.count("dsc.linear_all_reduce_add_rmsnorm.default") == 2 * layers
    assert "dsc.all_reduce_add_rmsnorm.default" not in ops
    fused = [n["kernel"] for n in decode if n["op"] == "dsc.linear_all_reduce_add_rmsnorm.default"]
    # the tiny shapes have no tuned GEMV row: the plan names the unfused kernels, 2 launches
    assert all(k["launches"] == 2 and "all_reduce_add_rmsnorm" in k["name"] for k in fused), fused
    prefill = [n["op"] for n in p["programs"]["prefill"]["nodes"] if n["kind"] == "call"]
    assert prefill.count("dsc.all_reduce_add_rmsnorm.default") == 2 * layers
    assert "dsc.linear_all_reduce_add_rmsnorm.default" not in prefill

    e = dsc.load(tp1, device="cpu")
    tokens = e.generate(PROMPTS, max_new_tokens=NEW, stop_tokens=[]).tokens
    want = teacher_forced(e, tokens).float()
    got = spawn_ranks(2, _fp16_logits, {"art": (str(art), tokens)})
    for r in got.values():
        got_r = torch.as_tensor(r)
        assert torch.equal(got_r, torch.as_tensor(got[0]))  # every rank: the same logits
        err = (got_r - want).abs().max() / want.abs().max()
        assert err < 1e-2, float(err)  # fp16: partial sums rounded per rank before the sum


def _gather_shapes(rank, jobs):
    from dsc.kernels.collectives import all_gather

    out = {}
    for shape, dim in jobs:
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1000 * rank
        g = all_gather(x, dim, 2)
        out[(shape, dim)] = (g, g._base is not None)  # a view of the gathered buffer
    return out


def test_all_gather_concatenates_in_rank_order_with_or_without_a_copy():
    """dsc.all_gather over 2 gloo ranks equals torch.cat of the ranks' tensors along dim; where
    nothing precedes dim but ones (batch-1 logits) it is a view of the gathered buffer, no cat."""
    jobs = [((1, 5), 1), ((1, 5), -1), ((1, 1, 4), 2), ((3, 5), 1), ((2, 3), 0), ((2, 1, 4), 2)]
    got = spawn_ranks(2, _gather_shapes, jobs)
    for shape, dim in jobs:
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        want = torch.cat([x, x + 1000], dim)
        for r in (0, 1):
            g, view = got[r][(shape, dim)]
            assert torch.equal(g, want), (shape, dim)
            assert view == (math.prod(shape[: dim % len(shape)]) == 1), (shape, dim)


def test_pass_is_a_noop_for_tp1(compile_artifact):
    p = plan(compile_artifact("llama-tiny", dtype="fp32"))
    assert not any(k.startswith("shard_tensor_parallel") for k in p["passes"])
    ops = {n["op"] for prog in p["programs"].values() for n in prog["nodes"] if n["kind"] == "call"}
    assert not ops & {"dsc.all_reduce.default", "dsc.all_gather.default"}


def test_gpt2_fused_qkv_split_is_sharded_per_block(compile_artifact):
    """c_attn's output [.., 3E] is split into q, k, v: each rank's split sizes are E/tp."""
    p = plan(compile_artifact("gpt2-tiny", dtype="fp32", tp=2, fuse=False))
    splits = [n for n in p["programs"]["prefill"]["nodes"] if n.get("op") == "aten.split.Tensor"]
    assert splits and all(n["args"][1] == 32 for n in splits)


# -- rank files ---------------------------------------------------------------------------


def rank_tensors(art: Path, rank: int) -> dict[str, torch.Tensor]:
    with safe_open(Path(art) / f"rank{rank}.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("shape, tp", CASES)
def test_rank_files_hold_one_nth_of_the_linears(shape, tp, compile_artifact):
    """rank bytes <= sharded bytes / tp + replicated bytes (kv heads, when fewer than tp, count
    as replicated over tp / n_kv ranks)."""
    full = rank_tensors(compile_artifact(shape, dtype="fp32"), 0)
    art = compile_artifact(shape, dtype="fp32", tp=tp)
    cfg = config(art)
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    kv = cfg.get("num_key_value_heads", heads)
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    kv_bytes = 2 * p_layers(art) * kv * (hidden // heads) * hidden * 4  # k and v projections
    kv_extra = kv_bytes * (1 / min(tp, kv) - 1 / tp)
    sizes = []
    for r in range(tp):
        local = rank_tensors(art, r)
        names = set(local) - {n for n in local if n.endswith(".vocab_start")}
        assert names == set(full), f"rank {r} holds other tensors than tp=1"
        split = {n: full[n] for n in names if local[n].shape != full[n].shape}
        replicated = {n: full[n] for n in names if local[n].shape == full[n].shape}
        assert all(
            t.dim() <= 1
            or "wpe" in n
            or "embed_positions" in n
            or n.endswith(".table")  # RoPE tables
            or (cfg["vocab_size"] % tp and t.shape[0] == cfg["vocab_size"])
            for n, t in replicated.items()
        ), sorted(n for n, t in replicated.items() if t.dim() > 1)
        bound = tensor_bytes(split) / tp + tensor_bytes(replicated) + kv_extra + 8  # + vocab_start
        assert tensor_bytes(local) <= bound + 1, (r, tensor_bytes(local), bound)
        sizes.append((Path(art) / f"rank{r}.safetensors").stat().st_size)
    assert max(sizes) - min(sizes) < 4096  # balanced


def p_layers(art: Path) -> int:
    return plan(art)["model"]["layers"]


def test_llama_rank_files_hold_exactly_their_slices(compile_artifact, make_checkpoint):
    """tp=4 with 2 kv heads: rank r holds q head r, kv head r // 2, o_proj columns of head r,
    a quarter of the MLP and vocabulary rows; norms whole."""
    tp, D, I, V = 4, 16, 176 // 4, 512 // 4
    art = compile_artifact("llama-tiny", dtype="fp32", tp=tp, fuse=False)
    with safe_open(make_checkpoint("llama-tiny") / "model.safetensors", framework="pt") as f:
        src = {k: f.get_tensor(k) for k in f.keys()}
    for r in range(tp):
        got = rank_tensors(art, r)
        for i in range(2):
            pre = f"model.layers.{i}."
            want = {
                "self_attn.q_proj.weight": src[pre + "self_attn.q_proj.weight"][r * D : (r + 1) * D],
                "self_attn.k_proj.weight": src[pre + "self_attn.k_proj.weight"][(r // 2) * D : (r // 2 + 1) * D],
                "self_attn.v_proj.weight": src[pre + "self_attn.v_proj.weight"][(r // 2) * D : (r // 2 + 1) * D],
                "self_attn.o_proj.weight": src[pre + "self_attn.o_proj.weight"][:, r * D : (r + 1) * D],
                "mlp.gate_proj.weight": src[pre + "mlp.gate_proj.weight"][r * I : (r + 1) * I],
                "mlp.up_proj.weight": src[pre + "mlp.up_proj.weight"][r * I : (r + 1) * I],
                "mlp.down_proj.weight": src[pre + "mlp.down_proj.weight"][:, r * I : (r + 1) * I],
                "input_layernorm.weight": src[pre + "input_layernorm.weight"],
            }
            for k, w in want.items():
                assert torch.equal(got[pre + k], w), (r, k)
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(got[k], src[k][r * V : (r + 1) * V]), (r, k)
        assert got["model.embed_tokens.vocab_start"].tolist() == [r * V]
        assert torch.equal(got["model.norm.weight"], src["model.norm.weight"])


def test_gpt2_rank_files_hold_exactly_their_slices(compile_artifact, make_checkpoint):
    """tp=2: c_attn rows are [q_r; k_r; v_r] (blocks E, E, E) with its bias; c_proj columns with
    the bias whole (added once, after the all-reduce). Conv1D weights are stored [in, out]."""
    tp, E, F, V = 2, 64, 256, 512
    e, f, v = E // tp, F // tp, V // tp
    art = compile_artifact("gpt2-tiny", dtype="fp32", tp=tp, fuse=False)
    with safe_open(make_checkpoint("gpt2-tiny") / "model.safetensors", framework="pt") as fh:
        src = {k: fh.get_tensor(k) for k in fh.keys()}
    for r in range(tp):
        got = rank_tensors(art, r)
        rows = torch.cat([torch.arange(b * E + r * e, b * E + (r + 1) * e) for b in range(3)])
        for i in range(2):
            pre = f"transformer.h.{i}."
            want = {
                "attn.c_attn.weight": src[pre + "attn.c_attn.weight"].t()[rows],  # [3E, E] -> [3E/tp, E]
                "attn.c_attn.bias": src[pre + "attn.c_attn.bias"][rows],
                "attn.c_proj.weight": src[pre + "attn.c_proj.weight"].t()[:, r * e : (r + 1) * e],
                "attn.c_proj.bias": src[pre + "attn.c_proj.bias"],
                "mlp.c_fc.weight": src[pre + "mlp.c_fc.weight"].t()[r * f : (r + 1) * f],
                "mlp.c_fc.bias": src[pre + "mlp.c_fc.bias"][r * f : (r + 1) * f],
                "mlp.c_proj.weight": src[pre + "mlp.c_proj.weight"].t()[:, r * f : (r + 1) * f],
                "mlp.c_proj.bias": src[pre + "mlp.c_proj.bias"],
                "ln_1.weight": src[pre + "ln_1.weight"],
            }
            for k, w in want.items():
                assert torch.equal(got[pre + k], w), (r, k)
        wte = src["transformer.wte.weight"]
        assert torch.equal(got["transformer.wte.weight"], wte[r * v : (r + 1) * v])  # tied with lm_head
        assert torch.equal(got["transformer.wpe.weight"], src["transformer.wpe.weight"])


# -- validation at compile ----------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, tp, message, works",
    [
        ({}, 3, "does not divide num_attention_heads=4", "1, 2, 4"),
        ({"intermediate_size": 170}, 4, "does not divide intermediate_size=170", "1, 2"),
        (
            {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 6, "intermediate_size": 192},
            4,
            "does not divide num_key_value_heads=6",
            "1, 2, 3, 6, 12",
        ),
        (
            {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 192},
            6,
            "larger than num_key_value_heads=4 but not a multiple of it",
            "1, 2, 4, 12",
        ),
    ],
)
def test_tp_that_does_not_divide_the_model_is_a_user_error(
    overrides, tp, message, works, make_checkpoint, tmp_path, monkeypatch
):
    import dsc.compiler.trace as trace

    monkeypatch.setattr(trace, "trace", lambda *a: pytest.fail("validation must run before tracing"))
    ckpt = make_checkpoint("llama-tiny", tokenizer=False, **overrides)
    with pytest.raises(UserError) as e:
        dsc.compile(str(ckpt), tmp_path / "art", tp=tp)
    assert message in str(e.value) and str(e.value).endswith(f"tp values that work: {works}")
    assert str(ckpt / "config.json") in str(e.value)
    assert not (tmp_path / "art").exists()


def test_cli_tp_error_is_one_line(make_checkpoint, tmp_path):
    from typer.testing import CliRunner

    from dsc.cli import app

    r = CliRunner().invoke(app, ["compile", str(make_checkpoint("gpt2-tiny")), "-o", str(tmp_path / "a"), "--tp", "8"])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [
        f"error: --tp 8 does not divide num_attention_heads=4 in {make_checkpoint('gpt2-tiny') / 'config.json'}; "
        "tp values that work: 1, 2, 4"
    ]


def test_architecture_without_tp_support_says_so(make_checkpoint, tmp_path, monkeypatch):
    """An architecture marked `no_tp` (the sharding pass cannot follow it yet; every supported
    one shards today) stops before tracing, in one line."""
    import dataclasses

    from typer.testing import CliRunner

    from dsc.cli import app
    from dsc.compiler.architectures import ARCHITECTURES

    monkeypatch.setitem(ARCHITECTURES, "llama", dataclasses.replace(ARCHITECTURES["llama"], no_tp="a layout"))
    ck = make_checkpoint("llama-tiny")
    r = CliRunner().invoke(app, ["compile", str(ck), "-o", str(tmp_path / "a"), "--tp", "2"])
    assert r.exit_code == 2 and not (tmp_path / "a").exists()
    (line,) = r.stderr.strip().splitlines()
    assert (
        line == f"error: --tp 2: model_type 'llama' ({ck / 'config.json'}) compiles with --tp 1 only for now (a layout)"
    )


def test_vocabulary_tp_does_not_divide_is_replicated_not_an_error(compile_artifact):
    """llama-odd's 509-token vocabulary does not split over 2 ranks: embedding and lm_head stay
    whole on every rank (the plan says so), and the rest is sharded."""
    art = compile_artifact("llama-odd", dtype="fp32", tp=2)
    note = plan(art)["notes"]["tp"]["vocab"]
    assert note.startswith("replicated") and "509" in note
    assert rank_tensors(art, 1)["lm_head.weight"].shape == (509, 72)


# -- runtime errors -----------------------------------------------------------------------


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if any rank file gets loaded."""
    from dsc.runtime import engine

    monkeypatch.setattr(engine.Engine, "_load_weights", lambda self: pytest.fail("weights loaded before the error"))


def test_world_size_mismatch_is_an_error_before_loading(compile_artifact, monkeypatch, no_engine):
    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UserError, match=r"compiled for tp=2, but WORLD_SIZE=3 \(run with --nproc-per-node 2\)"):
        dsc.load(art)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UserError, match=r"compiled for tp=1, but WORLD_SIZE=2"):
        dsc.load(compile_artifact("llama-tiny", dtype="fp32"))


def test_process_group_size_mismatch_is_an_error_before_loading(compile_artifact, tmp_path, no_engine):
    import torch.distributed as dist

    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(UserError, match="compiled for tp=2, but the process group has 1 ranks"):
            dsc.load(art)
    finally:
        dist.destroy_process_group()


def test_tp_artifact_without_a_process_group_is_an_error(compile_artifact, monkeypatch, no_engine):
    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(UserError, match="run under torchrun --nproc-per-node 2"):
        dsc.load(art)
    with pytest.raises(UserError, match="needs a process group"):
        dsc.load(art, rank=1)


def test_missing_rank_file_is_an_error_before_loading(compile_artifact, tmp_path, monkeypatch, no_engine):
    from typer.testing import CliRunner

    from dsc.cli import app

    art = tmp_path / "art"
    shutil.copytree(compile_artifact("llama-tiny", dtype="fp32", tp=2), art)
    (art / "rank1.safetensors").unlink()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # rank 0's own file is there; rank 1's absence still stops it
    with pytest.raises(UserError, match=r"rank1.safetensors: missing rank file \(artifact compiled for tp=2\)"):
        dsc.load(art)
    monkeypatch.delenv("WORLD_SIZE")
    r = CliRunner().invoke(app, ["generate", str(art), "--token-ids", "1,2,3"])  # fails before relaunching
    assert r.exit_code == 2 and "missing rank file" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_torchrun_with_the_wrong_nproc_is_a_clear_error(compile_artifact):
    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "-m",
            "dsc",
            "generate",
            str(art),
            "--token-ids",
            "1,2,3",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
    )
    assert r.returncode != 0
    assert f"error: {art}: compiled for tp=2, but WORLD_SIZE=1 (run with --nproc-per-node 2)" in r.stderr


# -- dsc generate starts the ranks itself -------------------------------------------------


def test_dsc_generate_relaunches_under_torchrun(compile_artifact, reference):
    art = compile_artifact("gpt2-tiny", dtype="fp32", tp=2)
    ids = [",".join(map(str, p)) for p in PROMPTS]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsc",
            "generate",
            str(art),
            *sum((["--token-ids", i] for i in ids), []),
            "--max-new-tokens",
            str(NEW),
            "--device",
            "cpu",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, **ENV},
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(PROMPTS)  # printed by rank 0 only
    eos = set(plan(art)["model"]["eos_token_ids"])
    for line, want in zip(lines, reference["gpt2-tiny"][0]):
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert line["tokens"] == want[:cut]


def test_verify_with_tp_is_rejected_before_anything_is_written(make_checkpoint, tmp_path):
    import dsc

    with pytest.raises(UserError, match="needs --tp 1"):
        dsc.compile(str(make_checkpoint("llama-tiny")), tmp_path / "a", tp=2, verify=True)
    assert not (tmp_path / "a").exists()


# -- process-group lifetime -------------------------------------------------------------------


def _port_is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_rank_zero_owns_its_rendezvous_store_and_stops_it(monkeypatch):
    """Outside torchrun, rank 0 hosts the store at MASTER_PORT. runtime/distributed.py creates it
    (not torch's env:// rendezvous, whose multi-tenant daemon lives until static destruction
    and could abort a finished rank) and shutdown_process_group stops it: the port is free again."""
    import socket

    import torch.distributed as dist

    from dsc.runtime import distributed as D

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    D.ensure_process_group(torch.device("cpu"), 1, 0)
    try:
        assert dist.is_initialized() and D._store is not None and not _port_is_free(port)
        dist.all_reduce(torch.ones(2))  # the group works
    finally:
        D.shutdown_process_group()
    assert not dist.is_initialized() and D._store is None
    assert _port_is_free(port)
    # under torchrun the agent owns the store: the runtime must not create one on its port
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert D._rendezvous_store(2, 0) is None


_THREADS_AFTER_SHUTDOWN = """
import os, sys, dsc
from dsc.runtime.distributed import shutdown_process_group
e = dsc.load(sys.argv[1], device="cpu")
e.prefill([[5, 6, 7]])
shutdown_process_group()
with open(f"{sys.argv[2]}/rank{os.environ['RANK']}.txt", "w") as f:  # not stdout: ranks' lines interleave
    f.write(str(len(os.listdir("/proc/self/task"))))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_no_gloo_thread_outlives_the_group(compile_artifact, tmp_path):
    """A rank's gloo threads end with its group. (torch 2.13 leaks the group when torch._dynamo
    is first imported after the group exists, as a custom op's first call does; the leaked
    threads then abort the finished rank at exit. runtime/distributed.py imports it first.)"""
    art = compile_artifact("gpt2-tiny", dtype="fp32", tp=2)
    script = tmp_path / "threads.py"
    script.write_text(_THREADS_AFTER_SHUTDOWN)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
            str(art),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(tmp_path / f"rank{i}.txt").read_text() for i in range(2)] == ["1", "1"]  # threads left per rank


# -- the one-shot all-reduce's buffer order (kernels/collectives.py) -------------------------
def _slots(monkeypatch, counts):
    """The buffer each dsc.all_reduce of a run of programs would use (None: NCCL)."""
    from dsc.kernels import collectives

    s = object.__new__(collectives._Symmetric)
    s.count = s.index = 0
    monkeypatch.setattr(collectives, "_symm", s)
    seq = []
    for n in counts:
        with collectives.program_scope(n):
            seq += [s.slot() if s.count else None for _ in range(n)]
        assert s.count == 0  # closed scope: calls outside a program take NCCL
    return seq


def test_one_shot_all_reduce_never_reuses_a_buffer_back_to_back(monkeypatch):
    # Llama-8B decode (65) and prefill, GPT-2 style odd counts, a program of one (NCCL), and a
    # CUDA graph replayed twice (the same program again)
    counts = [65, 65, 64, 64, 3, 2, 5, 1, 7, 7, 2]
    seq = _slots(monkeypatch, counts)
    assert seq.count(None) == 1  # only the one-all-reduce program takes NCCL
    for a, b in zip(seq, seq[1:]):
        assert a is None or b is None or a != b, seq
    assert seq[:4] == [0, 1, 0, 1] and seq[64] == 2  # odd count: the last one on buffer 2


def test_the_logits_all_gather_takes_a_buffer_slot(compile_artifact, monkeypatch):
    """The engine's program scope counts the all-gather with the all-reduces (the push all-gather
    goes through the same buffers): Llama's tp=2 decode program has 2 per layer, the embedding's
    and the logits' gather."""
    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)
    plan = json.loads((art / "plan.json").read_text())
    from dsc.runtime.engine import SLOT_OPS

    ops = [n.get("op") for n in plan["programs"]["decode"]["nodes"]]
    layers = plan["model"]["layers"]
    assert sum(op in SLOT_OPS for op in ops) == 2 * layers + 2 and ops.count("dsc.all_gather.default") == 1
    gather = next(n for n in plan["programs"]["decode"]["nodes"] if n.get("op") == "dsc.all_gather.default")
    assert gather["kernel"]["name"] == "triton.push_all_gather" and gather["kernel"]["launches"] == 1


@pytest.mark.parametrize("mode", ["auto", "nccl"])
def test_without_a_group_or_a_gpu_collectives_take_nccl_or_gloo(mode, monkeypatch):
    """No process group or no GPU: NCCL/gloo under either DSC_ALLREDUCE, nothing allocated."""
    from dsc import switches
    from dsc.kernels import collectives

    with switches.override(ALLREDUCE=mode):
        assert collectives.enable_symmetric(torch.device("cpu"), torch.float32, 64) == "nccl"
        assert collectives._symm is None


@pytest.mark.parametrize("kernel", ["gemv", "gather"])
def test_dsc_allreduce_nccl_keeps_every_collective_off_the_push_buffers(kernel, monkeypatch):
    """With push buffers set up (as by an earlier engine in the process), DSC_ALLREDUCE=nccl
    still sends the GEMV push and the logits' all-gather to their NCCL paths; auto takes the
    buffers (the call's checks otherwise pass)."""
    from dsc import switches
    from dsc.kernels import collectives

    s = object.__new__(collectives._Symmetric)
    s.fused, s.count, s.index, s.numel, s.dtype = True, 2, 0, 1 << 20, torch.float32
    monkeypatch.setattr(collectives, "_symm", s)
    x, w = torch.zeros(1, 64), torch.zeros(32, 64)

    def takes_buffers():
        if kernel == "gemv":
            return collectives._gemv_push_usable(s, torch.zeros(1, 32), x, w, torch.zeros(32), "")
        monkeypatch.setattr(collectives, "_launch_push_gather", lambda s, slot, x: "pushed")
        s.index = 0
        return (
            collectives._push_gather(
                types.SimpleNamespace(is_cuda=True, dtype=torch.float32, numel=lambda: 64, dim=lambda: 2), -1
            )
            == "pushed"
        )

    for mode, want in (("auto", True), ("nccl", False)):
        with switches.override(ALLREDUCE=mode):
            assert takes_buffers() is want, mode


def test_shutdown_destroys_cuda_graphs_before_the_group(monkeypatch, tmp_path):
    """A CUDA graph that captured NCCL calls makes destroy_process_group hang (seen on 4 H200s:
    tp `dsc generate` printed its tokens and never exited). shutdown_process_group must release
    the graphs and the one-shot buffers first."""
    import torch.distributed as dist

    import dsc.runtime.decode as decode
    import dsc.runtime.distributed as D
    from dsc.kernels import collectives

    calls = []
    monkeypatch.setattr(decode, "release_cuda_graphs", lambda: calls.append("release graphs"))
    monkeypatch.setattr(collectives, "disable_symmetric", lambda: calls.append("drop buffers"))
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: (calls.append("destroy"), destroy(*a)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    D.shutdown_process_group()
    assert calls == ["release graphs", "drop buffers", "destroy"]
    assert not dist.is_initialized()


def test_released_runner_steps_run_eagerly():
    """After release_cuda_graphs a runner has no graph left and still steps (eagerly)."""
    from dsc.runtime.decode import DecodeRunner

    prog = lambda ids, pos, cache_pos, last: ids.float() + pos.float()  # noqa: E731
    r = DecodeRunner(prog, (1, 2), torch.device("cpu"), cuda_graphs=False)
    r.captured = True  # as after a capture on CUDA (graphs None on CPU)
    r.release()
    assert not r.captured and all(s.graph is None for s in r.steps.values())
    out = r(torch.tensor([3]), torch.tensor([4]))
    assert out.tolist() == [[7.0]]
