"""Decoder families beyond Llama and GPT-2: each against transformers, under --tp 2 and --int8.

Every family's random checkpoint (compiler/random_checkpoint.py, written under the names
transformers' save_pretrained uses) has sizes that are not powers of two: 72 hidden, 6 heads of
12 over 2 kv heads, a 200-wide MLP, 510 tokens. Tolerances are test_compile.py's (fp32: greedy
tokens identical, teacher-forced logits within 1e-4); tp=2 is checked against tp=1 as in
test_tp.py; int8 by the compile-time report's logits SQNR.
"""

from __future__ import annotations

import json

import pytest
from ranks import spawn_ranks
from safetensors import safe_open
from test_compile import FP32_ATOL, plan_ops, prompts
from test_fusion import check_golden
from test_tp import PROMPTS, _rank_work, teacher_forced

from dsc.compiler.architectures import ARCHITECTURES
from dsc.compiler.random_checkpoint import SHAPES
from dsc.compiler.verify import verify_artifact
from dsc.runtime.plan import ATTENTION_OPS

FAMILIES = [
    "qwen3-odd",
    "stablelm-odd",
    "starcoder2-odd",
    "olmo-odd",
    "olmo2-odd",
    "cohere-odd",
    "granite-odd",
    "gemma2-odd",
    "gemma3_text-odd",
    "falcon-odd",
    "falcon-new-odd",
    "bloom-odd",
]
# sliding windows per layer, shorter than the longest prompt (13) plus its 8 new tokens
WINDOWS = {"starcoder2-odd": [8, 8], "gemma2-odd": [6, 0], "gemma3_text-odd": [6, 0]}
SOFTCAPS = {"gemma2-odd": 2.0}  # attention logit soft-cap, small enough to change these models' scores
TP_SHAPES = [
    s
    for s in FAMILIES + ["gptj-tiny", "gpt_neox-tiny", "phi3-tiny", "mistral-tiny", "qwen2-tiny"]
    if not ARCHITECTURES[SHAPES[s][0]].tp_blocker(SHAPES[s][1])
]
INT8_MIN_SQNR = 20.0


def _plan(art) -> dict:
    return json.loads((art / "plan.json").read_text())


@pytest.mark.parametrize("shape", FAMILIES + ["gpt_neox-tiny"])
def test_fp32_generation_matches_transformers(shape, compile_artifact, make_checkpoint):
    art = compile_artifact(shape, dtype="fp32")
    report = verify_artifact(art, make_checkpoint(shape), prompts=prompts(vocab=510), new_tokens=8)
    assert report.tokens_equal, f"greedy tokens differ:\n{report.ref_tokens}\n{report.dsc_tokens}"
    assert report.max_abs_err <= FP32_ATOL, report.summary()
    plan = _plan(art)
    for program in ("prefill", "decode"):  # attention is the dsc op, once per layer, windows as configured
        assert sum(plan_ops(art, program).count(op) for op in ATTENTION_OPS) == plan["model"]["layers"]
        attn = [n for n in plan["programs"][program]["nodes"] if n.get("op") in ATTENTION_OPS]
        assert [n["kernel"]["config"].get("window", 0) for n in attn] == WINDOWS.get(shape, [0, 0])
        assert {n["kernel"]["config"].get("softcap", 0.0) for n in attn} == {SOFTCAPS.get(shape, 0.0)}


def test_gpt_neox_loads_the_head_as_checkpoints_name_it(make_checkpoint, compile_artifact):
    """Real GPT-NeoX (Pythia) checkpoints, and transformers' save_pretrained, name the head
    `embed_out`; the compiler finds it through transformers' own key mapping."""
    with safe_open(make_checkpoint("gpt_neox-tiny") / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    manifest = json.loads((compile_artifact("gpt_neox-tiny", dtype="fp32") / "manifest.json").read_text())
    assert manifest["source"]["model"]


def test_keys_without_the_base_model_prefix_resolve(make_checkpoint, tmp_path):
    """A checkpoint saved from the base model (`h.0...`, not `transformer.h.0...`) loads as
    transformers loads it: the prefix is added by its own key mapping."""
    import shutil

    from safetensors.torch import load_file, save_file

    import dsc

    src = make_checkpoint("gpt2-tiny")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    sd = load_file(src / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in sd.items()}, ck / "model.safetensors")
    assert "h.0.attn.c_attn.weight" in load_file(ck / "model.safetensors")
    report = verify_artifact(
        dsc.compile(str(ck), tmp_path / "art", dtype="fp32"),
        ck,
        prompts=prompts(vocab=512, lengths=(5, 2)),
        new_tokens=3,
    )
    assert report.tokens_equal and report.max_abs_err <= FP32_ATOL, report.summary()


@pytest.fixture(scope="module")
def tp_runs(compile_artifact):
    """tp=1 references, and every TP family's tp=2 artifact run on 2 gloo ranks in one spawn."""
    import dsc

    ref, jobs = {}, {}
    for shape in TP_SHAPES:
        e = dsc.load(compile_artifact(shape, dtype="fp32"), device="cpu")
        tokens = e.generate(PROMPTS, max_new_tokens=6, stop_tokens=[]).tokens
        ref[shape] = (tokens, teacher_forced(e, tokens))
        jobs[shape] = (str(compile_artifact(shape, dtype="fp32", tp=2)), tokens)
    return ref, spawn_ranks(2, _rank_work, jobs)


@pytest.mark.parametrize("shape", TP_SHAPES)
def test_tp2_matches_tp1(shape, tp_runs, compile_artifact):
    import torch

    ref, ranks = tp_runs
    for r in range(2):
        greedy, logits, _, rank, world = ranks[r][shape]
        assert (rank, world) == (r, 2)
        assert greedy == ref[shape][0], f"rank {r}"
        assert (torch.from_numpy(logits) - ref[shape][1]).abs().max() <= 1e-4, f"rank {r}"
    plan = _plan(compile_artifact(shape, dtype="fp32", tp=2))
    layers = plan["model"]["layers"]
    assert plan["passes"]["shard_tensor_parallel.row"] == len(plan["programs"]) * 2 * layers  # attention + MLP
    assert "replicated_linears" not in plan["notes"]["tp"], plan["notes"]["tp"]


# llama and gpt2: tests/test_int8.py
@pytest.mark.parametrize(
    "shape",
    FAMILIES
    + ["gpt_neox-tiny", "gptj-tiny", "phi3-tiny", "opt-tiny", "phi-tiny", "gemma-tiny", "mistral-tiny", "qwen2-tiny"],
)
def test_int8_report_passes(shape, compile_artifact, capsys):
    art = compile_artifact(shape, dtype="fp32", int8=True, int8_min_sqnr=INT8_MIN_SQNR)
    manifest = json.loads((art / "manifest.json").read_text())
    rep = manifest["int8_report"]
    with capsys.disabled():
        print(
            f"\n{shape}: int8 logits SQNR {rep['logits']['sqnr_db']:.1f} dB, "
            f"top-1 agreement {rep['logits']['top1_agreement']:.1%}"
        )
    assert rep["logits"]["sqnr_db"] >= INT8_MIN_SQNR
    quantized = sum(v for k, v in manifest["passes"].items() if k.startswith("quantize_int8.w8"))
    assert quantized >= 2 * 2 * 2  # at least attention in and out of every layer, both programs
    assert len(rep["layers"]) >= 2 * 2


@pytest.mark.parametrize(
    "shape",
    FAMILIES
    + ["gpt_neox-tiny", "gptj-tiny", "phi3-tiny", "opt-tiny", "phi-tiny", "gemma-tiny", "mistral-tiny", "qwen2-tiny"],
)  # llama, gpt2: test_fusion.py
def test_golden_plan(shape, compile_artifact):
    check_golden(shape, _plan(compile_artifact(shape, dtype="fp32")))


def test_unsupported_family_is_one_line_listing_the_supported(make_checkpoint, tmp_path):
    from typer.testing import CliRunner

    from dsc.cli import app

    ck = make_checkpoint("llama-tiny", tokenizer=False)
    cfg = json.loads((ck / "config.json").read_text())
    bad = tmp_path / "ck"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    (bad / "model.safetensors").write_bytes((ck / "model.safetensors").read_bytes())
    r = CliRunner().invoke(app, ["compile", str(bad), "-o", str(tmp_path / "a")])
    assert r.exit_code != 0 and not (tmp_path / "a").exists()
    (line,) = r.stderr.strip().splitlines()
    assert "unsupported model_type 'mamba'" in line and ", ".join(sorted(ARCHITECTURES)) in line


def test_bloom_config_as_released_checkpoints_spell_it():
    """bigscience/bloom-560m's config.json: n_embed, n_head, n_layer, no MLP width (4 x hidden)."""
    from dsc.compiler.architectures import architecture_for

    cfg = {"model_type": "bloom", "n_embed": 1024, "n_head": 16, "n_layer": 24, "vocab_size": 250880}
    arch = architecture_for(cfg, "config.json")
    assert (
        arch.hidden(cfg),
        arch.heads(cfg),
        arch.kv_heads(cfg),
        arch.head_dim(cfg),
        arch.layers(cfg),
        arch.intermediate(cfg),
    ) == (1024, 16, 16, 64, 24, 4096)


def test_falcon_multi_query_keeps_its_kv_head_on_every_rank(compile_artifact):
    """Falcon-7B's layout under --tp 2: each rank computes 3 of the 6 q heads against the one kv
    head, which every rank holds whole (its cache too); test_tp2_matches_tp1 checks the numbers."""
    plan = _plan(compile_artifact("falcon-odd", dtype="fp32", tp=2))
    assert plan["kv_cache"]["shape"][1] == 1 and plan["kv_pool"]["kv_heads"] == 1
    for program in ("prefill", "decode"):
        attn = [n for n in plan["programs"][program]["nodes"] if n.get("op") in ATTENTION_OPS]
        assert [n["shape"][2] for n in attn] == [3] * plan["model"]["layers"]


def test_bloom_alibi_slopes_are_constants_split_with_the_q_heads(compile_artifact):
    """BLOOM's ALiBi enters every attention op as its layer's [H] fp32 slopes, a constant of the
    artifact: no bias tensor, no mask, no softmax in the graph. Under --tp 2, rank r holds the
    slopes of its own q heads (test_tp2_matches_tp1 checks the numbers)."""
    import torch
    from safetensors.torch import load_file
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    slopes = _get_alibi_slopes(6, torch.device("cpu"))
    for tp in (1, 2):
        art = compile_artifact("bloom-odd", dtype="fp32", tp=tp)
        plan = _plan(art)
        names = [f"transformer.h.{i}.self_attention.alibi_slopes" for i in range(plan["model"]["layers"])]
        for program in plan["programs"].values():
            attn = [n for n in program["nodes"] if n.get("op") in ATTENTION_OPS]
            assert [n["args"][-1] for n in attn] == [{"node": name} for name in names]
            assert not [
                n["name"]
                for n in program["nodes"]
                if n.get("op", "").startswith(("aten.baddbmm", "aten.bmm", "aten._softmax"))
                or n.get("shape", []).count("seq") > 1
            ]
        for r in range(tp):
            held = load_file(art / f"rank{r}.safetensors")
            for name in names:
                assert held[name].dtype == torch.float32 and torch.equal(held[name], slopes.view(tp, -1)[r])
