"""`dsc compile --target`: the plan's Triton kernels built into the artifact on this CPU box, and
what the runtime accepts of them (kernels/binaries.py, compiler/kernel_binaries.py,
runtime/binaries.py). Their launches on a GPU: tests/gpu/test_gpu_binaries.py."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from artifact_edits import copy_artifact, read_json, rehash, write_json

from dsc.errors import UserError
from dsc.kernels import binaries as B

EM_CUDA = 190
# kernels each family's plan launches on an sm_90 GPU at the serving shapes (ragged program) and
# in the static decode program
EXPECTED = {
    "llama-tiny": {
        "_rmsnorm_kernel",
        "_rotary_kernel",
        "_swiglu_kernel",
        "_paged_decode_kernel",
        "_paged_prefill_kernel",
        "_decode_kernel",
    },
    "gpt2-tiny": {"_layernorm_kernel", "_gelu_kernel", "_paged_decode_kernel", "_paged_prefill_kernel"},
    "bert-odd": {"_layernorm_kernel", "_gelu_kernel"},  # the encode program at its (batch, length) buckets
    "mixtral-odd": {
        "_rmsnorm_kernel",
        "_route_kernel",
        "_gate_up_kernel",
        "_down_kernel",
        "_combine_kernel",
        "_paged_decode_kernel",
        "_paged_prefill_kernel",
    },
}


def _elf_machine(data: bytes) -> int:
    assert data[:4] == b"\x7fELF"
    return struct.unpack_from("<H", data, 18)[0]


@pytest.fixture(scope="module")
def binaries_artifacts(compile_artifact):
    return {
        shape: Path(compile_artifact(shape, ckpt_kwargs={"dtype": "bfloat16"}, targets=("sm_90",)))
        for shape in EXPECTED
    }


@pytest.mark.parametrize("shape", sorted(EXPECTED))
def test_target_writes_a_binary_for_every_kernel_launch(binaries_artifacts, shape):
    art = binaries_artifacts[shape]
    manifest = read_json(art / "manifest.json")
    index = read_json(art / "kernels" / "binaries.json")
    summary = manifest["kernel_binaries"]
    assert summary["skipped"] == {} and summary["targets"] == ["sm_90"]
    assert summary["binaries"] == len(index["binaries"]) > 0
    kernels = {e["spec"]["kernel"].split(":")[-1] for e in index["binaries"]}
    assert EXPECTED[shape] <= kernels, EXPECTED[shape] - kernels
    files = {p.relative_to(art).as_posix() for p in (art / "kernels").iterdir()}
    assert files == {e["file"] for e in index["binaries"]} | {"kernels/binaries.json"}
    assert len({e["file"] for e in index["binaries"]}) == len(index["binaries"])
    for e in index["binaries"]:
        data = (art / e["file"]).read_bytes()
        assert _elf_machine(data) == EM_CUDA
        assert manifest["files"][e["file"]] == hashlib.sha256(data).hexdigest()
        runtime_args = sum(a[1] != "constexpr" for a in e["spec"]["args"])
        assert len(e["params"]) >= runtime_args and set(e["params"][runtime_args:]) <= {"u64"}
    # every spec the runtime's shapes give is there: recording again finds nothing new
    from dsc.compiler.kernel_binaries import record

    specs, skipped = record(read_json(art / "plan.json"), "sm_90")
    assert skipped == {} and {s.digest() for s in specs} == {
        B.Spec.from_json(e["spec"]).digest() for e in index["binaries"]
    }


def test_the_binaries_change_nothing_else(binaries_artifacts, compile_artifact):
    """Plan and rank files are those of the same compile without --target."""
    art = binaries_artifacts["gpt2-tiny"]
    plain = Path(compile_artifact("gpt2-tiny", ckpt_kwargs={"dtype": "bfloat16"}))
    a, b = read_json(art / "manifest.json")["files"], read_json(plain / "manifest.json")["files"]
    assert {k: v for k, v in a.items() if not k.startswith("kernels/")} == b


def test_a_recompile_is_byte_identical(binaries_artifacts, make_checkpoint, tmp_path):
    import dsc

    ckpt = make_checkpoint("gpt2-tiny", dtype="bfloat16")
    again = Path(dsc.compile(str(ckpt), tmp_path / "again", targets=("sm_90",)))
    first = binaries_artifacts["gpt2-tiny"]
    for p in sorted((first / "kernels").iterdir()):
        assert (again / "kernels" / p.name).read_bytes() == p.read_bytes(), p.name
    assert read_json(again / "manifest.json")["files"] == read_json(first / "manifest.json")["files"]


_BUILD_TWICE = """
import hashlib, json, sys
from dsc.compiler.kernel_binaries import build, record
plan = json.load(open(sys.argv[1]))
specs, _ = record(plan, "sm_90")
print(json.dumps([hashlib.sha256(build(s, "sm_90")["cubin"]).hexdigest() for s in specs[:3]]))
"""


def test_triton_builds_the_same_cubin_from_an_empty_cache(binaries_artifacts, tmp_path):
    """ptxas and Triton run again from scratch (a fresh TRITON_CACHE_DIR per run): the same bytes."""
    plan = binaries_artifacts["llama-tiny"] / "plan.json"
    runs = []
    for i in range(2):
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / f"cache{i}")}
        out = subprocess.run(
            [sys.executable, "-c", _BUILD_TWICE, str(plan)], env=env, capture_output=True, text=True, check=True
        ).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_a_launch_spec_is_the_same_from_real_and_meta_tensors():
    """What the compile records from meta tensors is what a launch computes from real ones:
    dtypes, 16-byte alignment (a view's offset), integers equal to 1 or multiples of 16."""
    from dsc.kernels import norm
    from dsc.kernels.launch import jit

    k = jit(norm._rmsnorm_kernel)

    def spec(device, offset, stride):
        x = torch.empty(64 + 8, dtype=torch.bfloat16, device=device)[offset : offset + 64]
        w = torch.empty(64, dtype=torch.bfloat16, device=device)
        return k.spec(
            (x, x, w, x, x, stride, 64, 64, 64, 64, 1e-5),
            {"HAS_RESIDUAL": True, "BLOCK_N": 64, "num_warps": 4, "PDL": False, "launch_pdl": False},
        )[0]

    for offset, stride in ((0, 1), (8, 32), (3, 17)):
        assert spec("cpu", offset, stride) == spec("meta", offset, stride)
    args = {a[0]: a[1:] for a in spec("meta", 3, 17).args}
    assert args["X"] == ("*bf16", False) and args["W"] == ("*bf16", True) and args["eps"] == ("fp32", False)
    assert args["stride_x"] == ("i32", False) and args["stride_r"] == ("i32", True)
    assert dict(spec("meta", 0, 1).constants)["stride_x"] == 1  # an integer 1 is a constant
    assert spec("meta", 0, 32) != spec("meta", 0, 33)


def test_binary_parameters_are_packed_as_their_ptx_types():
    spec = B.Spec(
        "dsc.kernels.norm:k",
        "triton",
        "0" * 64,
        (("X", "*fp16", True), ("n", "i32", False), ("eps", "fp32", False), ("f", "u1", False)),
        (),
        (),
    )
    b = B.Binary(spec, b"", "k", 4, 0, ["u64", "u32", "f32", "u8", "u64"])
    t = torch.empty(4, dtype=torch.float16)
    s = b._struct
    for i, v in enumerate([t, -5, 1.5, True]):
        setattr(
            s,
            f"p{i}",
            v.data_ptr()
            if isinstance(v, torch.Tensor)
            else (v if isinstance(v, float) else int(v) & B._MASKS[b._sizes[i]]),
        )
    assert (s.p0, s.p1, s.p2, s.p3) == (t.data_ptr(), 2**32 - 5, 1.5, 1)
    ptrs = [b._ptrs[i] for i in range(5)]
    assert ptrs == [ctypes.addressof(s) + getattr(type(s), f"p{i}").offset for i in range(5)]


def test_ptx_parameters_are_read_from_the_entry():
    ptx = (
        ".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
        "\t.param .f32 k_param_2,\n\t.param .u64 .ptr .global .align 1 k_param_3\n)\n{\n\tret;\n}\n"
    )
    assert B.ptx_params(ptx, "k") == ["u64", "u32", "f32", "u64"]
    with pytest.raises(ValueError):
        B.ptx_params(ptx, "other")


# -- what the runtime accepts -------------------------------------------------------------------
def _open(art: Path):
    from dsc.runtime.artifact import open_artifact

    return open_artifact(art, ranks=[0], verify=False)


def test_binaries_are_read_for_their_arch_only(binaries_artifacts):
    from dsc.runtime.binaries import read_binaries

    art = _open(binaries_artifacts["llama-tiny"])
    got = read_binaries(art, "sm_90")
    assert len(got) == read_json(art.path / "manifest.json")["kernel_binaries"]["binaries"]
    assert read_binaries(art, "sm_80") == []


def test_a_tampered_binary_fails_its_checksum(binaries_artifacts, tmp_path):
    from dsc.runtime.artifact import open_artifact
    from dsc.runtime.binaries import read_binaries

    art = copy_artifact(binaries_artifacts["llama-tiny"], tmp_path / "art")
    cubin = next((art / "kernels").glob("*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        read_binaries(_open(art), "sm_90")  # the manifest's sha256, even when the artifact is opened unverified
    (art / "kernels" / "extra.cubin").write_bytes(b"\x7fELF")
    with pytest.raises(UserError, match="not listed in manifest.json"):
        open_artifact(art, ranks=[0])


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda e: e.update(file="rank0.safetensors"), "'file'"),
        (lambda e: e.update(entry="k; rm -rf"), "'entry'"),
        (lambda e: e.update(num_warps=0), "'num_warps'"),
        (lambda e: e.update(params=["u64", "s128"]), "'params'"),
        (lambda e: e["spec"].update(kernel="os:system"), "'spec'"),
        (lambda e: e["spec"]["options"].append(["debug", True]), "'spec'"),
        (lambda e: e.update(params=[]), "'params'"),
    ],
)
def test_a_hand_edited_index_is_one_line_naming_the_field(binaries_artifacts, tmp_path, edit, field):
    from dsc.runtime.binaries import read_binaries

    art = copy_artifact(binaries_artifacts["llama-tiny"], tmp_path / "art")
    index = read_json(art / "kernels" / "binaries.json")
    edit(index["binaries"][0])
    write_json(art / "kernels" / "binaries.json", index)
    rehash(art)
    with pytest.raises(UserError, match=f"binaries\\[0\\]: field {field}") as e:
        read_binaries(_open(art), "sm_90")
    assert "\n" not in str(e.value)


def test_binaries_load_only_when_trusted(binaries_artifacts, monkeypatch, capsys):
    from dsc.runtime import binaries as RB

    installed = []
    monkeypatch.setattr(RB, "arch_of_device", lambda device: "sm_90")
    monkeypatch.setattr(RB.B, "install", lambda bins: installed.extend(bins))
    art = _open(binaries_artifacts["llama-tiny"])
    gpu = torch.device("cuda", 0)
    assert RB.load_binaries(art, gpu, trusted=False)["status"] == "untrusted" and installed == []
    assert "--trust-kernels" in capsys.readouterr().err
    got = RB.load_binaries(art, gpu, trusted=True)
    assert got["status"] == "loaded" and got["binaries"] == len(installed) > 0
    monkeypatch.setattr(RB, "arch_of_device", lambda device: "sm_80")
    assert RB.load_binaries(art, gpu, trusted=True)["status"] == "no binaries for sm_80"
    assert "no kernel binaries for this GPU (sm_80; the artifact has sm_90)" in capsys.readouterr().err
    assert RB.load_binaries(art, torch.device("cpu"), trusted=True)["status"] == "none"


def test_load_trusts_a_verified_signature_or_the_flag(binaries_artifacts, monkeypatch, tmp_path):
    """dsc.load passes trusted=True with require_signature (verified first) or trust_kernels."""
    import dsc.runtime.binaries as RB
    from dsc.runtime.artifact import sign
    from dsc.runtime.engine import load
    from dsc.runtime.signature import keygen

    seen = []
    real = RB.load_binaries
    monkeypatch.setattr(
        RB, "load_binaries", lambda art, device, trusted: seen.append(trusted) or real(art, device, trusted)
    )
    art = copy_artifact(binaries_artifacts["llama-tiny"], tmp_path / "art")
    priv, pub = keygen(tmp_path / "key")
    sign(art, priv)
    for kwargs in ({}, {"trust_kernels": True}, {"require_signature": pub}):
        eng = load(art, device="cpu", **kwargs)
        assert eng.kernel_binaries["status"] == "none"  # on the CPU nothing is installed
    assert seen == [False, True, True]
    other_priv, other_pub = keygen(tmp_path / "other")
    with pytest.raises(UserError, match="signature"):
        load(art, device="cpu", require_signature=other_pub)


def test_inspect_lists_the_binaries(binaries_artifacts):
    from dsc.runtime.inspect import describe

    info = describe(binaries_artifacts["mixtral-odd"])["kernel_binaries"]
    assert list(info["targets"]) == ["sm_90"] and info["targets"]["sm_90"]["bytes"] > 0
    assert EXPECTED["mixtral-odd"] <= set(info["kernels"])
    assert sum(v["sm_90"] for v in info["kernels"].values()) == info["targets"]["sm_90"]["binaries"]


def test_target_errors_write_nothing(tmp_path, make_checkpoint):
    from typer.testing import CliRunner

    from dsc.cli import app

    ckpt = make_checkpoint("llama-tiny")
    res = CliRunner().invoke(app, ["compile", str(ckpt), "-o", str(tmp_path / "out"), "--target", "sm_70"])
    assert res.exit_code == 2 and "--target: unknown GPU arch 'sm_70'" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
