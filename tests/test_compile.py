"""`dsc compile`: artifacts match transformers, from every kind of source, deterministically.

Numeric tolerances (docs/kernels.md "Numerics" states the same):
  fp32  teacher-forced logits: max |dsc - HF| <= 1e-4; greedy tokens identical, token for token.
  bf16  HF also runs in bf16. Teacher-forced logits: max |dsc - HF| <= BF16_REL_TOL * max |HF logit|
        (0.03, about 4 bf16 ulps at the scale of the largest logit: attention and matmuls
        accumulate in a different order). Greedy tokens must agree at every step where HF's
        top-2 logit gap exceeds twice that tolerance (closer calls may flip either way in bf16).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsc
from dsc.compiler import Progress
from dsc.compiler.options import CompileOptions, make_options, options_from_config_file
from dsc.compiler.verify import reference_greedy, reference_model, verify_artifact
from dsc.errors import PassError, UserError
from dsc.runtime.plan import ATTENTION_OPS

SHAPES = ["llama-tiny", "llama-odd", "gpt2-tiny", "gpt2-odd"]  # GQA; non-power-of-two sizes
MORE = ["opt-tiny", "opt-proj", "gptj-tiny", "gpt_neox-tiny", "phi-tiny", "gemma-tiny", "phi3-tiny"]
FP32_ATOL = 1e-4
BF16_REL_TOL = 0.03


def prompts(vocab: int = 509, lengths=(13, 7, 1, 4), seed: int = 0) -> list[list[int]]:
    """A batch of prompts of different lengths (1 included: prefill pads it to 2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def siblings(path: Path) -> list[str]:
    """What sits beside an artifact path: temp folders would show up here."""
    return sorted(p.name for p in path.parent.iterdir()) if path.parent.exists() else []


def plan_ops(art: Path, program: str) -> list[str]:
    plan = json.loads((art / "plan.json").read_text())
    return [n["op"] for n in plan["programs"][program]["nodes"] if n["kind"] == "call"]


# -- numerics against transformers --------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES + MORE)
def test_fp32_generation_matches_transformers(shape, compile_artifact, make_checkpoint):
    art = compile_artifact(shape, dtype="fp32")
    report = verify_artifact(art, make_checkpoint(shape), prompts=prompts(), new_tokens=8)
    assert report.tokens_equal, f"greedy tokens differ:\n{report.ref_tokens}\n{report.dsc_tokens}"
    assert report.max_abs_err <= FP32_ATOL, report.summary()
    layers = json.loads((art / "plan.json").read_text())["model"]["layers"]
    for program in ("prefill", "decode"):  # attention entered the graph as the dsc op, one per layer
        assert sum(plan_ops(art, program).count(op) for op in ATTENTION_OPS) == layers


# Rotary variants real Llama-family configs use (Llama 3.1+/3.2: "llama3"). Their frequency tables
# are computed by transformers' own code at trace time; "dynamic" (NTK) is traced as plain RoPE,
# which it equals up to max_position_embeddings (the default --max-seq is clamped to it: 64 here).
ROPE = {
    "llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        rope_theta=500000.0,
    ),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=64),
}


@pytest.mark.parametrize("rope", list(ROPE))
def test_scaled_rope_matches_transformers(rope, compile_artifact, make_checkpoint):
    art = compile_artifact("llama-tiny", ckpt_kwargs=ROPE[rope], dtype="fp32")
    ps = prompts(vocab=512, lengths=(21, 9))  # past original_max_position_embeddings
    report = verify_artifact(art, make_checkpoint("llama-tiny", **ROPE[rope]), prompts=ps, new_tokens=8)
    assert report.tokens_equal, f"greedy tokens differ:\n{report.ref_tokens}\n{report.dsc_tokens}"
    assert report.max_abs_err <= FP32_ATOL, report.summary()
    if rope == "dynamic":
        assert json.loads((art / "plan.json").read_text())["limits"]["max_seq"] == 64


# Mistral: every layer has an 8-token sliding window; Qwen2 (use_sliding_window,
# max_window_layers=1): layer 0 attends to everything, layer 1 to a window of 8. The prompts
# (up to 13 tokens) plus 8 new tokens run past the window in prefill and in decode.
WINDOWS = {"mistral-tiny": [8, 8], "qwen2-tiny": [0, 8]}


@pytest.mark.parametrize("shape", list(WINDOWS))
def test_sliding_window_generation_matches_transformers(shape, compile_artifact, make_checkpoint):
    art = compile_artifact(shape, dtype="fp32")
    plan = json.loads((art / "plan.json").read_text())
    for program in ("prefill", "decode"):
        attn = [n for n in plan["programs"][program]["nodes"] if n.get("op") in ATTENTION_OPS]
        assert [n["kernel"]["config"].get("window", 0) for n in attn] == WINDOWS[shape]
    from dsc.runtime.inspect import describe

    assert describe(art)["attention_windows"] == {str(w): WINDOWS[shape].count(w) for w in set(WINDOWS[shape])}
    report = verify_artifact(art, make_checkpoint(shape), prompts=prompts(vocab=512), new_tokens=8)
    assert report.tokens_equal, f"greedy tokens differ:\n{report.ref_tokens}\n{report.dsc_tokens}"
    assert report.max_abs_err <= FP32_ATOL, report.summary()


@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-odd", "mistral-tiny"])
@torch.no_grad()
def test_bf16_logits_match_transformers_bf16(shape, compile_artifact, make_checkpoint):
    art = compile_artifact(shape, dtype="bf16")
    engine = dsc.load(art, device="cpu")
    assert engine.dtype == torch.bfloat16
    ps, new = prompts(), 6
    ref = reference_model(make_checkpoint(shape), torch.bfloat16)
    ref_tokens, ref_logits = zip(*(reference_greedy(ref, p, new) for p in ps))  # logits: [new, V] each
    lens = torch.tensor([len(p) for p in ps])
    logits = engine.prefill(ps)  # teacher-forced: dsc is fed HF's tokens
    for step in range(new):
        want = torch.stack([r[step] for r in ref_logits])  # [B, V]
        tol = BF16_REL_TOL * float(want.abs().max())
        assert float((logits - want).abs().max()) <= tol, f"step {step}"
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
        assert torch.equal(logits.argmax(-1)[clear], want.argmax(-1)[clear]), f"step {step}"
        logits = engine.decode(torch.tensor([t[step] for t in ref_tokens]), lens + step)


def test_sharded_checkpoint_compiles_and_matches(compile_artifact, make_checkpoint):
    kw = {"shard_bytes": 150_000}
    ckpt = make_checkpoint("llama-odd", **kw)
    shards = sorted(p.name for p in ckpt.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (ckpt / "model.safetensors.index.json").exists()
    art = compile_artifact("llama-odd", ckpt_kwargs=kw, dtype="fp32")
    report = verify_artifact(art, ckpt, prompts=prompts(), new_tokens=6)
    assert report.tokens_equal and report.max_abs_err <= FP32_ATOL, report.summary()
    source_files = json.loads((art / "manifest.json").read_text())["source"]["files"]
    assert set(shards) <= set(source_files)


def test_compile_a_loaded_transformers_model(tmp_path, make_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_checkpoint("gpt2-odd"), dtype=torch.float32).eval()
    with torch.no_grad():  # an in-memory edit: the artifact must hold the model's weights, not the file's
        model.transformer.h[1].mlp.c_fc.weight.mul_(1.5)
    art = dsc.compile(model, tmp_path / "art")
    engine = dsc.load(art, device="cpu")
    ps = prompts()
    got = engine.prefill(ps)
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in ps])
    assert float((got - want).abs().max()) <= FP32_ATOL
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["source"]["model"] == model.name_or_path  # not the temporary save folder
    assert siblings(art) == ["art"]


# -- sources: hub cache -----------------------------------------------------------------


def _fake_hub_cache(root: Path, repo: str, ckpt: Path) -> None:
    """The layout huggingface_hub writes: blobs/, snapshots/<rev>/ symlinks, refs/main."""
    repo_dir = root / "hub" / ("models--" + repo.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / f.relative_to(ckpt)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs" / "main").write_text(rev)


def _offline_env(hf_home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": "1"}


def test_hub_id_in_local_cache_compiles_offline(tmp_path, make_checkpoint, compile_artifact):
    """...and the artifact's tokenizer/ takes the chat templates as transformers saves them."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("llama-tiny"), ckpt)
    templates = Path(__file__).parent / "data" / "chat_templates"
    shutil.copy(templates / "qwen3.jinja", ckpt / "chat_template.jinja")
    (ckpt / "additional_chat_templates").mkdir()
    shutil.copy(templates / "llama-3.1-instruct.jinja", ckpt / "additional_chat_templates" / "tool_use.jinja")
    _fake_hub_cache(tmp_path / "hf", "acme/tiny-llama", ckpt)
    out = tmp_path / "out" / "art"
    r = subprocess.run(
        [sys.executable, "-m", "dsc", "compile", "acme/tiny-llama", "-o", str(out), "--dtype", "fp32"],
        capture_output=True,
        text=True,
        env=_offline_env(tmp_path / "hf"),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    from_folder = compile_artifact("llama-tiny", dtype="fp32")
    for f in ("plan.json", "rank0.safetensors", "tokenizer/tokenizer.json"):
        assert (out / f).read_bytes() == (from_folder / f).read_bytes(), f
    assert json.loads((out / "manifest.json").read_text())["source"]["model"] == "acme/tiny-llama"
    for f in ("chat_template.jinja", "additional_chat_templates/tool_use.jinja"):
        assert (out / "tokenizer" / f).read_bytes() == (ckpt / f).read_bytes(), f


def test_missing_hub_id_is_a_clear_error(tmp_path):
    (tmp_path / "hf" / "hub").mkdir(parents=True)
    out = tmp_path / "out" / "art"
    r = subprocess.run(
        [sys.executable, "-m", "dsc", "compile", "acme/not-there", "-o", str(out)],
        capture_output=True,
        text=True,
        env=_offline_env(tmp_path / "hf"),
        timeout=300,
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "acme/not-there" in lines[0] and "cache" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not out.parent.exists()


# -- determinism and the destination ------------------------------------------------------


def test_compile_is_deterministic(tmp_path, make_checkpoint):
    ckpt = make_checkpoint("gpt2-odd")
    a = tmp_path / "a"
    dsc.compile(str(ckpt), a)
    first = digests(a)
    dsc.compile(str(ckpt), a)  # again, into the same path
    assert digests(a) == first
    assert siblings(a) == ["a"]  # no temp or old folders left beside it
    # another process (another hash seed), another path: the same plan and rank files
    b = tmp_path / "b"
    code = "import sys, dsc; dsc.compile(sys.argv[1], sys.argv[2])"
    subprocess.run(
        [sys.executable, "-c", code, str(ckpt), str(b)],
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    second = digests(b)
    for name in [n for n in first if n == "plan.json" or n.startswith(("rank", "tokenizer/"))]:
        assert second[name] == first[name], name


class _InterruptedWrite(Progress):
    """Presses ^C after a few tensors of the rank files are on disk."""

    def __init__(self):
        self.written = 0

    def advance_bytes(self, n: int) -> None:
        self.written += 1
        if self.written == 3:
            raise KeyboardInterrupt


def test_interrupted_compile_leaves_nothing(tmp_path, make_checkpoint):
    ckpt = make_checkpoint("llama-tiny")
    out = tmp_path / "out" / "art"
    with pytest.raises(KeyboardInterrupt):
        dsc.compile(str(ckpt), out, progress=_InterruptedWrite())
    assert siblings(out) == []
    # over an existing artifact, a failed compile keeps the old one intact
    dsc.compile(str(ckpt), out)
    before = digests(out)
    with pytest.raises(KeyboardInterrupt):
        dsc.compile(str(ckpt), out, max_seq=64, progress=_InterruptedWrite())
    assert digests(out) == before and siblings(out) == ["art"]


# -- the pass pipeline ---------------------------------------------------------------------


def test_dump_passes_writes_a_dump_per_pass(tmp_path, make_checkpoint):
    from typer.testing import CliRunner

    from dsc.cli import app
    from dsc.compiler.pipeline import pipeline

    dump = tmp_path / "dump"
    r = CliRunner().invoke(
        app,
        [
            "compile",
            str(make_checkpoint("llama-tiny")),
            "-o",
            str(tmp_path / "art"),
            "--dump-passes",
            str(dump),
            "--check-passes",
        ],
    )
    assert r.exit_code == 0, r.output
    names = ["trace"] + [n for n, _ in pipeline(CompileOptions())]
    assert sorted(p.name for p in dump.iterdir()) == [f"{i:02d}_{n}" for i, n in enumerate(names)]
    for i, n in enumerate(names):
        d = dump / f"{i:02d}_{n}"
        text = (d / "graph.txt").read_text()
        assert "program prefill:" in text and "program decode:" in text and "weights:" in text
        assert json.loads((d / "plan.json").read_text())["pass"] == n
    assert "dsc.causal_attention.default(" in (dump / "00_trace" / "graph.txt").read_text()
    bound = [d for d in sorted(dump.iterdir()) if d.name.endswith("_bind_kv_cache")][0]
    assert "dsc.attention.default(" in (bound / "graph.txt").read_text()


def _break_pass(monkeypatch, index: int) -> tuple[str, list[str]]:
    """Make the pass at `index` of the pipeline raise; return its name and those before it."""
    import dsc.compiler.pipeline as pl

    names = [n for n, _ in pl.pipeline(CompileOptions())]

    def fail(model):
        raise ValueError("synthetic failure")

    rows = [dataclasses.replace(s, fn=fail) if s.name == names[index] else s for s in pl.PASSES]
    monkeypatch.setattr(pl, "PASSES", tuple(rows))
    return names[index], names[:index]


def test_failing_pass_is_named_with_the_passes_before_it(tmp_path, make_checkpoint, monkeypatch):
    from typer.testing import CliRunner

    from dsc.cli import app

    name, before = _break_pass(monkeypatch, 1)
    out = tmp_path / "out" / "art"
    with pytest.raises(PassError) as e:
        dsc.compile(str(make_checkpoint("llama-tiny")), out)
    msg = str(e.value)
    assert f"pass '{name}' failed" in msg and "synthetic failure" in msg
    assert f"passes run before it: {', '.join(before)}" in msg
    assert siblings(out) == []
    r = CliRunner().invoke(app, ["compile", str(make_checkpoint("llama-tiny")), "-o", str(out)])
    assert r.exit_code == 3 and r.stderr.strip().splitlines() == [f"error: {msg}"], r.output
    assert siblings(out) == []


def test_options_without_their_pass_are_rejected(tmp_path, make_checkpoint, monkeypatch):
    import dsc.compiler.pipeline as pl

    monkeypatch.setattr(pl, "pipeline", lambda options: [("canonicalize", lambda m: m)])
    for kw, flag in (({"tp": 2}, "--tp"), ({"int8": True}, "--int8")):
        with pytest.raises(UserError, match=f"{flag}: not supported yet"):
            dsc.compile(str(make_checkpoint("llama-tiny")), tmp_path / "art", **kw)


# -- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"dtype": "fp16"}, {"dtype": "fp16"}),
        ({"dtype": "torch.bfloat16"}, {"dtype": "bf16"}),
        ({"dtype": "float32", "max_out_tokens": 256}, {"dtype": "fp32", "max_seq": 256}),
        ({"tensor_parallel": {"tp_size": 2}}, {"tp": 2}),
        ({"tensor_parallel": {"enabled": True, "tp_size": 4}}, {"tp": 4}),
        ({"mp_size": 2}, {"tp": 2}),
        ({"replace_with_kernel_inject": False}, {"fuse": False}),
        ({"replace_with_kernel_inject": True, "enable_cuda_graph": True}, {"fuse": True}),
        ({"quant": {"enabled": True}}, {"int8": True, "int8_q_groups": None}),
        ({"quant": {"enabled": True, "weight": {"num_bits": 8, "q_groups": 4}}}, {"int8": True, "int8_q_groups": 4}),
        ({"quant": {"enabled": False}}, {"int8": False}),
        ({"quantization_setting": 8}, {"int8": True, "int8_q_groups": 8}),
        ({"max_batch": 4, "max_seq": 64}, {"max_batch": 4, "max_seq": 64}),  # dsc's own field names
    ],
)
def test_deepspeed_config_aliases(tmp_path, config, expected):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(config))
    opts = make_options(str(f), **options_from_config_file(f))
    assert {k: getattr(opts, k) for k in expected} == expected


@pytest.mark.parametrize(
    "config, names",
    [
        ({"dtype": "fp16", "zero_optimization": {}, "train_batch_size": 8}, ["train_batch_size", "zero_optimization"]),
        ({"tensor_parallel": {"tp_size": 2, "tp_grain": 64}}, ["tp_grain"]),
        ({"quant": {"enabled": True, "bits": 4}}, ["bits"]),
    ],
)
def test_unknown_config_keys_are_rejected_by_name(tmp_path, config, names):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        options_from_config_file(f)
    assert str(f) in str(e.value) and all(n in str(e.value) for n in names)


def test_config_file_on_the_command_line(tmp_path, make_checkpoint):
    from typer.testing import CliRunner

    from dsc.cli import app

    f = tmp_path / "ds_inference.json"
    f.write_text(
        json.dumps(
            {
                "dtype": "fp32",
                "tensor_parallel": {"tp_size": 1},
                "max_out_tokens": 48,
                "replace_with_kernel_inject": True,
            }
        )
    )
    out = tmp_path / "art"
    r = CliRunner().invoke(
        app, ["compile", str(make_checkpoint("llama-tiny")), "-o", str(out), "--config", str(f), "--max-batch", "3"]
    )
    assert r.exit_code == 0, r.output
    opts = json.loads((out / "manifest.json").read_text())["options"]
    assert (opts["dtype"], opts["tp"], opts["max_seq"], opts["max_batch"]) == ("fp32", 1, 48, 3)
    assert json.loads((out / "plan.json").read_text())["kv_cache"]["shape"][0::2] == [3, 48]


def test_source_weights_read_by_rows_match_safetensors(make_checkpoint):
    """emit reads source tensors with plain file reads (no mmap, which kept every touched page
    of a 16 GB checkpoint in the compile's RSS): slices must equal safetensors' own."""
    from safetensors import safe_open

    from dsc.compiler.source import open_checkpoint
    from dsc.compiler.weights import SourceReader

    ckpt = open_checkpoint(str(make_checkpoint("gpt2-odd")))
    keys = ["transformer.h.0.attn.c_attn.weight", "transformer.h.2.ln_1.bias", "transformer.wte.weight"]
    with SourceReader(ckpt) as reader, safe_open(ckpt.files[0], framework="pt") as ref:
        for key in keys:
            got, want = reader.slice(key), ref.get_slice(key)
            assert got.get_shape() == want.get_shape()
            slices = [(slice(None),), (slice(3, 17),), (slice(70, 72),)]
            if len(want.get_shape()) == 2:
                slices += [(slice(None), slice(5, 40)), (slice(2, 9), slice(0, 1))]
            for idx in slices:
                assert torch.equal(got[idx], want[idx]), (key, idx)
