"""kernels/launch.py: when kernels launch with programmatic dependent launch (PDL). What each
kernel does under PDL is checked in its compiled sm_90 code (the kernel test files' aot modes,
tests/kernel_child.py `pdl_check`); on a GPU by scripts/check_pdl_gpu.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsc import switches
from dsc.errors import UserError
from dsc.kernels import launch

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def set_switch(monkeypatch, name: str, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    switches.reload()


@pytest.fixture
def hopper(monkeypatch):
    """Pretend device 0 is a GPU that supports PDL (capability 9.0, a triton with gdc_wait)."""
    monkeypatch.setattr(launch, "_pdl_supported", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    set_switch(monkeypatch, "DSC_PDL", None)


def test_pdl_is_on_only_for_a_capable_gpu_outside_the_interpreter(hopper, monkeypatch):
    assert launch.pdl_enabled(CUDA) and launch.pdl_options(CUDA) == {"PDL": True, "launch_pdl": True}
    assert not launch.pdl_enabled(CPU) and launch.pdl_options(CPU) == {"PDL": False, "launch_pdl": False}
    for value in ("1", "true", "ON"):  # the interpreter cannot run griddepcontrol's inline PTX
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert not launch.pdl_enabled(CUDA)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert launch.pdl_enabled(CUDA)


def test_dsc_pdl_off_turns_it_off_and_is_read_once(hopper, monkeypatch):
    set_switch(monkeypatch, "DSC_PDL", "off")
    assert not launch.pdl_enabled(CUDA)
    monkeypatch.setenv("DSC_PDL", "auto")
    assert not launch.pdl_enabled(CUDA)  # the value read first is kept until a reload (dsc.load's)
    switches.reload()
    assert launch.pdl_enabled(CUDA)


def test_auto_keeps_pdl_on_at_every_tp(hopper, monkeypatch):
    """auto is on in tensor-parallel processes too."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for world in (1, 2, 4, 8):
        monkeypatch.setattr(dist, "get_world_size", lambda group=None, world=world: world)
        set_switch(monkeypatch, "DSC_PDL", "auto")
        assert launch.pdl_enabled(CUDA) and launch.pdl_options(CUDA)["launch_pdl"]
        set_switch(monkeypatch, "DSC_PDL", "off")
        assert not launch.pdl_enabled(CUDA)


@pytest.mark.parametrize("value", ["on", "yes", "bogus", ""])
def test_bad_dsc_pdl_is_a_clear_error_on_every_device(value, monkeypatch):
    set_switch(monkeypatch, "DSC_PDL", value)
    for dev in (CPU, CUDA):
        with pytest.raises(UserError, match=f"^DSC_PDL: must be one of auto, off, got {value!r}$"):
            launch.pdl_enabled(dev)


@pytest.mark.parametrize("capability, want", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_pdl_needs_hopper_or_newer(capability, want, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    launch._pdl_supported.cache_clear()
    try:
        assert launch._pdl_supported(0) is want
    finally:
        launch._pdl_supported.cache_clear()


def test_dsc_tuning_replaces_the_rows_it_names(tmp_path, monkeypatch):
    """DSC_TUNING=PATH: its rows replace the shipped table's (others stay), and the GEMV push
    config a launch takes follows it; an unreadable or misshapen file is a clear error."""
    from dsc.kernels.collectives import gemv_push_config

    set_switch(monkeypatch, "DSC_TUNING", None)
    shipped = launch.tuning_table()
    row = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 8}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"sm_90": {"gemv_push": {"N4096_K7168": row}, "new_kernel": {"D8": {"x": 1}}}}))
    set_switch(monkeypatch, "DSC_TUNING", str(path))
    table = launch.tuning_table()
    assert table["sm_90"]["gemv_push"]["N4096_K7168"] == row and table["sm_90"]["new_kernel"] == {"D8": {"x": 1}}
    assert table["sm_90"]["gemv_push"]["N4096_K1024"] == shipped["sm_90"]["gemv_push"]["N4096_K1024"]
    assert table["sm_90"]["gemv"] == shipped["sm_90"]["gemv"]
    assert {k: gemv_push_config(4096, 7168, "sm_90")[k] for k in row} == row
    set_switch(monkeypatch, "DSC_TUNING", None)
    assert launch.tuning_table() == shipped and "new_kernel" not in shipped["sm_90"]
    for bad, text in ((tmp_path / "missing.json", None), (tmp_path / "bad.json", "{"),
                      (tmp_path / "shape.json", '{"sm_90": {"gemv": [1]}}')):
        if text is not None:
            bad.write_text(text)
        set_switch(monkeypatch, "DSC_TUNING", str(bad))
        with pytest.raises(UserError, match=f"^DSC_TUNING: .*{bad.name}"):
            launch.tuning_table()


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "scripts" / "tuning").glob("*.json")))
def test_shipped_tuning_variants_name_rows_the_table_has(name, monkeypatch):
    """scripts/tuning/*.json (DSC_TUNING files for A/B benches): each loads, names only rows the
    shipped table has (a typo'd shape class would bench the table against itself; a
    `w8a16_gemv_push` row a shape of its `w8a16_gemv` rows, which every W8A16 GEMV push config
    starts from), sets only config keys, and changes the config the launch takes."""
    from dsc.kernels.collectives import gemv_push_config, w8a16_push_config
    from dsc.kernels.linear import CONFIG_KEYS

    def config(kernel, shape, arch):  # the config a launch takes for a row's shape
        if kernel == "w8a16_gemv_push":
            return w8a16_push_config(*map(int, shape[len("M1_N"):].split("_K")), 0, arch)
        return gemv_push_config(*map(int, shape[1:].split("_K")), arch) if kernel == "gemv_push" else None

    path = Path(__file__).resolve().parents[1] / "scripts" / "tuning" / name
    set_switch(monkeypatch, "DSC_TUNING", None)
    shipped = launch.tuning_table()
    variant = json.loads(path.read_text())
    rows = [(arch, kernel, shape, row) for arch, kernels in variant.items() if not arch.startswith("_")
            for kernel, shapes in kernels.items() for shape, row in shapes.items()]
    assert rows
    before = {(arch, kernel, shape): config(kernel, shape, arch) for arch, kernel, shape, _ in rows}
    set_switch(monkeypatch, "DSC_TUNING", str(path))
    for arch, kernel, shape, row in rows:
        table = shipped[arch]["w8a16_gemv" if kernel == "w8a16_gemv_push" else kernel]
        assert shape in table and set(row) <= set(CONFIG_KEYS), (kernel, shape, row)
        got = config(kernel, shape, arch)
        if got is not None:
            assert {key: got[key] for key in row} == row and got != before[(arch, kernel, shape)]


def test_check_pdl_gpu_script_runs_its_code_path(tmp_path):
    """scripts/check_pdl_gpu.py --smoke in the interpreter: every chain at tiny shapes, eager
    only (the GPU run adds CUDA graphs and timings), bit-identical with DSC_PDL off and auto."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "check_pdl_gpu.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script), "--smoke"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "check_pdl_gpu.json").read_text())
    assert len(res["results"]) == 8 and not res["failed"] and res["pdl_on_with_auto"] is False


def test_boundary_and_attention_phase_scripts_build_for_sm90(tmp_path):
    """scripts/bench_boundary.py's three kernels and scripts/attention_phases.py's stamped copy
    of the decode attention (made from kernels/attention.py's source: the script fails if the
    lines it stamps change) build for sm_90; the stamped kernel reads %globaltimer 7 times, once
    per stamp, with PDL's wait and launch in it (GPU-only scripts: no other CPU path)."""
    root = Path(__file__).resolve().parents[1]
    child = f'''
import sys
sys.path.insert(0, {str(root / "scripts")!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import attention_phases, bench_boundary

def build(fn, sig, consts, warps, stages=None):
    sig = {{**sig, **{{k: "constexpr" for k in consts}}}}
    opts = {{"num_warps": warps, **({{"num_stages": stages}} if stages else {{}})}}
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=opts)

for mode in (0, 1, 2):
    ptx = build(bench_boundary._link, {{"X": "*i32", "FLAGS": "*i32", "EPOCH": "*i32", "i": "i32"}}, {{"MODE": mode}},
                4).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == (mode != 0), mode
attention_phases.load_kernels()
A = attention_phases.stamped_attention()
A._triton()
fn, dec = A._decode_kernel, A.DECODE_CONFIGS[("sm_90", 128)]
consts = dict(G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, SPLIT=True, BLOCK_N=dec["BLOCK_N"], WINDOWED=False,
              ROTARY=True, ROT_TABLE=True, PRE_N=dec["PRE_N"], PDL=True)
ptrs = {{n: "*bf16" for n in ("Q", "K", "V", "KC", "VC", "OUT", "COS", "SIN")}}
ptrs.update(POS="*i64", RPOS="*i64", PART_O="*fp32", PART_LSE="*fp32", LOCK="*i32")
sig = {{n: ptrs.get(n, "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names if n not in consts}}
ptx = build(fn, sig, consts, dec["num_warps"], dec["num_stages"]).asm["ptx"]
assert ptx.count("%globaltimer") == 7 and "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
print("ok")
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
