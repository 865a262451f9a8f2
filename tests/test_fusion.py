"""Fusion passes (passes/fuse_*.py) and the kernel plan (passes/plan_kernels.py).

Each fusion test checks three things: the pass fired (its counter > 0), the compiled model
still matches transformers (greedy tokens equal; fp32 teacher-forced logits within 1e-4),
and the fused dsc op is in the plan. Also: composition with --tp 2 (ranks run as gloo
processes) and --int8 (judged by SQNR), the per-projection sharding of fused weights, the
launch budget of a 16-bit Llama decode step, and golden plans.

Golden plans: tests/golden/<shape>.plan.txt is the readable form of plan.json's programs
(node, op, shape, kernel x launches, config). After an intended plan change, regenerate with
    DSC_UPDATE_GOLDEN=1 pytest tests/test_fusion.py -k golden
and review the diff like code.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import dsc
from dsc import switches
from dsc.compiler.verify import reference_model, sample_prompts, verify_artifact

FP32_ATOL = 1e-4
BF16_REL_TOL = 0.03  # of the largest logit, as in test_compile.py
GOLDEN = Path(__file__).parent / "golden"
# the suite's own switch, declared as the runtime's are (switches.py) but not among them
UPDATE_GOLDEN = switches.Switch(
    "DSC_UPDATE_GOLDEN",
    "0",
    "The golden plans: compare with tests/golden, or rewrite them.",
    choices={"0": "compare", "1": "rewrite tests/golden/*.txt"},
)

# what each family's graph offers the fusions: the rewrites that must fire, the ops they leave.
# GPT-2 has no projections to fuse (c_attn is already one q|k|v matmul) and no rotary
# (learned positions): those counters stay 0 there.
FIRES = {
    "llama": {
        "fuse_projections.linear",
        "fuse_add_norm.add_rmsnorm",
        "fuse_add_norm.rmsnorm",
        "fuse_rotary.rotary_qk",
        "fuse_activation.swiglu",
        "fuse_rotary_attention.decode",
    },
    "gpt2": {"fuse_add_norm.add_layernorm", "fuse_activation.gelu_tanh", "fuse_add_norm.bias", "fuse_activation.bias"},
}
OPS = {
    "llama": {"dsc.add_rmsnorm.default", "dsc.rmsnorm.default", "dsc.swiglu.default"},
    "gpt2": {"dsc.add_layernorm.default", "dsc.gelu.default"},
}
# Llama's rotary embedding: its own kernel in prefill; in decode the attention kernel applies it
ROTARY_OPS = {"prefill": "dsc.rotary.default", "decode": "dsc.rotary_attention.default"}
UNFUSED = {
    "aten.rsqrt.default",
    "aten.silu.default",
    "aten.tanh.default",
    "aten.neg.default",
    "aten.layer_norm.default",
    "aten.gelu.default",
}


def plan_of(art: Path) -> dict:
    return json.loads((art / "plan.json").read_text())


def call_ops(plan: dict, program: str) -> list[str]:
    return [n["op"] for n in plan["programs"][program]["nodes"] if n["kind"] == "call"]


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    noise = float(((x.float() - ref.float()) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((ref.float() ** 2).sum()) / noise)


@torch.no_grad()
def hf_last_logits(ckpt: Path, prompts: list[list[int]], dtype=torch.float32) -> torch.Tensor:
    model = reference_model(ckpt, dtype)
    return torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in prompts])


def family(shape: str) -> str:
    return shape.split("-")[0]


# -- every fusion fires, the model still matches transformers ---------------------------------------
@pytest.mark.parametrize(
    "shape,ckpt_kwargs",
    [
        ("llama-tiny", {}),
        ("gpt2-tiny", {}),
        ("llama-odd", {}),
        ("gpt2-odd", {"activation_function": "gelu"}),  # exact GELU: aten.gelu -> dsc.gelu
    ],
    ids=["llama-tiny", "gpt2-tiny", "llama-odd", "gpt2-odd-gelu"],
)
def test_fusions_fire_and_match_transformers(shape, ckpt_kwargs, compile_artifact, make_checkpoint):
    art = compile_artifact(shape, ckpt_kwargs=ckpt_kwargs or None, dtype="fp32")
    plan = plan_of(art)
    fires = set(FIRES[family(shape)])
    if ckpt_kwargs.get("activation_function") == "gelu":
        fires = fires - {"fuse_activation.gelu_tanh"} | {"fuse_activation.gelu"}
    for rule in fires:
        assert plan["passes"].get(rule, 0) > 0, f"{rule} did not fire: {plan['passes']}"
    for program in ("prefill", "decode"):
        ops = set(call_ops(plan, program))
        want = OPS[family(shape)] | ({ROTARY_OPS[program]} if family(shape) == "llama" else set())
        assert want <= ops, want - ops
        assert not ops & UNFUSED, ops & UNFUSED
        assert all("kernel" in n for n in plan["programs"][program]["nodes"] if n["kind"] == "call")
    report = verify_artifact(art, make_checkpoint(shape, **ckpt_kwargs), new_tokens=8)
    assert report.tokens_equal, report.summary()
    assert report.max_abs_err <= FP32_ATOL, report.summary()


def test_qwen2_biases_fuse_with_their_projections(compile_artifact, make_checkpoint):
    """Qwen2: q/k/v carry biases (fused into one bias); the same patterns as Llama fire."""
    art = compile_artifact("qwen2-tiny", dtype="fp32")
    plan = plan_of(art)
    assert all(plan["passes"].get(rule, 0) > 0 for rule in FIRES["llama"]), plan["passes"]
    weights = {n["target"]: n["shape"] for n in plan["programs"]["decode"]["nodes"] if n["kind"] == "weight"}
    assert weights["model.layers.0.self_attn.qkv_proj.bias"] == [128]
    report = verify_artifact(art, make_checkpoint("qwen2-tiny"), new_tokens=6)
    assert report.tokens_equal and report.max_abs_err <= FP32_ATOL, report.summary()


def test_phi3_up_first_swiglu_fuses(compile_artifact, make_checkpoint):
    """Phi-3 writes its MLP as up * silu(gate) on the chunks of a checkpoint-fused gate_up."""
    art = compile_artifact("phi3-tiny", dtype="fp32")
    passes = plan_of(art)["passes"]
    assert passes.get("fuse_activation.swiglu", 0) == 6 and passes.get("fuse_add_norm.add_rmsnorm", 0) > 0, passes
    report = verify_artifact(art, make_checkpoint("phi3-tiny"), new_tokens=6)
    assert report.tokens_equal and report.max_abs_err <= FP32_ATOL, report.summary()


@pytest.mark.parametrize("shape", ["opt-tiny", "opt-proj"])
def test_opt_add_layernorm_fuses_through_its_flatten(shape, compile_artifact, make_checkpoint):
    """OPT reshapes the residual sum to [rows, N] before the LayerNorm: the pair still fuses,
    and the output projections' biases move into the fused kernel."""
    art = compile_artifact(shape, dtype="fp32")
    plan = plan_of(art)
    layers = plan["model"]["layers"]
    assert plan["passes"].get("fuse_add_norm.add_layernorm", 0) >= 2 * (2 * layers - 1), plan["passes"]
    assert plan["passes"].get("fuse_add_norm.bias", 0) > 0
    assert not any(
        n.get("op") == "aten.layer_norm.default" and ".layers." in n["name"]
        for n in plan["programs"]["decode"]["nodes"]
    )  # no block LayerNorm left unfused
    report = verify_artifact(art, make_checkpoint(shape), new_tokens=6)
    assert report.tokens_equal and report.max_abs_err <= FP32_ATOL, report.summary()


def test_fused_projection_weights_are_concatenated(compile_artifact):
    art = compile_artifact("llama-tiny", dtype="fp32")
    plan = plan_of(art)
    names = {n.get("target") for n in plan["programs"]["decode"]["nodes"] if n["kind"] == "weight"}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith(("q_proj.weight", "up_proj.weight")) and "gate_up" not in n for n in names)


# -- the launch budget -------------------------------------------------------------------------------
@torch.no_grad()
def test_bf16_llama_decode_is_at_most_10_launches_per_layer(compile_artifact, make_checkpoint):
    from dsc.runtime.inspect import describe

    art = compile_artifact("llama-tiny", dtype="bf16")
    info = describe(art)
    decode = info["programs"]["decode"]
    assert decode["layers"] == 2
    assert decode["launches_per_layer"] <= 10, decode["layer_kernels"]
    assert plan_of(art)["passes"]["fuse_add_norm.add_rmsnorm"] > 0  # the 16-bit (casts) pattern
    # numerics in bf16: the fused ops keep transformers' rounding points
    ckpt = make_checkpoint("llama-tiny")
    ps = sample_prompts(512)
    want = hf_last_logits(ckpt, ps, torch.bfloat16)
    got = dsc.load(art, device="cpu").prefill(ps)
    assert float((got - want).abs().max()) <= BF16_REL_TOL * float(want.abs().max())


@torch.no_grad()
def assert_same_decode_logits(engines, prompts, steps: int = 6) -> None:
    """Every engine gives bit-identical logits at each greedy decode step after the prefill (fed
    the last engine's tokens): a fusion that must not change a bit on CPU."""
    lens = torch.tensor([len(p) for p in prompts])
    logits = [e.prefill(prompts) for e in engines]
    for step in range(steps):
        nxt = logits[-1].argmax(-1)
        logits = [e.decode(nxt, lens + step) for e in engines]
        assert all(torch.equal(x, logits[-1]) for x in logits), f"decode step {step}"


def test_bf16_llama_decode_fuses_gate_up_with_swiglu(tmp_path, make_checkpoint, monkeypatch):
    """decode_linears' swiglu rule (dsc.linear_swiglu), compiled with and without it: where the
    gate_up shape has a tuned GEMV (here a tuning row for llama-tiny's [352, 64]; the shipped
    table has rows for real models only) the decode plan, as `dsc inspect` reads it, has one
    launch fewer per layer; on CPU the tokens and every step's logits are bit-identical."""
    from dsc.kernels import linear
    from dsc.passes import decode_linears
    from dsc.runtime.inspect import describe

    table = json.loads(json.dumps(linear.tuning_table()))
    table["sm_90"]["gemv"]["N352_K64"] = {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 1, "us": 1.0, "cublas_us": 2.0}
    monkeypatch.setattr(linear, "tuning_table", lambda: table)
    ckpt = make_checkpoint("llama-tiny")
    fused = dsc.compile(str(ckpt), tmp_path / "fused", dtype="bf16")
    monkeypatch.setattr(decode_linears, "_gate_up_of", lambda node: None)  # the rule off: the pair
    pair = dsc.compile(str(ckpt), tmp_path / "pair", dtype="bf16")
    assert (
        plan_of(fused)["passes"]["decode_linears.swiglu"] == 2
        and "decode_linears.swiglu" not in plan_of(pair)["passes"]
    )
    a, b = describe(fused)["programs"]["decode"], describe(pair)["programs"]["decode"]
    assert a["launches_per_layer"] == b["launches_per_layer"] - 1, (a["layer_kernels"], b["layer_kernels"])
    assert (
        "triton.gemv_swiglu" in a["layer_kernels"]["kernels"] and "triton.swiglu" not in a["layer_kernels"]["kernels"]
    )
    assert {"triton.gemv", "triton.swiglu"} <= set(b["layer_kernels"]["kernels"])
    engines = [dsc.load(art, device="cpu") for art in (fused, pair)]
    ps = sample_prompts(512)
    assert (
        engines[0].generate(ps, max_new_tokens=6, stop_tokens=[]).tokens
        == engines[1].generate(ps, max_new_tokens=6, stop_tokens=[]).tokens
    )
    assert_same_decode_logits(engines, ps)


def test_no_fuse_turns_the_fusions_off(compile_artifact):
    fused, plain = (
        plan_of(compile_artifact("llama-tiny", dtype="bf16")),
        plan_of(compile_artifact("llama-tiny", dtype="bf16", fuse=False)),
    )
    assert not any(k.startswith("fuse_") for k in plain["passes"])
    # attention and the decode GEMV are kernel choices, not fusions: --no-fuse keeps them
    assert not any(
        op.startswith("dsc.") and op not in ("dsc.attention.default", "dsc.linear.default")
        for op in call_ops(plain, "decode")
    )
    lf, lp = fused["notes"]["kernels"]["launches"]["decode"], plain["notes"]["kernels"]["launches"]["decode"]
    assert lp["launches_per_layer"] > 2 * lf["launches_per_layer"], (lf, lp)


@pytest.mark.parametrize(
    "shape, options",
    [("llama-tiny", {}), ("gpt2-tiny", {}), ("llama-tiny", {"fuse": False}), ("llama-tiny", {"tp": 2})],
)
def test_decode_reads_its_one_token_as_a_view(shape, options, compile_artifact):
    """select_decode_token: the decode program takes h[:, 0] (a view) where the trace gathered
    h[arange(B), last_idx], so a step has no arange and no gather launch; prefill keeps both
    (its last_idx varies); with or without the fusions and under tp. Engine.run of the decode
    program rejects a last_idx other than 0, as the gather did, with one clear error."""
    art = compile_artifact(shape, dtype="fp32", **options)
    plan = plan_of(art)
    dec, pre = call_ops(plan, "decode"), call_ops(plan, "prefill")
    assert plan["passes"]["select_decode_token.select"] == 1
    assert "aten.select.int" in dec and "aten.arange.default" not in dec and "aten.arange.default" in pre
    # the rest: the position tables' lookups, unless every decode attention reads their rows itself
    folded = 2 if plan["passes"].get("fuse_rotary_attention.tables") else 0
    assert dec.count("aten.index.Tensor") == pre.count("aten.index.Tensor") - 1 - folded
    if options.get("tp", 1) == 1:
        e = dsc.load(art, device="cpu")
        args = torch.tensor([[3], [4]]), torch.tensor([[2], [5]]), torch.tensor([2, 5])
        assert torch.isfinite(e.run("decode", *args, torch.tensor([0, 0]))).all()
        with pytest.raises(ValueError, match=r"last_idx must be 0, got \[0, 1\]"):
            e.run("decode", *args, torch.tensor([0, 1]))


@pytest.mark.parametrize("shape, dtype", [("llama-tiny", "bf16"), ("llama-tiny", "fp32")])
def test_rotary_cos_sin_become_position_tables(compile_artifact, make_checkpoint, shape, dtype):
    """fold_position_tables: RoPE's cos/sin chain -> two gathers from [max_seq, head_dim] tables
    holding exactly what transformers' rotary embedding computes at every position."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    art = compile_artifact(shape, dtype=dtype, max_seq=96)
    plan = plan_of(art)
    assert plan["passes"]["fold_position_tables.table"] == 6  # cos and sin, in each of the three programs
    for program in ("prefill", "decode"):
        ops = call_ops(plan, program)
        assert "aten.cos.default" not in ops and "aten.sin.default" not in ops
    cfg = AutoConfig.from_pretrained(make_checkpoint(shape, dtype="float32"))
    rope = LlamaRotaryEmbedding(cfg)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x = torch.zeros(1, 96, cfg.hidden_size, dtype=torch_dtype)
    cos, sin = rope(x, torch.arange(96)[None])
    with safe_open(str(art / "rank0.safetensors"), "pt") as f:
        tables = {k: f.get_tensor(k) for k in f.keys() if k.endswith(".table")}
    assert len(tables) == 2, list(tables)
    got = sorted(tables.values(), key=lambda t: float(t[1:].abs().sum()))  # which is cos: larger |values|
    want = sorted([cos[0], sin[0]], key=lambda t: float(t[1:].abs().sum()))
    for g, w in zip(got, want):
        assert g.dtype == torch_dtype and g.shape == (96, cfg.hidden_size // cfg.num_attention_heads)
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _rope_forward_5_17(self, x, position_ids):
    """transformers 5.17's LlamaRotaryEmbedding.forward (the GPU hosts' version; 5.24 multiplies
    instead): inv_freq expanded to the batch, then a matmul by the positions."""
    inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(dtype=torch.float, device=x.device)
    freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def test_rotary_tables_fold_when_rope_sizes_itself_by_the_batch(make_checkpoint, tmp_path, monkeypatch):
    """With 5.17's RoPE, export reads the batch size for the expand off another input (last_idx);
    the chain still depends on the positions alone and folds (unfolded, Llama-8B's decode step
    runs 7 small kernels for it), into tables equal to what that forward computes."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    import dsc

    monkeypatch.setattr(LlamaRotaryEmbedding, "forward", _rope_forward_5_17)
    ckpt = make_checkpoint("llama-tiny", dtype="bfloat16")
    art = dsc.compile(str(ckpt), tmp_path / "art", max_seq=96)
    plan = plan_of(art)
    assert plan["passes"]["fold_position_tables.table"] == 6, plan["passes"]
    for program in ("prefill", "decode"):
        ops = call_ops(plan, program)
        assert not {"aten.cos.default", "aten.sin.default", "aten.matmul.default"} & set(ops), program
    cfg = AutoConfig.from_pretrained(ckpt)
    cos, sin = LlamaRotaryEmbedding(cfg)(
        torch.zeros(1, 96, cfg.hidden_size, dtype=torch.bfloat16), torch.arange(96)[None]
    )
    with safe_open(str(art / "rank0.safetensors"), "pt") as f:
        tables = sorted(
            (f.get_tensor(k) for k in f.keys() if k.endswith(".table")), key=lambda t: float(t[1:].abs().sum())
        )
    for g, w in zip(tables, sorted([cos[0], sin[0]], key=lambda t: float(t[1:].abs().sum())), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_no_position_table_without_rope(compile_artifact):
    plan = plan_of(compile_artifact("gpt2-tiny", dtype="fp32"))  # learned position embeddings
    assert "fold_position_tables.table" not in plan["passes"]


@torch.no_grad()
def test_decode_rotary_fuses_into_attention(tmp_path, make_checkpoint, monkeypatch):
    """fuse_rotary_attention, compiled with and without it: each decode layer's dsc.rotary +
    dsc.attention becomes one dsc.rotary_attention, one launch fewer per layer as `dsc inspect`
    reads the plan; the position tables' two lookups go too, the op reading their rows (rot_pos);
    the prefill program is what the passes before it left; on CPU (where the op is the pair's
    references) tokens and every decode step's logits are bit-identical, with the tables or
    with the lookups' rows as its cos and sin."""
    from dsc.passes import fuse_rotary_attention
    from dsc.runtime.inspect import describe

    ckpt = make_checkpoint("llama-tiny")
    fused = dsc.compile(str(ckpt), tmp_path / "fused", dtype="fp32", dump_passes=tmp_path / "dump")
    monkeypatch.setattr(fuse_rotary_attention, "_table_lookup", lambda node: None)  # cos / sin stay lookups
    rows = dsc.compile(str(ckpt), tmp_path / "rows", dtype="fp32")
    monkeypatch.setattr(fuse_rotary_attention, "_attention_reading", lambda node: None)  # the pass matches nothing
    pair = dsc.compile(str(ckpt), tmp_path / "pair", dtype="fp32")
    assert plan_of(fused)["passes"]["fuse_rotary_attention.decode"] == 2
    assert plan_of(fused)["passes"]["fuse_rotary_attention.tables"] == 2
    assert plan_of(rows)["passes"]["fuse_rotary_attention.decode"] == 2
    assert "fuse_rotary_attention.tables" not in plan_of(rows)["passes"]
    assert "fuse_rotary_attention.decode" not in plan_of(pair)["passes"]
    ops = call_ops(plan_of(fused), "decode")
    assert ops.count("dsc.rotary_attention.default") == 2
    assert "dsc.rotary.default" not in ops and "dsc.attention.default" not in ops
    assert "aten.index.Tensor" not in ops and call_ops(plan_of(rows), "decode").count("aten.index.Tensor") == 2
    launches = [describe(art)["programs"]["decode"]["launches"] for art in (fused, rows, pair)]
    assert launches[0] == launches[1] - 2 == launches[2] - 2 - 2, launches  # 2 layers, 2 lookups
    before, after = (
        json.loads(next((tmp_path / "dump").glob(f"*_{name}")).joinpath("plan.json").read_text())
        for name in ("fold_position_tables", "fuse_rotary_attention")
    )
    assert after["programs"]["prefill"] == before["programs"]["prefill"]
    a, b = describe(fused)["programs"]["decode"], describe(pair)["programs"]["decode"]
    assert a["launches_per_layer"] == b["launches_per_layer"] - 1, (a["layer_kernels"], b["layer_kernels"])
    assert "triton.rotary_attention_decode" in a["layer_kernels"]["kernels"]
    assert not {"triton.rotary", "triton.attention_decode"} & set(a["layer_kernels"]["kernels"])
    assert_same_decode_logits([dsc.load(art, device="cpu") for art in (fused, rows, pair)], sample_prompts(512))


# -- golden plans ------------------------------------------------------------------------------------
def plan_text(plan: dict) -> str:
    """plan.json's programs as text: one line per call node, then the launch summary."""
    lines = []
    for program in sorted(plan["programs"]):
        lines.append(f"program {program}")
        for n in plan["programs"][program]["nodes"]:
            if n["kind"] != "call":
                continue
            shape = f"{n['dtype']}{n['shape']}" if "dtype" in n else str(n.get("shape", ""))
            k = n["kernel"]
            cfg = json.dumps(k["config"], sort_keys=True, separators=(",", ":")) if k["config"] else ""
            lines.append(f"  {n['name']:<52} {n['op']:<28} {shape:<28} {k['name']} x{k['launches']} {cfg}".rstrip())
        s = plan["notes"]["kernels"]["launches"][program]
        lines.append(
            f"  launches: {s['launches']}; per layer {s['launches_per_layer']} x {s['layers']} layers "
            f"+ {s['launches_outside_layers']} outside"
        )
    lines.append(
        "rewrites: " + ", ".join(f"{k}={v}" for k, v in sorted(plan["passes"].items()) if k.startswith("fuse_"))
    )
    return "\n".join(lines) + "\n"


def check_golden(shape: str, plan: dict) -> None:
    """plan_text(plan) equals tests/golden/<shape>.plan.txt (DSC_UPDATE_GOLDEN=1 rewrites it)."""
    text = plan_text(plan)
    path = GOLDEN / f"{shape}.plan.txt"
    if UPDATE_GOLDEN.parse(os.environ.get(UPDATE_GOLDEN.name, UPDATE_GOLDEN.default)) == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run DSC_UPDATE_GOLDEN=1 pytest tests/ -k golden"
    assert text == path.read_text(), f"plan of {shape} differs from {path} (DSC_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-tiny"])
def test_golden_plan(shape, compile_artifact):
    check_golden(shape, plan_of(compile_artifact(shape, dtype="fp32")))


# -- fused weights under tensor parallelism ----------------------------------------------------------
def test_fused_spec_shards_per_projection(make_checkpoint):
    """q|k|v fused over 4 ranks with 2 kv heads (groups): rank r holds [q_r; k_g; v_g]."""
    from dsc.compiler.ir import Shard, WeightSpec
    from dsc.compiler.source import open_checkpoint
    from dsc.compiler.weights import SourceReader, float_tensor
    from dsc.passes.fuse_projections import fused_name, fused_spec

    ckpt = open_checkpoint(str(make_checkpoint("llama-tiny")))
    keys = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    specs = [
        WeightSpec((keys[0],), (64, 64), "float32", shard=Shard(0, (64,))),
        WeightSpec((keys[1],), (32, 64), "float32", shard=Shard(0, (32,), (2,))),
        WeightSpec((keys[2],), (32, 64), "float32", shard=Shard(0, (32,), (2,))),
    ]
    spec = fused_spec(specs, world=4)
    assert spec.shard == Shard(0, (64, 32, 32), (4, 2, 2)) and spec.shape == (128, 64)
    assert fused_name(keys) == "model.layers.1.self_attn.qkv_proj.weight"
    with SourceReader(ckpt) as reader, safe_open(ckpt.files[0], "pt") as f:
        q, k, v = (f.get_tensor(key) for key in keys)
        for r in range(4):
            want = torch.cat([q.chunk(4)[r], k.chunk(2)[r // 2], v.chunk(2)[r // 2]])
            assert torch.equal(float_tensor(spec, r, 4, reader), want)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RANK_MAIN = """
import json, sys, torch, dsc
from dsc.compiler.verify import verify_artifact
art, ckpt, out = sys.argv[1:4]
engine = dsc.load(art, device="cpu")
report = verify_artifact(art, ckpt, new_tokens=6, engine=engine)
engine.reset()
logits = engine.prefill(report.prompts)
if engine.rank == 0:
    torch.save({"tokens_equal": report.tokens_equal, "summary": report.summary(),
                "max_abs_err": report.max_abs_err, "prompts": report.prompts, "logits": logits}, out)
from dsc.runtime.distributed import shutdown_process_group
shutdown_process_group()
"""


def run_ranks(art: Path, ckpt: Path, tmp_path: Path) -> dict:
    """Run verify_artifact on every rank of a tp artifact (gloo processes); rank 0's results."""
    tp = plan_of(art)["tp"]
    out = tmp_path / "rank0.pt"
    base = {
        **os.environ,
        "WORLD_SIZE": str(tp),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_MAIN, str(art), str(ckpt), str(out)],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(tp)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(
        f"rank {r} exit {p.returncode}:\n{log[-3000:]}" for r, (p, log) in enumerate(zip(procs, logs))
    )
    return torch.load(out)


def _rank_tensor(art: Path, rank: int, name: str) -> torch.Tensor:
    with safe_open(art / f"rank{rank}.safetensors", "pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-tiny"])
def test_fusions_with_tp2(shape, compile_artifact, make_checkpoint, tmp_path):
    art = compile_artifact(shape, dtype="fp32", tp=2)
    plan = plan_of(art)
    llama = family(shape) == "llama"
    # under tp every residual add of a Llama follows an all-reduce: add_rmsnorm becomes
    # all_reduce_add_rmsnorm (one rewrite per layer and norm, in both programs), and layer 0's
    # input rmsnorm takes in the vocab-parallel embedding and its all-reduce
    tp_rules = {"fuse_add_norm.all_reduce", "fuse_add_norm.embedding_all_reduce"}
    for rule in FIRES[family(shape)] | (tp_rules if llama else set()):
        assert plan["passes"].get(rule, 0) > 0, f"{rule} did not fire under tp=2"
    if llama:
        assert plan["passes"]["fuse_add_norm.all_reduce"] == plan["passes"]["fuse_add_norm.add_rmsnorm"]
    ops = OPS[family(shape)] - {"dsc.add_rmsnorm.default", "dsc.rmsnorm.default"} | (
        {"dsc.all_reduce_add_rmsnorm.default", "dsc.vocab_embedding_all_reduce_rmsnorm.default", ROTARY_OPS["decode"]}
        if llama
        else set()
    )
    assert ops <= set(call_ops(plan, "decode"))
    ckpt = make_checkpoint(shape)
    if family(shape) == "llama":  # each rank's fused weight is its own q, k, v (gate, up) rows
        with safe_open(ckpt / "model.safetensors", "pt") as f:
            for fused, parts in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
                srcs = [f.get_tensor(f"model.layers.0.{fused.split('.')[0]}.{p}_proj.weight") for p in parts]
                for r in range(2):
                    want = torch.cat([s.chunk(2)[r] for s in srcs])
                    assert torch.equal(_rank_tensor(art, r, f"model.layers.0.{fused}.weight"), want), (fused, r)
    res = run_ranks(art, ckpt, tmp_path)
    assert res["tokens_equal"], res["summary"]
    assert res["max_abs_err"] <= FP32_ATOL, res["summary"]


def test_tp2_embedding_its_all_reduce_and_the_first_norm_fuse(compile_artifact):
    """Under tp the vocab-parallel lookup, its all-reduce and layer 0's input RMSNorm become one
    dsc.vocab_embedding_all_reduce_rmsnorm per program (on GPUs one push kernel in decode):
    output 0, the sum, is the residual of layer 0's post-attention add; output 1 feeds the
    attention; the engine counts it as one all-reduce slot. tp=1 has no all-reduce to fuse."""
    from dsc.compiler.diff import node_inputs
    from dsc.runtime.engine import _all_reduce_nodes

    op = "dsc.vocab_embedding_all_reduce_rmsnorm.default"
    plan = plan_of(compile_artifact("llama-tiny", dtype="fp32", tp=2))
    assert plan["passes"]["fuse_add_norm.embedding_all_reduce"] == 3  # one per program
    for program in ("prefill", "decode"):
        nodes = plan["programs"][program]["nodes"]
        ops = call_ops(plan, program)
        assert ops.count(op) == 1, program
        assert not {"dsc.vocab_embedding.default", "dsc.all_reduce.default", "dsc.rmsnorm.default"} & set(ops)
        (fused,) = [n for n in nodes if n.get("op") == op]
        assert fused["name"] == "model.embed_tokens.vocab_embedding_all_reduce_rmsnorm"
        assert [a.get("node", a) if isinstance(a, dict) else a for a in fused["args"]] == [
            "model.embed_tokens.weight",
            "input_ids",
            "model.embed_tokens.vocab_start",
            "model.layers.0.input_layernorm.weight",
            1e-6,
        ]
        rows = [1, "tokens"] if program == "ragged" else ["batch", 1 if program == "decode" else "seq"]
        assert fused["shape"] == [[*rows, 64]] * 2
        out = {
            n["args"][1]: n["name"]
            for n in nodes
            if n.get("op") == "operator.getitem" and n["args"][0] == {"node": fused["name"]}
        }
        readers = {i: {n["op"] for n in nodes if name in node_inputs(n)} for i, name in out.items()}
        assert readers == {0: {"dsc.all_reduce_add_rmsnorm.default"}, 1: {"aten.linear.default"}}, readers
        slots = _all_reduce_nodes(plan["programs"][program])
        assert len(slots) == 2 * plan["model"]["layers"] + 1 and slots[0]["op"] == op
    tp1 = plan_of(compile_artifact("llama-tiny", dtype="fp32"))
    assert "fuse_add_norm.embedding_all_reduce" not in tp1["passes"]
    assert "dsc.rmsnorm.default" in call_ops(tp1, "decode") and op not in call_ops(tp1, "decode")


# -- composition with int8 ---------------------------------------------------------------------------
def test_fusions_with_int8(compile_artifact, make_checkpoint):
    ckpt = make_checkpoint("llama-tiny")
    fused = compile_artifact("llama-tiny", dtype="fp32", int8=True)
    plain = compile_artifact("llama-tiny", dtype="fp32", int8=True, fuse=False)
    plan = plan_of(fused)
    for rule in FIRES["llama"]:
        assert plan["passes"].get(rule, 0) > 0, f"{rule} did not fire with --int8"
    ops = set(call_ops(plan, "decode"))
    # the decode gate_up and its swiglu: one dsc.linear_w8a16_swiglu (decode_linears)
    want = OPS["llama"] - {"dsc.swiglu.default"} | {ROTARY_OPS["decode"], "dsc.linear_w8a16_swiglu.default"}
    assert "dsc.linear_w8a16.default" in ops and want <= ops and "dsc.swiglu.default" not in ops
    assert OPS["llama"] <= set(call_ops(plan, "prefill"))
    ps = sample_prompts(512)
    want = hf_last_logits(ckpt, ps)
    got = dsc.load(fused, device="cpu").prefill(ps)
    # per-row int8 scales of a fused weight are those of its members: fusion adds no error
    assert sqnr_db(dsc.load(plain, device="cpu").prefill(ps), got) >= 60
    assert sqnr_db(want, got) >= 20


def test_sliding_window_with_tp2_and_int8(compile_artifact, make_checkpoint, tmp_path):
    """Mistral's 8-token window survives sharding (each rank's attention keeps it) and int8."""
    ckpt = make_checkpoint("mistral-tiny")
    art = compile_artifact("mistral-tiny", dtype="fp32", tp=2)
    assert all(plan_of(art)["passes"].get(rule, 0) > 0 for rule in FIRES["llama"])
    res = run_ranks(art, ckpt, tmp_path)
    assert max(len(p) for p in res["prompts"]) + 6 > 8  # the run goes past the window
    assert res["tokens_equal"], res["summary"]
    assert res["max_abs_err"] <= FP32_ATOL, res["summary"]
    art8 = compile_artifact("mistral-tiny", dtype="fp32", tp=2, int8=True)
    res8 = run_ranks(art8, ckpt, tmp_path)
    assert sqnr_db(hf_last_logits(ckpt, res8["prompts"]), res8["logits"]) >= 20


def test_fusions_with_tp2_and_int8(compile_artifact, make_checkpoint, tmp_path):
    ckpt = make_checkpoint("llama-tiny")
    art = compile_artifact("llama-tiny", dtype="fp32", tp=2, int8=True)
    plan = plan_of(art)
    assert all(plan["passes"].get(rule, 0) > 0 for rule in FIRES["llama"])
    res = run_ranks(art, ckpt, tmp_path)
    assert sqnr_db(hf_last_logits(ckpt, res["prompts"]), res["logits"]) >= 20


def test_gpt2_biases_move_into_the_next_kernel(compile_artifact):
    """At batch 1 a biased cuBLAS linear is two launches (a bias copy, then the GEMV): the
    output projections' biases move into add_layernorm, c_fc's into gelu; c_attn keeps its own."""
    plan = plan_of(compile_artifact("gpt2-tiny", dtype="fp32"))
    nodes = plan["programs"]["decode"]["nodes"]
    biased = {
        n["name"].split(".h.0.")[-1]: n["kernel"]["config"]["bias"]
        for n in nodes
        if n.get("op") == "aten.linear.default" and ".h.0." in n["name"]
    }
    assert biased == {
        "attn.c_attn.linear": True,
        "attn.c_proj.linear": False,
        "mlp.c_fc.linear": False,
        "mlp.c_proj.linear": False,
    }
    c_attn = next(n for n in nodes if n["name"].endswith("h.0.attn.c_attn.linear"))
    assert c_attn["kernel"]["launches"] == 2
    ln = [n for n in nodes if n.get("op") == "dsc.add_layernorm.default"]
    assert all(n["kernel"]["config"].get("x_bias") for n in ln[1:])  # all but the embeddings' sum
    assert all(n["kernel"]["config"].get("bias") for n in nodes if n.get("op") == "dsc.gelu.default")
    assert plan["notes"]["kernels"]["launches"]["decode"]["launches_per_layer"] == 9  # 12 with the biases unmoved


def test_plan_counts_copies_honestly():
    """A reshape that cannot be a view (its input is transposed) is a copy launch; views are free."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsc.passes.plan_kernels import plan_node

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    t = g.call_function(aten.transpose.int, (x, 0, 1))
    copy = g.call_function(aten.reshape.default, (t, [3, 8]))
    view = g.call_function(aten.reshape.default, (x, [8, 3]))
    with FakeTensorMode() as mode:
        x.meta["val"] = torch.empty(2, 3, 4)
        t.meta["val"] = x.meta["val"].transpose(0, 1)
        copy.meta["val"] = t.meta["val"].reshape(3, 8)
        view.meta["val"] = x.meta["val"].reshape(8, 3)
    assert mode
    assert plan_node(t, "sm_90")["launches"] == 0
    assert plan_node(copy, "sm_90") == {"name": "aten.copy", "config": {}, "launches": 1}
    assert plan_node(view, "sm_90")["launches"] == 0


def test_patterns_cover_fp32_and_16bit():
    """One eager pattern, traced per dtype: the 16-bit RMSNorm keeps its casts, fp32 has none."""
    from dsc.passes.fuse_activation import GELU_TANH, SWIGLU
    from dsc.passes.fuse_add_norm import RMSNORM
    from dsc.passes.fuse_rotary import ROTARY

    assert len(RMSNORM.graphs()) == 2
    for p in (ROTARY, SWIGLU, GELU_TANH):
        assert len(p.graphs()) == 1
    ph = [n.name for n in RMSNORM.graphs()[1].nodes if n.op == "placeholder"]
    assert ph == ["x", "weight", "eps", "dtype"]
