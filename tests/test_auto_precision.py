"""--auto-precision DB (passes/auto_precision.py): int4, int8 (W8A16) or 16-bit per linear,
the cheapest meeting DB of logits SQNR on the quantization report's inputs.

Checked: the compiled artifact's own report (the quantized program against its unquantized
twin, compiler/int8_report.py) meets the target and equals the selection's last measurement;
the rank files hold each layer in the scheme the plan's notes name; a low target is all int4,
an unreachable one all 16-bit; tp 2 makes tp 1's choice and its logits; SmolLM2-135M (real
weights) meets 25 dB.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from test_int4 import INT4_CKPT, PROMPTS

import dsc

DTYPE_OF = {"int4": "U8", "int8": "I8"}


def header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


def report(art) -> dict:
    return json.loads((Path(art) / "manifest.json").read_text())["int8_report"]


def layers(art) -> dict[str, str]:
    return json.loads((Path(art) / "plan.json").read_text())["notes"]["auto_precision"]["layers"]


def check_files(art) -> None:
    h = header(Path(art) / "rank0.safetensors")
    for layer, scheme in layers(art).items():
        w = f"{layer}.weight"
        if scheme == "16-bit":
            assert w in h and f"{w}.qweight" not in h, layer
        else:
            assert w not in h and h[f"{w}.qweight"]["dtype"] == DTYPE_OF[scheme], layer


def test_target_is_met_with_the_measured_choice(compile_artifact):
    art = compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="fp32", auto_precision=30.0)
    rep = report(art)
    assert rep["mode"] == "auto" and rep["logits"]["sqnr_db"] >= 30, rep["logits"]
    rounds = rep["auto_precision"]["rounds"]
    assert rounds[0]["counts"]["int4"] == len(layers(art))  # every layer starts at the cheapest rung
    assert rep["logits"]["sqnr_db"] == pytest.approx(rounds[-1]["sqnr_db"], abs=0.05)  # what the artifact runs
    assert all(r["sqnr_db"] < 30 for r in rounds[:-1])
    check_files(art)


@pytest.mark.parametrize("db,scheme", [(3.0, "int4"), (500.0, "16-bit")])
def test_extreme_targets(db, scheme, compile_artifact):
    art = compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="fp32", auto_precision=db)
    assert set(layers(art).values()) == {scheme}
    assert report(art)["logits"]["sqnr_db"] >= db
    check_files(art)


def test_tp2_makes_the_tp1_choice(compile_artifact):
    from test_int8 import position_logits, simulate_artifact

    one = compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="fp32", auto_precision=30.0)
    two = compile_artifact("llama-tiny", ckpt_kwargs=INT4_CKPT, dtype="fp32", auto_precision=30.0, tp=2)
    assert layers(one) == layers(two)
    a, b = position_logits(one, PROMPTS, 6), simulate_artifact(two, PROMPTS)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_options_are_exclusive(make_checkpoint, tmp_path):
    from dsc.errors import UserError

    ck = str(make_checkpoint("llama-tiny", **INT4_CKPT))
    for bad in ({"int8": True}, {"int4": True}, {"fp8": True}, {"int8_mode": "w8a8"}):
        with pytest.raises(UserError):
            dsc.compile(ck, tmp_path / "x", auto_precision=30.0, **bad)
    with pytest.raises(UserError, match="auto_precision"):
        dsc.compile(ck, tmp_path / "x", auto_precision=-1.0)
    assert not (tmp_path / "x").exists()


def test_real_weights(smollm2, tmp_path):
    gguf, _ = smollm2
    art = dsc.compile(str(gguf), tmp_path / "auto", dtype="fp32", max_seq=256, auto_precision=25.0)
    rep = report(art)
    assert rep["inputs"]["source"] == "sample text" and rep["logits"]["sqnr_db"] >= 25, rep["logits"]
    counts = rep["auto_precision"]["rounds"][-1]["counts"]
    assert counts["int4"] + counts["int8"] > counts["16-bit"], counts  # most layers quantized
    check_files(art)
