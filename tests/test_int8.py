"""The quantize_int8 pass, the int8 artifact and the compile-time accuracy report.

Numerics are judged by SQNR (dB) of the logits against the fp32 artifact of the same
checkpoint, teacher-forced through the runtime (prefill, then decode steps fed the fp32
model's greedy tokens). Checkpoints are random-weight Llama / GPT-2 with outliers: `outlier_channels` scales a
few input channels of every linear weight 20x (rows with outliers); `act_outliers` scales a
few channels of every norm weight 30x (activation outlier channels, what SmoothQuant is for);
`skewed` shifts every linear weight by +2.5 standard deviations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks
from safetensors.torch import load_file, save_file

import dsc
from dsc.compiler.verify import sample_prompts
from dsc.errors import UserError
from dsc.kernels.int8 import sqnr_db

OUTLIERS = {"outlier_channels": 4}
STEPS = 6
CALIBRATION = (
    "The quick brown fox jumps over the lazy dog.\n"
    "Once upon a time there was a small model that learned to count: one two three four.\n"
    "Hello world! The weather today is sunny and warm.\n"
    "dsc is an ahead-of-time compiler for transformer inference.\n"
)


# -- helpers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def variant_checkpoint(make_checkpoint, tmp_path_factory):
    """A random checkpoint with its safetensors rewritten: "act_outliers" or "skewed"."""
    cache = {}

    def make(shape: str, kind: str) -> Path:
        if (shape, kind) not in cache:
            src = Path(make_checkpoint(shape))
            dst = tmp_path_factory.mktemp(f"{shape}-{kind}")
            for f in src.iterdir():
                if f.is_file() and f.name != "model.safetensors":
                    (dst / f.name).write_bytes(f.read_bytes())
            sd = load_file(src / "model.safetensors")
            g = torch.Generator().manual_seed(1)
            if kind == "act_outliers":
                _activation_outliers(sd, g)
            for k, v in sd.items():
                if kind == "skewed" and v.dim() == 2 and ("layers." in k or ".h." in k):
                    v += 2.5 * v.std()
            save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
            cache[(shape, kind)] = dst
        return cache[(shape, kind)]

    return make


# norm -> the linears that read its output, and whether they store [in, out] (GPT-2 Conv1D)
_NORM_READERS = {
    "input_layernorm": (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], False),
    "post_attention_layernorm": (["mlp.gate_proj", "mlp.up_proj"], False),
    "ln_1": (["attn.c_attn"], True),
    "ln_2": (["mlp.c_fc"], True),
}


def _activation_outliers(sd: dict, g: torch.Generator, factor: float = 30.0) -> None:
    """Scale 3 channels of every block norm's output by `factor` and the matching input columns
    of the linears reading it by 1/factor: the fp32 model computes the same function, but its
    activations have outlier channels (as LLMs' do), which per-token int8 handles badly."""
    for key in [k for k in sd if k.endswith(".weight") and k.split(".")[-2] in _NORM_READERS]:
        prefix, norm = key.rsplit(".", 2)[0], key.split(".")[-2]
        idx = torch.randperm(sd[key].shape[0], generator=g)[:3]
        sd[key][idx] *= factor
        if f"{prefix}.{norm}.bias" in sd:
            sd[f"{prefix}.{norm}.bias"][idx] *= factor
        readers, in_first = _NORM_READERS[norm]
        for r in readers:
            w = sd[f"{prefix}.{r}.weight"]
            if in_first:
                w[idx] /= factor
            else:
                w[:, idx] /= factor


def teacher_forced(art, prompts, tokens: torch.Tensor | None = None, steps: int = STEPS):
    """(logits [steps, B, V], tokens fed [B, steps - 1]) through the runtime; tokens None: greedy."""
    e = dsc.load(art, device="cpu")
    out = [e.prefill(prompts)]
    lens = torch.tensor([len(p) for p in prompts])
    fed = []
    for i in range(steps - 1):
        tok = out[-1].argmax(-1) if tokens is None else tokens[:, i]
        fed.append(tok)
        out.append(e.decode(tok, lens + i))
    return torch.stack(out), torch.stack(fed, 1)


@pytest.fixture(scope="module")
def reference():
    """fp32 teacher-forced logits and tokens per (artifact path, prompts)."""
    cache = {}

    def ref(art, prompts):
        key = (str(art), json.dumps(prompts))
        if key not in cache:
            cache[key] = teacher_forced(art, prompts)
        return cache[key]

    return ref


def eval_rows(prompts: list[list[int]], positions: int) -> tuple[list[list[int]], list[int]]:
    """One row per (prompt, position) for the last `positions` positions of each prompt, in the
    report's order: (sequences, last_idx) of a prefill batch whose logits are the report's."""
    seqs, last = [], []
    for p in prompts:
        for j in range(max(0, len(p) - positions), len(p)):
            seqs.append(p)
            last.append(j)
    return seqs, last


def position_logits(art, prompts, positions: int) -> torch.Tensor:
    """Runtime prefill logits [rows, V] at the last `positions` positions of every prompt (the
    report's evaluation rows), in batches of the artifact's max_batch."""
    from dsc.compiler.simulate import pad

    e = dsc.load(art, device="cpu")
    seqs, last = eval_rows(prompts, positions)
    out = []
    for i in range(0, len(seqs), e.max_batch):
        ids, pos = pad(seqs[i : i + e.max_batch])
        out.append(
            e.run("prefill", ids, pos, torch.zeros(len(ids), dtype=torch.long), torch.tensor(last[i : i + e.max_batch]))
        )
    return torch.cat(out)


def measured_sqnr(fp_art, q_art, prompts, reference) -> float:
    want, tokens = reference(fp_art, prompts)
    got, _ = teacher_forced(q_art, prompts, tokens)
    return sqnr_db(want, got)


def manifest(art) -> dict:
    return json.loads((Path(art) / "manifest.json").read_text())


def plan_ops(art) -> list[tuple[str, str]]:
    plan = json.loads((Path(art) / "plan.json").read_text())
    return [(p, n["op"]) for p, prog in plan["programs"].items() for n in prog["nodes"] if n["kind"] == "call"]


def prompts_for(shape: str) -> list[list[int]]:
    return sample_prompts(512, batch=3)


def calibration_file(tmp_path_factory) -> str:
    f = tmp_path_factory.mktemp("calib") / "prompts.txt"
    f.write_text(CALIBRATION)
    return str(f)


def traced(make_checkpoint, shape="llama-tiny", **options):
    """The model after the pass pipeline (no emit, no report)."""
    from dsc.compiler.architectures import architecture_for
    from dsc.compiler.options import make_options
    from dsc.compiler.pipeline import run_passes
    from dsc.compiler.source import open_checkpoint
    from dsc.compiler.trace import trace

    ckpt = open_checkpoint(str(make_checkpoint(shape, **OUTLIERS)))
    opts = make_options(dtype="fp32", int8=True, **options)
    return run_passes(trace(ckpt, architecture_for(ckpt.config, "config.json"), opts))


# -- the pass, the plan, the artifact ------------------------------------------------------
@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-tiny"])
def test_int8_artifact_plan_weights_and_report(shape, compile_artifact):
    art = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32", int8=True)
    fp = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32")
    man = manifest(art)
    layers = 2
    linears_per_layer = 4  # llama: fused qkv, o_proj, fused gate_up, down_proj; gpt2: c_attn, c_proj, c_fc, c_proj
    # the pass fired on every block linear of the three programs, kept lm_head
    assert man["passes"]["quantize_int8.w8a16"] == 3 * layers * linears_per_layer
    assert man["passes"]["quantize_int8.keep_head"] == 3
    ops = plan_ops(art)
    # (llama's decode and ragged gate_up with its swiglu: one dsc.linear_w8a16_swiglu, decode_linears)
    assert (
        sum(op in ("dsc.linear_w8a16.default", "dsc.linear_w8a16_swiglu.default") for _, op in ops)
        == 3 * layers * linears_per_layer
    )
    assert sum(op == "dsc.linear_w8a16_swiglu.default" for _, op in ops) == (2 * layers if shape == "llama-tiny" else 0)
    assert sum(op == "aten.linear.default" for _, op in ops) == 3  # lm_head, one per program
    # rank file: int8 values and fp32 scales; about half the 16-bit bytes of the linears
    rep = man["int8_report"]
    mem = rep["memory"]
    assert 0.5 < (mem["int8_bytes"] + mem["scale_bytes"]) / mem["bytes_16bit"] < 0.56
    from dsc.runtime.inspect import describe

    info = describe(art)
    assert info["ranks"][0]["bytes_by_dtype"]["I8"] == mem["int8_bytes"]
    assert info["ranks"][0]["bytes"] < 0.7 * describe(fp)["ranks"][0]["bytes"]
    # report: every quantized weight has a finite SQNR; logits metrics are sane
    assert len(rep["layers"]) == layers * linears_per_layer and all(20 < v < 80 for v in rep["layers"].values())
    assert rep["logits"]["top1_agreement"] >= 0.75 and 0 <= rep["logits"]["kl_div"] < 0.05


def test_plan_records_the_gluon_kernel_where_it_runs(compile_artifact):
    """plan.json's W8A16 configs per token bucket, for sm_90: the Gluon kernel (`w8a16_regs`) at
    2-8 tokens for 16-bit activations, the Triton kernels elsewhere; an fp32 model, which the
    Gluon kernel cannot take, records the mma kernel's default there, as w8a16_matmul runs."""
    for dtype, want in (("fp16", "w8a16_regs"), ("fp32", "w8a16_mma")):
        plan = json.loads((Path(compile_artifact("llama-tiny", dtype=dtype, int8=True)) / "plan.json").read_text())
        cfgs = [
            n["kernel"]["config"]
            for prog in plan["programs"].values()
            for n in prog["nodes"]
            if n.get("op") == "dsc.linear_w8a16.default"
        ]
        assert cfgs and plan["notes"]["kernels"]["arch"] == "sm_90"
        for c in cfgs:
            assert [c[b]["kernel"] for b in ("M1", "M8", "M16", "M64")] == [
                "w8a16_gemv",
                want,
                "w8a16_mma",
                "w8a16_mma",
            ]
            assert bool(c["M8"].get("REGS")) == (want == "w8a16_regs")


def test_report_takes_every_position_from_one_run_in_fp32(make_checkpoint):
    """The report's simulation (compiler/simulate.py `logits_at`): one prefill run of the
    batch gives the logits at every evaluated position, equal to a run per position, each
    weight produced once per rank; with dtype=float32 a bf16 program computes in fp32 (its
    logits nearer the fp32 program's than its own bf16 run's)."""
    from dsc.compiler.rank_files import RankTensors
    from dsc.compiler.simulate import Simulator
    from dsc.compiler.weights import SourceReader

    prompts = sample_prompts(512, batch=3)
    seqs, last = eval_rows(prompts, 4)
    L = max(map(len, prompts))
    fp32 = traced(make_checkpoint, tp=2)
    with SourceReader(fp32.checkpoint) as reader:
        make = RankTensors(fp32, reader)
        made = []
        one_run = Simulator(
            fp32, lambda n, r: made.append((n, r)) or make(n, r), 2, batch=3, seq=L, dtype=torch.float32
        ).logits_at(prompts, 4)
        per_position = Simulator(fp32, make, 2, batch=len(seqs), seq=L).prefill(seqs, last)
    read = {n.target for n in fp32.programs["prefill"].nodes if n.op == "get_attr" and n.target in fp32.weights}
    assert sorted(made) == sorted((n, r) for n in read for r in range(2))
    assert one_run.shape == per_position.shape == (11, 512)
    assert (one_run - per_position).abs().max() <= 1e-4 * per_position.abs().max()

    from dsc.compiler.architectures import architecture_for
    from dsc.compiler.options import make_options
    from dsc.compiler.pipeline import run_passes
    from dsc.compiler.trace import trace

    bf16 = run_passes(
        trace(
            fp32.checkpoint,
            architecture_for(fp32.checkpoint.config, "config.json"),
            make_options(dtype="bf16", int8=True, tp=2),
        )
    )
    with SourceReader(bf16.checkpoint) as reader:
        make = RankTensors(bf16, reader)
        in_bf16 = Simulator(bf16, make, 2, batch=3, seq=L).logits_at(prompts, 4)
        in_fp32 = Simulator(bf16, make, 2, batch=3, seq=L, dtype=torch.float32).logits_at(prompts, 4)
    assert sqnr_db(one_run, in_fp32) > sqnr_db(one_run, in_bf16) + 3


def test_report_measures_what_the_runtime_runs(compile_artifact, reference):
    """The report's logits SQNR (compile-time, in-process) equals the SQNR of the artifact
    run by the runtime on the same prompts and tokens."""
    fp = compile_artifact("llama-tiny", ckpt_kwargs=OUTLIERS, dtype="fp32")
    art = compile_artifact("llama-tiny", ckpt_kwargs=OUTLIERS, dtype="fp32", int8=True)
    from dsc.compiler.int8_report import REPORT_PROMPTS, REPORT_TOKENS
    from dsc.compiler.sample_text import sample_prompts as text_prompts

    # what the report uses without calibration prompts: the sample text in the model's tokenizer
    prompts = text_prompts(art / "tokenizer", REPORT_PROMPTS, REPORT_TOKENS, 512)
    rep = manifest(art)["int8_report"]
    assert rep["inputs"]["source"] == "sample text"
    n = rep["inputs"]["positions_per_prompt"]
    want, got = position_logits(fp, prompts, n), position_logits(art, prompts, n)
    assert got.shape[0] == rep["logits"]["positions"]
    assert abs(sqnr_db(want, got) - rep["logits"]["sqnr_db"]) < 0.05, (sqnr_db(want, got), rep["logits"])
    top1 = float((want.argmax(-1) == got.argmax(-1)).double().mean())
    assert abs(top1 - rep["logits"]["top1_agreement"]) < 1e-3


# -- SQNR per mode ---------------------------------------------------------------------------
MODES = {  # name: (options, minimum logits SQNR in dB)
    "w8a16": ({}, 28.0),
    "w8a16-asym": ({"int8_asymmetric": True}, 28.0),
    "w8a16-group16": ({"int8_group_size": 16}, 30.0),
    "w8a8": ({"int8_mode": "w8a8"}, 24.0),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-tiny"])
def test_logits_sqnr_per_mode(shape, mode, compile_artifact, reference):
    opts, floor = MODES[mode]
    fp = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32")
    art = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32", int8=True, **opts)
    got = measured_sqnr(fp, art, prompts_for(shape), reference)
    assert got > floor, f"{shape} {mode}: logits SQNR {got:.1f} dB <= {floor} dB"


@pytest.mark.parametrize("shape", ["llama-tiny", "gpt2-tiny"])
def test_grouped_beats_per_channel_on_rows_with_outliers(shape, compile_artifact, reference):
    fp = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32")
    per_ch = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32", int8=True)
    grouped = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32", int8=True, int8_group_size=16)
    p = prompts_for(shape)
    assert measured_sqnr(fp, grouped, p, reference) > measured_sqnr(fp, per_ch, p, reference) + 1.0
    w_per, w_grp = (manifest(a)["int8_report"]["weight_sqnr_db"]["median"] for a in (per_ch, grouped))
    assert w_grp > w_per + 1.5


def test_asymmetric_beats_symmetric_on_skewed_weights(variant_checkpoint, tmp_path):
    ck = variant_checkpoint("llama-tiny", "skewed")
    reports = {}
    for name, asym in (("sym", False), ("asym", True)):
        art = dsc.compile(str(ck), tmp_path / name, dtype="fp32", int8=True, int8_asymmetric=asym)
        reports[name] = manifest(art)["int8_report"]
    assert reports["asym"]["weight_sqnr_db"]["min"] > reports["sym"]["weight_sqnr_db"]["min"] + 3.0
    assert reports["asym"]["logits"]["sqnr_db"] > reports["sym"]["logits"]["sqnr_db"] + 3.0


@pytest.mark.parametrize("shape", ["llama-tiny"])  # gpt2-tiny: 15.6 -> 35.3 dB when last measured
def test_smoothquant_improves_w8a8_on_activation_outliers(shape, variant_checkpoint, tmp_path_factory, reference):
    ck = variant_checkpoint(shape, "act_outliers")
    cal = calibration_file(tmp_path_factory)
    out = tmp_path_factory.mktemp(f"sq-{shape}")
    fp = dsc.compile(str(ck), out / "fp", dtype="fp32")
    bare = out / "no-tokenizer"  # the same weights without a tokenizer: W8A8 has nothing to smooth on
    shutil.copytree(ck, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    plain = dsc.compile(str(bare), out / "w8a8", dtype="fp32", int8=True, int8_mode="w8a8")
    assert not manifest(plain)["int8_report"]["smoothquant"]
    assert manifest(plain)["int8_report"]["inputs"]["source"] == "random tokens"
    default = dsc.compile(str(ck), out / "w8a8-sample", dtype="fp32", int8=True, int8_mode="w8a8")
    assert manifest(default)["int8_report"]["smoothquant"]  # on the built-in sample text
    smooth = dsc.compile(str(ck), out / "sq", dtype="fp32", int8=True, int8_mode="w8a8", calibrate=cal)
    man = manifest(smooth)
    assert man["passes"]["quantize_int8.smooth"] == 4 * 2  # every block weight smoothed
    assert man["int8_report"]["smoothquant"] and man["int8_report"]["inputs"]["source"] == "calibration"
    plan = json.loads((Path(smooth) / "plan.json").read_text())
    assert any(
        n["kind"] == "weight" and n["target"].endswith(".inv_smooth") for n in plan["programs"]["decode"]["nodes"]
    )
    from dsc.compiler.source import open_checkpoint
    from dsc.passes.quantize_int8 import calibration_prompts

    prompts = calibration_prompts(cal, open_checkpoint(str(ck)), 512)[:3]  # in-distribution text
    base, better = measured_sqnr(fp, plain, prompts, reference), measured_sqnr(fp, smooth, prompts, reference)
    assert better > base + 3.0, (base, better)


# -- options -------------------------------------------------------------------------------------
def test_lm_head_and_skip_patterns(make_checkpoint):
    m = traced(make_checkpoint, "llama-tiny", int8_lm_head=True, int8_skip=("model.layers.1.mlp.*",))
    names = {
        n.args[1].target
        for _, g in m.graphs()
        for n in g.nodes
        if n.op == "call_function" and n.target is torch.ops.dsc.linear_w8a16.default
    }
    assert "lm_head.weight.qweight" in names
    assert not any(n.startswith("model.layers.1.mlp.") for n in names)
    assert any(n.startswith("model.layers.0.mlp.") for n in names)
    assert m.counters["quantize_int8.skip"] == 2 * 3  # gate_up and down, in each of the three programs
    assert "model.layers.1.mlp.down_proj.weight" in m.weights and "model.layers.0.mlp.down_proj.weight" not in m.weights
    # GPT-2's lm_head is tied to the embedding: quantized for the head, float for the lookup
    g = traced(make_checkpoint, "gpt2-tiny", int8_lm_head=True)
    assert "transformer.wte.weight" in g.weights and "transformer.wte.weight.qweight" in g.weights


def test_q_groups_map_to_group_sizes(make_checkpoint):
    from dsc.compiler.weights import local_shape

    m = traced(make_checkpoint, "llama-tiny", int8_q_groups=2)  # <= rows: per-channel is finer
    assert all(s.quant.group_size is None for s in m.weights.values() if s.quant)
    m = traced(make_checkpoint, "llama-tiny", int8_q_groups=1024)  # > rows: groups within a row
    sizes = {}
    for name, s in m.weights.items():
        if s.quant and s.quant.part == "scale":
            out, inp = s.shape
            chunk = out * inp // 1024  # DeepSpeed's elements per scale
            assert s.quant.group_size == max(d for d in range(1, chunk + 1) if inp % d == 0), name
            assert local_shape(s, 1) == (out, inp // s.quant.group_size)
            sizes[name.split(".")[-3]] = s.quant.group_size
    assert sizes == {"qkv_proj": 8, "o_proj": 4, "gate_up_proj": 16, "down_proj": 11}


def test_group_size_must_align_with_shards(make_checkpoint, tmp_path):
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn\.o_proj .*tp=2"):
        dsc.compile(
            str(make_checkpoint("llama-tiny")), tmp_path / "a", dtype="fp32", tp=2, int8=True, int8_group_size=64
        )  # o_proj's shard has 32 input features
    assert not (tmp_path / "a").exists()


def test_w8a8_group_size_must_fit_the_mma(make_checkpoint):
    with pytest.raises(UserError, match="multiple of 32"):
        traced(make_checkpoint, "llama-tiny", int8_mode="w8a8", int8_group_size=16)


def test_min_sqnr_fails_the_compile_naming_the_worst_layers(compile_artifact, make_checkpoint, tmp_path):
    rep = manifest(compile_artifact("llama-tiny", ckpt_kwargs=OUTLIERS, dtype="fp32", int8=True))["int8_report"]
    worst = rep["weight_sqnr_db"]["worst"][0][0]
    with pytest.raises(UserError, match=rf"--int8-min-sqnr 90: logits SQNR is .*{worst}"):
        dsc.compile(
            str(make_checkpoint("llama-tiny", **OUTLIERS)), tmp_path / "art", dtype="fp32", int8=True, int8_min_sqnr=90
        )
    assert not (tmp_path / "art").exists() and not list(tmp_path.iterdir())
    # a threshold it meets passes
    assert rep["logits"]["sqnr_db"] > 20


def test_calibration_file_errors(make_checkpoint, tmp_path):
    from dsc.compiler.source import open_checkpoint
    from dsc.passes.quantize_int8 import calibration_prompts

    ckpt = open_checkpoint(str(make_checkpoint("llama-tiny")))
    with pytest.raises(UserError, match="not found"):
        calibration_prompts(tmp_path / "missing.txt", ckpt, 64)
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(UserError, match="no calibration prompts"):
        calibration_prompts(tmp_path / "empty.txt", ckpt, 64)
    (tmp_path / "p.txt").write_text("hello world\n" + "the quick brown fox " * 40 + "\n")
    got = calibration_prompts(tmp_path / "p.txt", ckpt, 16)
    assert len(got) == 2 and len(got[1]) == 15
    with pytest.raises(UserError, match="--int8-mode w8a8"):
        dsc.compile(str(make_checkpoint("llama-tiny")), tmp_path / "x", int8=True, calibrate=str(tmp_path / "p.txt"))


def test_inspect_shows_the_report(compile_artifact, capsys):
    from dsc.runtime.inspect import describe, render

    render(describe(compile_artifact("llama-tiny", ckpt_kwargs=OUTLIERS, dtype="fp32", int8=True)))
    out = capsys.readouterr().out
    assert "int8 (w8a16, per-channel, symmetric): logits SQNR" in out and "I8" in out


# -- tensor parallel ---------------------------------------------------------------------------
def _rank_work(rank: int, jobs: dict) -> dict:
    return {
        name: (teacher_forced(art, prompts, tokens)[0].numpy(), position_logits(art, prompts, STEPS).numpy())
        for name, (art, prompts, tokens) in jobs.items()
    }


TP_SPAWNED = [  # (shape, tp, options), run by the runtime in spawned gloo ranks
    ("gpt2-tiny", 2, {"int8_group_size": 16}),  # a group size dividing every shard's input features
    ("llama-tiny", 2, {}),  # per-channel (fused q/k/v and gate/up, GQA): row-parallel shards take whole rows' scales
]
TP_SIMULATED = [  # every rank of the artifact in this process
    ("gpt2-tiny", 4, {"int8_group_size": 16}),  # row-parallel shards of one whole group: their own scales, as tp=1's
    ("llama-tiny", 2, {"int8_asymmetric": True}),  # whole rows' scales and zero points
]


def simulate_artifact(art, prompts, positions: int = STEPS) -> torch.Tensor:
    """position_logits of an artifact's plan and rank files with every rank in this process
    (compiler/simulate.py: collectives combined in-process), in one batch."""
    import types

    from dsc.compiler.simulate import Simulator
    from dsc.runtime.artifact import open_artifact
    from dsc.runtime.plan import build_graph

    a = open_artifact(art)
    program = types.SimpleNamespace(
        programs={"prefill": build_graph(a.plan["programs"]["prefill"]["nodes"], torch.device("cpu"))[0]},
        kv_cache=a.plan["kv_cache"],
    )
    weights = [load_file(a.rank_file(r)) for r in range(a.tp)]
    seqs, last = eval_rows(prompts, positions)
    sim = Simulator(program, lambda n, r: weights[r][n], a.tp, batch=len(seqs), seq=max(map(len, seqs)))
    return sim.prefill(seqs, last)


def _case_id(c) -> str:
    kind = "g{}".format(c[2]["int8_group_size"]) if "int8_group_size" in c[2] else "per-channel"
    return "{}-tp{}-{}{}".format(c[0], c[1], kind, "-asym" if c[2].get("int8_asymmetric") else "")


@pytest.fixture(scope="module")
def tp_logits(compile_artifact, reference):
    """{case id: (tp=1 int8 logits, tp=N logits, [every rank's logits])}: one spawn of 2 ranks."""
    out, jobs = {}, {}
    for shape, tp, opts in TP_SPAWNED + TP_SIMULATED:
        fp = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32")
        prompts = prompts_for(shape)
        _, tokens = reference(fp, prompts)
        one_art = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32", int8=True, **opts)
        one = teacher_forced(one_art, prompts, tokens)[0]
        art = str(compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32", tp=tp, int8=True, **opts))
        key = _case_id((shape, tp, opts))
        if (shape, tp, opts) in TP_SIMULATED:
            out[key] = (position_logits(one_art, prompts, STEPS), simulate_artifact(art, prompts), None)
        else:
            jobs[key] = (art, prompts, tokens)
            out[key] = (one, None, None)
    res = spawn_ranks(2, _rank_work, jobs)
    for key in jobs:
        per_rank = [torch.from_numpy(res[r][key][0]) for r in range(2)]
        out[key] = (out[key][0], per_rank[0], per_rank)
        out[key + "-positions"] = torch.from_numpy(res[0][key][1])
    return out


@pytest.mark.parametrize("case", TP_SPAWNED + TP_SIMULATED, ids=_case_id)
def test_tp_int8_equals_tp1_int8(case, tp_logits):
    one, tpn, per_rank = tp_logits[_case_id(case)]
    if per_rank:  # the runtime under gloo: every rank returns the same logits
        assert all(torch.equal(per_rank[0], x) for x in per_rank[1:])
    # shards quantized exactly as tp=1 quantizes them (a group never crosses a shard; per
    # channel, a row-parallel shard takes its whole rows' scales): equal up to fp32 rounding
    assert (one - tpn).abs().max() <= 1e-4 * one.abs().max()


def test_in_process_simulation_matches_the_runtime_ranks(tp_logits, compile_artifact, reference):
    """What the report and SmoothQuant calibration run (all ranks in one process) is what the
    runtime's gloo ranks compute."""
    shape, tp, opts = TP_SPAWNED[0]
    fp = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32")
    prompts = prompts_for(shape)
    _, tokens = reference(fp, prompts)
    art = compile_artifact(shape, ckpt_kwargs=OUTLIERS, dtype="fp32", tp=tp, int8=True, **opts)
    got = simulate_artifact(art, prompts)
    want = tp_logits[_case_id(TP_SPAWNED[0]) + "-positions"]  # the runtime's rank 0, gloo
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max()
