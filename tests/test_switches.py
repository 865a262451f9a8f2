"""switches.py: every DSC_* variable declared once, read once, checked with one clear line, and
docs/switches.md generated from the declarations."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsc import switches
from dsc.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bDSC_[A-Z0-9_]+\b")


def _sources(*skip: str) -> list[Path]:
    """The project's Python files: not the folders `skip`, nor hidden or build folders (a
    virtualenv, a baseline checkout in .base/, pip's build/)."""
    return [
        p
        for p in ROOT.rglob("*.py")
        if (top := p.relative_to(ROOT).parts[0]) not in (*skip, "build") and not top.startswith(".")
    ]


def _names_in(paths) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for p in paths:
        for name in NAME.findall(p.read_text()):
            found.setdefault(name, set()).add(str(p.relative_to(ROOT)))
    return found


def test_every_dsc_variable_the_code_and_tests_name_is_declared():
    """The package, its tests and tools, and docs/switches.md name only declared switches (a removed
    switch left in a test or a docstring shows here)."""
    files = _sources()
    files += [ROOT / "docs" / "switches.md"]
    unknown = {n: sorted(f) for n, f in _names_in(files).items() if n not in {*switches.SWITCHES, *_test_switches()}}
    assert not unknown, unknown


def _test_switches() -> set[str]:
    """The switches the test suite declares for itself (`switches.Switch("DSC_...", ...)` in tests/)."""
    decl = re.compile(r"switches\.Switch\(\s*\"(DSC_[A-Z0-9_]+)\"")
    return {n for p in (ROOT / "tests").glob("*.py") for n in decl.findall(p.read_text())}


def test_the_runtime_registry_holds_no_test_only_switch():
    assert _test_switches() == {"DSC_UPDATE_GOLDEN"}
    assert not _test_switches() & set(switches.SWITCHES)


def test_typed_names_are_the_declared_switches():
    """`switches.PDL` and its siblings: one typed name per switch (the TYPE_CHECKING block), each
    the value `get` gives; a name that is no switch is an AttributeError."""
    typed = set(re.findall(r"^    ([A-Z_]+): str$", (ROOT / "switches.py").read_text(), re.M))
    assert {f"DSC_{t}" for t in typed} == set(switches.SWITCHES)
    for t in typed:
        assert getattr(switches, t) == switches.get(f"DSC_{t}")
    with pytest.raises(AttributeError, match="PDLL"):
        switches.PDLL  # noqa: B018


def test_override_sets_checks_and_restores(monkeypatch):
    monkeypatch.delenv("DSC_PDL", raising=False)
    monkeypatch.setenv("DSC_GEMV", "off")
    assert switches.GEMV == "off"
    with switches.override(GEMV="all", PDL="off"):
        assert (switches.GEMV, switches.PDL) == ("all", "off")
        with switches.override(GEMV="tuned"):
            assert switches.GEMV == "tuned"
        assert switches.GEMV == "all"
    assert (switches.GEMV, switches.PDL) == ("off", "auto")
    with pytest.raises(UserError, match="^DSC_GEMV: must be one of tuned, off, all, got 'fast'$"):
        with switches.override(GEMV="fast"):
            pass
    with pytest.raises(KeyError, match="no such switch"):
        with switches.override(NOPE="1"):
            pass
    assert switches.GEMV == "off"


def test_only_the_registry_reads_dsc_variables_from_the_environment():
    """Code reads a switch through `switches.get`, never os.environ / os.getenv."""
    reads = re.compile(r"(os\.environ(\.get)?\s*[\[(]\s*|os\.getenv\(\s*)[\"']DSC_")
    offenders = [
        str(p.relative_to(ROOT))
        for p in _sources("scripts", "tests")
        if p.name != "switches.py" and reads.search(p.read_text())
    ]
    assert not offenders, offenders


def test_docs_page_lists_every_switch():
    """docs/switches.md is generated (tests/test_docs.py checks it is current); here: the
    generator shows every switch, its doc and every choice."""
    want = switches.markdown()
    for s in switches.SWITCHES.values():
        assert f"## `{s.name}`" in want and all(f"| `{c}` |" in want for c in s.choices), s.name
        assert s.doc and (s.choices or s.value_doc), s.name


@pytest.mark.parametrize("name", sorted(switches.SWITCHES))
def test_unset_gives_the_default(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert switches.get(name) == switches.SWITCHES[name].default


@pytest.mark.parametrize("name, value", [(s.name, c) for s in switches.SWITCHES.values() for c in s.choices])
def test_every_choice_is_accepted(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    assert switches.get(name) == value


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("DSC_PDL", "x", "DSC_PDL: must be one of auto, off, got 'x'"),
        ("DSC_PDL", "on", "DSC_PDL: must be one of auto, off, got 'on'"),
        ("DSC_PDL", "", "DSC_PDL: must be one of auto, off, got ''"),
        ("DSC_ALLREDUCE", "one_shot", "DSC_ALLREDUCE: must be one of auto, nccl, got 'one_shot'"),
        ("DSC_GEMV", "Tuned", "DSC_GEMV: must be one of tuned, off, all, got 'Tuned'"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_switch(name, value, message, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as e:
        switches.get(name)
    assert str(e.value) == message


def test_tuning_file_is_checked_when_read(tmp_path, monkeypatch):
    good = tmp_path / "rows.json"
    good.write_text(json.dumps({"_comment": "ignored", "sm_90": {"gemv": {"N8_K8": {"BLOCK_N": 1}}}}))
    monkeypatch.setenv("DSC_TUNING", str(good))
    assert switches.get("DSC_TUNING") == str(good)
    for name, text, why in (
        ("missing.json", None, "cannot read"),
        ("bad.json", "{", "cannot read"),
        ("list.json", "[1]", "is not {arch:"),
        ("row.json", '{"sm_90": {"gemv": {"N8_K8": 3}}}', "is not {arch:"),
    ):
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        monkeypatch.setenv("DSC_TUNING", str(path))
        switches.reload()
        with pytest.raises(UserError) as e:
            switches.get("DSC_TUNING")
        assert str(e.value).startswith("DSC_TUNING: ") and why in str(e.value) and "\n" not in str(e.value)


def test_values_are_read_once_until_reload(monkeypatch):
    monkeypatch.setenv("DSC_GEMV", "off")
    assert switches.get("DSC_GEMV") == "off"
    monkeypatch.setenv("DSC_GEMV", "all")
    assert switches.get("DSC_GEMV") == "off"
    switches.reload()
    assert switches.get("DSC_GEMV") == "all"


def test_check_all_rereads_and_reports_the_first_bad_switch(monkeypatch):
    for name in switches.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    switches.check_all()
    monkeypatch.setenv("DSC_GEMV", "fast")
    with pytest.raises(UserError, match="^DSC_GEMV: "):
        switches.check_all()
    monkeypatch.setenv("DSC_GEMV", "off")
    switches.check_all()
    assert switches.get("DSC_GEMV") == "off"


def test_load_rereads_the_switches(compile_artifact, monkeypatch):
    """dsc.load checks every switch on any device (a typo is an error before anything loads) and
    the engine runs with the values read there."""
    import dsc

    art = compile_artifact("llama-tiny", dtype="fp32")
    monkeypatch.setenv("DSC_GEMV", "off")
    assert switches.get("DSC_GEMV") == "off"
    monkeypatch.setenv("DSC_GEMV", "all")
    dsc.load(art, device="cpu")
    assert switches.get("DSC_GEMV") == "all"
    monkeypatch.setenv("DSC_ALLREDUCE", "ring")
    with pytest.raises(UserError, match="^DSC_ALLREDUCE: must be one of auto, nccl, got 'ring'$"):
        dsc.load(art, device="cpu")
