"""scripts/: every maintained tool's code path on the CPU (tiny shapes; Triton kernels in the
interpreter, in a child process since TRITON_INTERPRET must be set before triton is imported).
The timings are meaningless here; the GPU runs are what the tools are for. bench_int8.py and
tune_gemv.py have theirs beside their kernels (test_int8_kernels.py, test_linear_kernel.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))


def run(script: str, *args: str, interpret: bool = False, **env: str) -> str:
    """python scripts/<script> args in a child process; its stdout (+ stderr), asserting exit 0."""
    child = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child.update(env, **({"TRITON_INTERPRET": "1"} if interpret else {}))
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args], env=child, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_scripts_are_the_maintained_set():
    """scripts/ holds the maintained tools only (each with a test here or beside its kernels)."""
    assert {p.name for p in SCRIPTS.iterdir() if p.name != "__pycache__"} <= {
        "demo.py",
        "bench_decode.py",
        "bench_int8.py",
        "bench_kernels.py",
        "bench_compile.py",
        "tune_kernels.py",
        "tune_gemv.py",
        "ncu_kernels.py",
        "timing.py",
        "gen_docs.py",
        "bench_serving.py",
        "bench_engine.py",
        "bench_moe.py",
        "soak_serve.py",
        "bench_fp8.py",
        "bench_int4.py",
        "bench_encoders.py",
        "bench_cold_start.py",
        "bench_offload.py",
    }


def test_bench_fp8_gemm_smoke(tmp_path):
    """The fp8 linear benchmark's loop on the CPU (dsc::linear_fp8's reference; no cuBLASLt):
    every row measured and checked against the reference."""
    run("bench_fp8.py", "gemm", "--smoke", "--m", "1,5", OUT=str(tmp_path))
    rows = json.loads((tmp_path / "bench_fp8_gemm.json").read_text())
    assert [r["M"] for r in rows] == [1, 5] and all(r["rel_err_vs_reference"] < 1e-2 and r["fp8_ms"] > 0 for r in rows)


def test_bench_int4_gemm_smoke(tmp_path):
    """The int4 benchmark's sweep in the interpreter: every config checked (SQNR >= 40 dB) before it is timed."""
    out = run("bench_int4.py", "gemm", "--smoke", interpret=True, OUT=str(tmp_path))
    rows = json.loads((tmp_path / "bench_int4_gemm.json").read_text())
    assert "WRONG" not in out and {r["M"] for r in rows} == {1, 5, 40} and all(r["sqnr_db"] >= 40 for r in rows)


def test_bench_cold_start_on_the_cpu(compile_artifact, tmp_path):
    """The cold-start benchmark's two `dsc serve` runs (untrusted binaries: JIT; --trust-kernels),
    on the CPU, where neither path compiles a kernel: both answer the same text."""
    art = compile_artifact("llama-tiny", ckpt_kwargs={"dtype": "bfloat16"}, targets=("sm_90",))
    run(
        "bench_cold_start.py",
        "--artifact",
        str(art),
        "--device",
        "cpu",
        "--kv-cache-memory",
        "0.05",
        "--work",
        str(tmp_path),
        OUT=str(tmp_path),
    )
    res = json.loads((tmp_path / "bench_cold_start.json").read_text())
    assert res["texts_equal"] and res["kernel_binaries"]["binaries"] > 0
    assert res["jit"]["ready_s"] > 0 and res["binaries"]["first_answer_s"] >= res["binaries"]["ready_s"]


def test_bench_encoders_on_the_cpu(tmp_path):
    """dsc's encode against transformers (eager) on a random BERT in fp32: the same states."""
    run(
        "bench_encoders.py",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--cases",
        "bert-odd:16:3",
        "--no-compile",
        "--iters",
        "2",
        "--work",
        str(tmp_path / "work"),
        OUT=str(tmp_path),
    )
    (row,) = json.loads((tmp_path / "bench_encoders.json").read_text())
    assert row["batch"] == 3 and row["max_abs_diff"] <= 1e-4 * max(1.0, row["max_abs_ref"]) and row["dsc_ms"] > 0
    assert row["graph_vs_eager_max_abs_diff"] == 0


# -- bench_engine.py --------------------------------------------------------------------------------
def test_bench_engine_dry_run_on_the_cpu(tmp_path):
    """Each part in its own process (batch 1 and HTTP are the GPU run's): the budget sweep
    (async and sync give every request its tokens), the load stages; the table and the JSON."""
    out = run(
        "bench_engine.py",
        "all",
        "--shape",
        "llama-tiny",
        "--device",
        "cpu",
        "--requests",
        "6",
        "--prompt-lens",
        "8,40",
        "--output-lens",
        "2,6",
        "--budgets",
        "16,64",
        "--sync-budget",
        "16",
        "--parts",
        "offline,load",
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
    )
    res = json.loads((tmp_path / "out" / "bench_engine.json").read_text())
    runs = res["offline"]["runs"]
    assert set(runs) == {"budget 16", "budget 64", "budget 16, sync"} and res["offline"]["flops"] > 0
    assert all(sum(k["steps"] for k in r["by_step_kind"].values()) == r["steps"] for r in runs.values())
    assert {"weights", "programs", "total"} <= set(res["load"]["stages"])
    assert "| dsc.LLM engine, budget 64 |" in out


# -- timing.py ------------------------------------------------------------------------------------
def test_timing_medians_on_the_cpu():
    import timing

    calls = []
    assert timing.median_s(lambda: calls.append(1), rounds=5, warmup=2) >= 0 and len(calls) == 7
    assert timing.bench_ms(lambda: sum(range(1000))) > 0


def test_checkout_modules_loads_kernels_without_the_package_init():
    """A bare `dsc` over this checkout: the kernel module imports, dsc/__init__ and the compiler do not."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from timing import checkout_modules, ROOT\n"
        "norm, = checkout_modules('kernels.norm')\n"
        "assert norm.__file__ == str(ROOT / 'kernels' / 'norm.py'), norm.__file__\n"
        "assert not hasattr(sys.modules['dsc'], 'compile') and 'dsc.compiler' not in sys.modules\n"
        "assert 'transformers' not in sys.modules\n"
        "print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(SCRIPTS)], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# -- bench_decode.py --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_work(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-decode")


def test_bench_decode_dry_run_and_table(bench_work):
    """The ordinary run on the CPU: checkpoint, artifact, `dsc bench`'s numbers, the JSON, the table."""
    import bench_decode

    out = bench_work / "out"
    rc = bench_decode.main(
        [
            "--shape",
            "llama-tiny",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--hf",
            "none",
            "--batches",
            "1,2",
            "--prefill",
            "16",
            "--work",
            str(bench_work),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads((out / "bench_llama-tiny-float32.json").read_text())
    assert set(res["dsc"]["decode"]) == {"1", "2"} and res["dsc"]["decode"]["1"]["ms_per_step_queued"] > 0
    assert "16" in res["dsc"]["prefill"]
    table = bench_decode.summary(res, "llama-tiny-float32")
    assert "== llama-tiny-float32 on cpu ==" in table and "prefill 16: dsc" in table


def test_bench_decode_baseline_runs_both_checkouts_on_one_artifact(bench_work, tmp_path):
    """--baseline: each side's `dsc bench` in its own process, importing its own checkout (the
    baseline here: a copy of this checkout's package folders), on the same artifact."""
    import shutil

    base = tmp_path / "base"
    root = SCRIPTS.parent
    shutil.copytree(
        root, base, ignore=shutil.ignore_patterns(".git", ".venv", "build", "tests", ".base", "__pycache__")
    )
    out = run(
        "bench_decode.py",
        "--shape",
        "llama-tiny",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--batches",
        "1",
        "--work",
        str(bench_work),
        "--out",
        str(tmp_path / "out"),
        "--baseline",
        str(base),
        "--rounds",
        "1",
    )
    assert f"base: dsc from {base.resolve() / '__init__.py'}" in out  # the baseline imports its own copy
    assert f"this: dsc from {root / '__init__.py'}" in out
    ab = json.loads((tmp_path / "out" / "ab_llama-tiny-float32.json").read_text())
    assert ab["artifacts"]["this"] == ab["artifacts"]["base"]
    row = ab["table"]["1"]
    assert len(ab["runs"]["this"]) == len(ab["runs"]["base"]) == 1
    assert row["this_ms"] > 0 and row["this_over_base"] == pytest.approx(row["this_ms"] / row["base_ms"])
    assert "this/base" in out


def test_bench_decode_baseline_must_be_a_checkout(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_decode.py"), "--baseline", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == f"error: --baseline: {tmp_path} holds no dsc checkout (no runtime/bench.py)"
    )


def test_bench_decode_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_decode

    res = {
        "shape": "llama-tiny",
        "dtype": "float32",
        "dsc": {
            "decode": {"1": {"ms_per_step": 2.0, "tokens_per_s": 500}, "8": {"ms_per_step": 3.0, "tokens_per_s": 2666}}
        },
    }
    (tmp_path / "r.json").write_text(json.dumps(res))
    assert bench_decode.main(["--plot", str(tmp_path / "r.json"), "-o", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 0


# -- bench_kernels.py, tune_kernels.py, ncu_kernels.py ------------------------------------------------
@pytest.mark.parametrize("section", ["fused", "attention"])
def test_bench_kernels_sections_smoke(section, tmp_path):
    run("bench_kernels.py", section, "--smoke", interpret=True, OUT=str(tmp_path))
    written = {"fused": "bench_kernels.json", "attention": "bench_attention.json"}[section]
    res = json.loads((tmp_path / written).read_text())
    rows = res["results"] if section == "fused" else res["prefill"] + res["decode"]
    assert rows and all(r.get("fused_ms", r.get("dsc_ms")) for r in rows)


def test_bench_kernels_paged_smoke(tmp_path):
    """The paged section: the paged decode kernel and the static one on the same data, timed; their
    outputs agree."""
    out = run("bench_kernels.py", "paged", "--smoke", interpret=True, OUT=str(tmp_path))
    rows = json.loads((tmp_path / "bench_paged.json").read_text())["rows"]
    assert rows and all(r["static_us"] > 0 and r["paged_us"] > 0 and r["max_abs_diff"] < 1e-3 for r in rows)
    assert "paged/static" in out


def test_bench_kernels_unknown_section():
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_kernels.py"), "nope"], capture_output=True, text=True, timeout=300
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == "error: section: 'nope' is not one of fused, attention, fused-decode, paged"
    )


def test_tune_kernels_smoke_writes_a_table(tmp_path):
    """Three candidates of two kernels in the interpreter; the table goes to --out, not kernels/,
    keeping the rows it did not tune."""
    run(
        "tune_kernels.py",
        "--smoke",
        "--dtype",
        "float16",
        "--only",
        "add_rmsnorm,gelu",
        "--out",
        str(tmp_path / "tuning.json"),
        interpret=True,
    )
    table = json.loads((tmp_path / "tuning.json").read_text())
    log = json.loads((tmp_path / "tune_kernels_log.json").read_text())
    picked = [r for r in log["candidates"] if r["picked"]]
    assert {r["kernel"] for r in picked} == {"add_rmsnorm", "gelu"}
    assert all(table["default"][r["kernel"]][r["class"]] == r["config"] for r in picked)
    shipped = json.loads((SCRIPTS.parent / "kernels" / "tuning.json").read_text())
    assert table["sm_90"] == shipped["sm_90"]


def test_ncu_kernels_int8_runner_smoke():
    out = run("ncu_kernels.py", "int8", "--m", "2", "--k", "64", "--n", "32", "--smoke", interpret=True)
    assert "int8: 32 outputs per row" in out


# -- bench_compile.py, demo.py ------------------------------------------------------------------------
def test_bench_compile_sizes_from_headers_and_config(make_checkpoint):
    """The disk estimate (from the shape's config) and the largest tensor (from the safetensors
    headers, no torch) against a written checkpoint."""
    import bench_compile

    ckpt = make_checkpoint("llama-tiny", dtype="float32")
    on_disk = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    estimate = bench_compile.checkpoint_bytes("llama-tiny", 4)
    assert 0.95 * on_disk <= estimate <= on_disk
    from safetensors import safe_open

    with safe_open(str(next(ckpt.glob("*.safetensors"))), "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    name, nbytes = bench_compile.largest_tensor(ckpt)
    assert nbytes == 4 * math.prod(sizes[name]) == 4 * max(math.prod(shape) for shape in sizes.values())


def test_bench_compile_refuses_a_full_disk(tmp_path, monkeypatch):
    import shutil

    import bench_compile

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 0))
    with pytest.raises(SystemExit, match=r"error: --dir: .* has 0.0 GB free, llama-tiny needs"):
        bench_compile.bench("llama-tiny", "bf16", [1], tmp_path, keep=False)


def test_demo_runs_the_whole_loop(smollm2):
    """`make demo`'s script on the session's SmolLM2 artifact (its compile is conftest's, from
    the same GGUF file): a chat answer, and the same tokens as transformers."""
    out = run("demo.py", "--artifact", str(smollm2[1]))
    assert "Paris" in out and "check against transformers: the same" in out


# -- soak_serve.py ----------------------------------------------------------------------------------
def test_soak_serve_short_run(compile_artifact, tmp_path):
    pytest.importorskip("fastapi")
    art = compile_artifact("llama-tiny", dtype="fp32")
    out = run(
        "soak_serve.py",
        str(art),
        "--seconds",
        "6",
        "--window",
        "2",
        "--rate",
        "4",
        "--prompt-len",
        "4:30",
        "--output-len",
        "4:8",
        "--json",
        str(tmp_path / "soak.json"),
    )
    res = json.loads((tmp_path / "soak.json").read_text())
    assert len(res["samples"]) == 3 and res["problems"] == []
    assert all(s["kv_blocks_used_idle"] == 0 and s["failed"] == 0 and s["completed"] == 8 for s in res["samples"])
    assert all(s["rss_mib"] > 50 for s in res["samples"])  # the server's (torch-sized) process, not the script's
    assert out.rstrip().endswith("ok")


def test_bench_offload_runs_one_engine_on_the_cpu(compile_artifact, tmp_path):
    """The offload benchmark's engine run, every layer streamed from the rank file, on the CPU:
    each step moves every streamed layer once, and the tokens equal the resident engine's."""
    from dsc.runtime.llm import LLMEngine, SamplingParams

    art = compile_artifact("llama-tiny", ckpt_kwargs={"num_hidden_layers": 6}, dtype="fp32")
    run(
        "bench_offload.py",
        "run",
        "--artifact",
        str(art),
        "--mode",
        "disk",
        "--device",
        "cpu",
        "--batches",
        "1,3",
        "--json",
        str(tmp_path / "disk.json"),
    )
    disk = json.loads((tmp_path / "disk.json").read_text())
    assert disk["offload"]["streamed_layers"] == 6
    for b in ("1", "3"):
        assert disk["batches"][b]["bytes_moved_per_step"] == disk["offload"]["bytes_per_step"]
    # the first prompt of batch 1, as the script makes it, on the resident engine
    import torch

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (64,), generator=g).tolist()
    eng = LLMEngine(str(art), device="cpu")
    eng.add_request("0", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    want = None
    while eng.has_unfinished_requests():
        want = next((o.outputs[0].token_ids for o in eng.step() if o.finished), want)
    assert disk["batches"]["1"]["first_tokens"] == want
