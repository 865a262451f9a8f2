"""Weights that do not fit the device at load: one line with the bytes needed and free, pointing
at --tp, --int8 and the CPU, checked before the copy and caught during it (CPU tests, with the
device's free memory and the copy faked)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import dsc
from dsc.errors import UserError
from dsc.runtime import engine as engine_mod


def _weight_bytes(rank_file) -> int:
    with open(rank_file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return rank_file.stat().st_size - 8 - n


def _assert_points_the_way(msg: str, need: int, free: int) -> None:
    assert f"({need} bytes)" in msg and f"({free} bytes) free" in msg and "\n" not in msg
    assert all(s in msg for s in ("--tp N", "--int8", "--device cpu", "rank0.safetensors"))


def test_free_bytes_come_from_mem_get_info_on_cuda(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (seen.append(d), (123, 456))[1])
    assert engine_mod.free_device_bytes(torch.device("cuda", 1)) == 123 and seen == [torch.device("cuda", 1)]
    assert engine_mod.free_device_bytes(torch.device("cpu")) is None


def test_weights_larger_than_the_free_memory_stop_the_load_before_the_copy(compile_artifact, monkeypatch):
    art = compile_artifact("llama-tiny", dtype="fp32")
    need = _weight_bytes(art / "rank0.safetensors")
    monkeypatch.setattr(engine_mod, "free_device_bytes", lambda device: need - 1)
    copies = []
    real_open = engine_mod.safe_open
    monkeypatch.setattr(engine_mod, "safe_open", lambda *a, **k: copies.append(a) or real_open(*a, **k))
    with pytest.raises(UserError) as e:
        dsc.load(art, device="cpu")
    _assert_points_the_way(str(e.value), need, need - 1)
    assert copies == []  # nothing was copied
    monkeypatch.setattr(engine_mod, "free_device_bytes", lambda device: need)  # exactly enough
    assert dsc.load(art, device="cpu", cuda_graphs=False).weights


class _OOMAfter:
    """safe_open whose get_tensor runs out of device memory at the n-th tensor."""

    def __init__(self, real, n):
        self.real, self.n = real, n

    def __call__(self, *a, **k):
        outer = self

        class F:
            def __enter__(self):
                self.f = outer.real(*a, **k).__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def get_tensor(self, name):
                outer.n -= 1
                if outer.n == 0:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
                return self.f.get_tensor(name)

        return F()


def test_running_out_of_memory_during_the_copy_is_the_same_line(compile_artifact, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from dsc.cli import app

    art = compile_artifact("llama-tiny", dtype="fp32")
    need = _weight_bytes(art / "rank0.safetensors")
    free = iter([need * 10, 4096])  # enough at the check, 4096 bytes left when the copy fails
    monkeypatch.setattr(engine_mod, "free_device_bytes", lambda device: next(free))
    monkeypatch.setattr(engine_mod, "safe_open", _OOMAfter(engine_mod.safe_open, 3))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)  # no CUDA here
    r = CliRunner().invoke(app, ["generate", str(art), "--token-ids", "1,2,3", "--device", "cpu"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    _assert_points_the_way(lines[0], need, 4096)
    assert json.loads((art / "manifest.json").read_text())  # the artifact is untouched
