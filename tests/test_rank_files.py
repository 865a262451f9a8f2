"""The streaming emit (compiler/rank_files.py): every rank file from one read of the checkpoint,
byte-identical to writing each rank's file on its own, in memory bounded by the largest
tensors whatever the model size and tp; and the stage timings of `dsc compile`."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
from pathlib import Path

import pytest
import torch

from dsc.compiler import rank_files
from dsc.compiler.weights import FileSlice


def traced(ckpt_dir: Path, **options):
    """(checkpoint, the model after the pass pipeline)."""
    from dsc.compiler.architectures import architecture_for
    from dsc.compiler.options import make_options
    from dsc.compiler.pipeline import run_passes
    from dsc.compiler.source import open_checkpoint
    from dsc.compiler.trace import trace

    ckpt = open_checkpoint(str(ckpt_dir))
    opts = make_options(**options)
    return ckpt, run_passes(trace(ckpt, architecture_for(ckpt.config, "config.json"), opts))


def rank_alone(model, reader, rank: int):
    """The reference producer of one rank's tensors: each quantized weight's shard quantized on
    its own, from the rank's own fp32 slice; a row-parallel shard of a weight that tp=1
    quantizes per channel with its whole rows' scales (so its entries are tp=1's)."""
    from dsc.compiler.weights import float_tensor
    from dsc.kernels.int8 import quantize_weight, weight_qparams
    from dsc.passes.quantize_int8 import group_size_for

    world = model.options.tp

    def produce(name: str) -> torch.Tensor:
        spec = model.weights[name]
        if spec.quant is None:
            return float_tensor(spec, rank, world, reader)
        key, _, part = name.rpartition(".")
        fp32 = dataclasses.replace(spec, quant=None, dtype="float32")
        params = None
        if (
            spec.shard is not None
            and spec.shard.dim == 1
            and world > 1
            and spec.quant.group_size is None
            and group_size_for(model, f"{key}.qweight", tp=1) is None
        ):
            params = weight_qparams(
                float_tensor(dataclasses.replace(fp32, shard=None), 0, 1, reader), None, spec.quant.symmetric
            )
        w = float_tensor(fp32, rank, world, reader)
        return quantize_weight(w, spec.quant.group_size, spec.quant.symmetric, params)[part]

    return produce


def write_each_rank_alone(model, ckpt, folder: Path) -> None:
    """The reference: each rank's file in header order, its slices read from the files."""
    from dsc.compiler.weights import SourceReader, write_safetensors

    world = model.options.tp
    with SourceReader(ckpt) as reader:
        for r in range(world):
            write_safetensors(
                folder / f"rank{r}.safetensors", rank_files.rank_entries(model, world), rank_alone(model, reader, r)
            )


CASES = {  # name: (checkpoint shape, checkpoint kwargs, compile options)
    "llama-tp1-bf16": ("llama-tiny", {"dtype": "bfloat16"}, {"tp": 1}),
    "llama-tp2-int8": ("llama-tiny", {"outlier_channels": 3}, {"tp": 2, "dtype": "fp32", "int8": True}),
    "llama-tp4-int8-asym": ("llama-tiny", {}, {"tp": 4, "dtype": "fp32", "int8": True, "int8_asymmetric": True}),
    "odd-tp2-int8-grouped": (
        "llama-odd",
        {"outlier_channels": 2},
        {"tp": 2, "dtype": "fp32", "int8": True, "int8_group_size": 4},
    ),
    "gpt2-tp4-bf16": ("gpt2-tiny", {}, {"tp": 4, "dtype": "bf16"}),
    "sharded-tp2-int8": ("llama-tiny", {"shard_bytes": 40_000}, {"tp": 2, "dtype": "fp32", "int8": True}),
    # bf16 sources quantized as stored (each element cast to fp32 in the quantizer)
    "llama-tp4-int8-bf16": ("llama-tiny", {"dtype": "bfloat16"}, {"tp": 4, "int8": True}),
    # transposed sources; row-parallel shards of one whole group each (their own scales)
    "gpt2-tp4-int8-grouped": ("gpt2-tiny", {}, {"tp": 4, "dtype": "fp32", "int8": True, "int8_group_size": 16}),
    # SmoothQuant: columns scaled before quantizing
    "llama-tp2-w8a8-smoothquant": (
        "llama-tiny",
        {"outlier_channels": 3},
        {"tp": 2, "dtype": "fp32", "int8": True, "int8_mode": "w8a8", "calibrate": "PROMPTS"},
    ),
}
PROMPTS = "The quick brown fox jumps over the lazy dog.\nHello world! The weather today is sunny and warm.\n"


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_read_writes_what_each_rank_alone_writes(case, make_checkpoint, tmp_path, monkeypatch):
    shape, ckpt_kw, options = CASES[case]
    if options.get("calibrate"):
        (tmp_path / "prompts.txt").write_text(PROMPTS)
        options = {**options, "calibrate": str(tmp_path / "prompts.txt")}
    ckpt, model = traced(make_checkpoint(shape, **ckpt_kw), **options)
    if model.options.calibrate:
        assert any(s.col_scale is not None for s in model.weights.values())
    (tmp_path / "ref").mkdir()
    write_each_rank_alone(model, ckpt, tmp_path / "ref")

    file_reads = []
    real = FileSlice.__getitem__
    monkeypatch.setattr(FileSlice, "__getitem__", lambda self, idx: file_reads.append(idx) or real(self, idx))
    handed: list[str] = []
    real_next = rank_files.SourceStream.next

    def next_(self):
        item = real_next(self)
        if item is not None:
            handed.append(item[0])
        return item

    monkeypatch.setattr(rank_files.SourceStream, "next", next_)
    (tmp_path / "new").mkdir()
    written = rank_files.write_rank_files(model, ckpt, tmp_path / "new", weight_sqnr=model.options.int8)

    for r in range(model.options.tp):
        name = f"rank{r}.safetensors"
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    # each source tensor a weight reads came whole from the one pass over the files, once
    assert file_reads == []
    assert sorted(handed) == sorted({k for s in model.weights.values() for k in s.sources})
    assert written.source_hashes == ckpt.file_hashes()
    if model.options.int8:
        from dsc.compiler.int8_report import int8_report

        assert written.weight_sqnr == int8_report(model)["layers"]


def test_an_unreadable_checkpoint_is_one_error_line(make_checkpoint, tmp_path):
    import shutil

    src = make_checkpoint("llama-tiny")
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(src, ckpt_dir)
    ckpt, model = traced(ckpt_dir, tp=2)
    f = ckpt_dir / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    from dsc.errors import UserError

    with pytest.raises(UserError, match="truncated safetensors file"):
        rank_files.write_rank_files(model, ckpt, tmp_path)


def _peak_rise(fn) -> int:
    """Bytes the process's peak RSS rose above its RSS before `fn` (Linux: the peak is reset
    through /proc/self/clear_refs)."""

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    # freed memory still in malloc's arenas would let `fn` grow without raising the RSS: hand it back first
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_memory_is_bounded_by_the_largest_tensors_not_the_model(make_checkpoint, tmp_path, monkeypatch):
    # 8 layers of a 1024-wide Llama in fp32: 427 MB of weights in 58 source tensors, the largest
    # 16 MB (embedding and head); the largest the writer makes is a fused gate/up weight (23 MB),
    # quantized with its temporaries. The bound is under half the model, so a writer holding a
    # rank's tensors, several layers', or (at tp=4) the other ranks' parts of the tensors, fails
    ckpt_dir = make_checkpoint(
        "llama-tiny", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, vocab_size=4000
    )
    monkeypatch.setattr(rank_files, "READ_AHEAD", 4000 * 1024 * 4)
    largest = 2 * 2816 * 1024 * 4
    rises = {}
    for tp in (1, 4):
        ckpt, model = traced(ckpt_dir, tp=tp, dtype="fp32", int8=True)
        total = sum(f.stat().st_size for f in ckpt.files)
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        rises[tp] = _peak_rise(lambda: rank_files.write_rank_files(model, ckpt, out, weight_sqnr=True))
    assert total > 400e6
    for tp, rise in rises.items():
        assert rise < min(8 * largest, total / 2), (
            f"tp={tp}: peak RSS rose {rise / 1e6:.0f} MB writing {total / 1e6:.0f} MB"
        )


def test_timings_are_printed_with_v_and_written_with_timings_file(make_checkpoint, compile_artifact, tmp_path):
    from typer.testing import CliRunner

    from dsc.cli import app

    ckpt = make_checkpoint("llama-tiny")
    out, tfile = tmp_path / "art", tmp_path / "t.json"
    res = CliRunner().invoke(
        app, ["compile", str(ckpt), "-o", str(out), "--tp", "2", "--int8", "-v", "--timings", str(tfile)]
    )
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    for stage in ("load", "trace", "shard_tensor_parallel", "quantize_int8", "emit", "int8 report"):
        assert any(ln.strip().endswith(f"s  {stage}") for ln in lines), stage
    assert any("emit.rank 1: slice" in ln for ln in lines) and any("emit.quantize" in ln for ln in lines)
    doc = json.loads(tfile.read_text())
    names = [s["name"] for s in doc["stages"]]
    assert names[:2] == ["load", "trace"] and "emit" in names and names.index("emit") < names.index("int8 report")
    assert {p["name"] for p in doc["emit_parts"]} >= {
        "read source",
        "hash source",
        "quantize",
        "quantization error",
        "rank 0: write",
        "rank 1: write",
    }
    assert doc["total_seconds"] == pytest.approx(sum(s["seconds"] for s in doc["stages"]), abs=0.01)
    # the timings stay out of the artifact: the same compile without them writes the same bytes
    plain = compile_artifact("llama-tiny", tp=2, int8=True)
    for f in sorted(p.relative_to(plain) for p in plain.rglob("*") if p.is_file() and p.name != "manifest.json"):
        assert (out / f).read_bytes() == (plain / f).read_bytes(), f
    m_out, m_plain = (json.loads((d / "manifest.json").read_text()) for d in (out, plain))
    assert {k: v for k, v in m_out.items() if k != "command"} == {k: v for k, v in m_plain.items() if k != "command"}
    # without -v, a compile whose stderr is not a terminal prints no stage lines
    quiet = CliRunner().invoke(app, ["compile", str(ckpt), "-o", str(tmp_path / "q")])
    assert quiet.exit_code == 0 and not any(ln.strip().endswith("s  trace") for ln in quiet.output.splitlines())


def test_timings_file_in_a_missing_folder_is_one_error_line(make_checkpoint, tmp_path):
    from typer.testing import CliRunner

    from dsc.cli import app

    res = CliRunner().invoke(
        app,
        [
            "compile",
            str(make_checkpoint("llama-tiny")),
            "-o",
            str(tmp_path / "a"),
            "--timings",
            str(tmp_path / "no" / "t.json"),
        ],
    )
    assert res.exit_code == 2 and res.output.strip().startswith("error: --timings:")
    assert not (tmp_path / "a").exists()
