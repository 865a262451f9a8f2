"""kernels/launch.py: when kernels launch with programmatic dependent launch (PDL). What each
kernel does under PDL is checked in its compiled sm_90 code (the kernel test files' aot modes,
tests/kernel_child.py `pdl_check`); on a GPU by tests/gpu/test_gpu_pdl.py."""

from __future__ import annotations

import json

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
    for bad, text in (
        (tmp_path / "missing.json", None),
        (tmp_path / "bad.json", "{"),
        (tmp_path / "shape.json", '{"sm_90": {"gemv": [1]}}'),
    ):
        if text is not None:
            bad.write_text(text)
        set_switch(monkeypatch, "DSC_TUNING", str(bad))
        with pytest.raises(UserError, match=f"^DSC_TUNING: .*{bad.name}"):
            launch.tuning_table()
