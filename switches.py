"""dsc's runtime switches: every `DSC_*` environment variable, declared once.

Each switch has a name, a default, its choices (or a check of a free-form value) and a one-line
doc. A value is read from the environment on first use and kept: `dsc.load` re-reads and checks
every switch (`check_all`), so a bad value is one line (`error: DSC_PDL: must be one of auto,
off, got 'x'`) on any device, before anything is built. Code reads a switch through this module,
never `os.environ`: by attribute, `switches.PDL` (the name without `DSC_`, typed for mypy), or
`get("DSC_PDL")`. Tests that change the environment call `reload()`; `override(PDL="off")` sets
values for this process within a `with` block.

docs/switches.md is generated from this table by scripts/gen_docs.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dsc.errors import UserError

if TYPE_CHECKING:  # `switches.PDL` etc. (module __getattr__ below); tests/test_switches.py keeps these in step
    ALLREDUCE: str
    PDL: str
    GEMV: str
    TUNING: str
    API_KEY: str


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    doc: str
    choices: dict[str, str] = field(default_factory=dict)  # value -> what it does; empty: `check` decides
    check: Callable[[str], None] | None = None  # raises ValueError("<what is wrong>") for a bad value
    value_doc: str = ""  # what a free-form value is (the docs' "values" column)

    def parse(self, raw: str) -> str:
        """raw, checked: UserError naming the switch where it is not a valid value."""
        if self.choices and raw not in self.choices:
            raise UserError(f"{self.name}: must be one of {', '.join(self.choices)}, got {raw!r}")
        if self.check is not None and raw != self.default:
            try:
                self.check(raw)
            except ValueError as e:
                raise UserError(f"{self.name}: {e}") from None
        return raw


def check_tuning_file(path: str) -> None:
    """A DSC_TUNING file: JSON of kernels/tuning.json's layout, {arch: {kernel: {shape_class:
    {...}}}} (top-level keys starting with "_" are comments)."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    ok = isinstance(rows, dict) and all(
        isinstance(kernels, dict)
        and all(
            isinstance(shapes, dict) and all(isinstance(r, dict) for r in shapes.values())
            for shapes in kernels.values()
        )
        for arch, kernels in rows.items()
        if not arch.startswith("_")
    )
    if not ok:
        raise ValueError(f"{path} is not {{arch: {{kernel: {{shape_class: {{...}}}}}}}}")


SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch(
            "DSC_ALLREDUCE",
            "auto",
            "How tensor-parallel collectives run on CUDA (kernels/collectives.py).",
            choices={
                "auto": "symmetric-memory kernels where the probe at load passes (the one-shot all-reduce, "
                "the fused all-reduce + norm, the GEMV pushing its rows, the push all-gather), "
                "NCCL elsewhere",
                "nccl": "every collective through NCCL, the logits' all-gather included",
            },
        ),
        Switch(
            "DSC_PDL",
            "auto",
            "Programmatic dependent launch of the decode kernels (kernels/launch.py).",
            choices={
                "auto": "on where the GPU and triton support it (Hopper or newer, not in the interpreter)",
                "off": "never",
            },
        ),
        Switch(
            "DSC_GEMV",
            "tuned",
            "Which 16-bit linears at one row run dsc's GEMV kernel (kernels/linear.py).",
            choices={
                "tuned": "the shapes with a row in kernels/tuning.json; cuBLAS elsewhere",
                "off": "cuBLAS everywhere",
                "all": "the GEMV at every shape, untuned ones with a default config (the GPU check suite)",
            },
        ),
        Switch(
            "DSC_TUNING",
            "",
            "A tuning-table file whose rows replace kernels/tuning.json's, for tuners and A/B benches "
            "(kernels/launch.py).",
            check=check_tuning_file,
            value_doc="a JSON file `{arch: {kernel: {shape_class: {...}}}}`; unset: the shipped table",
        ),
        Switch(
            "DSC_API_KEY",
            "",
            "The key `dsc serve` requires as `Authorization: Bearer KEY` on /v1, and the key `dsc bench-serve` "
            "sends (serve/); `--api-key` wins over it.",
            value_doc="any string; unset: no key, and `dsc serve` listens on 127.0.0.1 unless `--host` says otherwise",
        ),
    )
}


_OVERRIDES: dict[str, str] = {}  # what `override` set, in this process, over the environment


@functools.cache
def get(name: str) -> str:
    """The switch's value, read from the environment on first use and checked (UserError where
    bad); the default where unset."""
    s = SWITCHES[name]
    return s.parse(_OVERRIDES.get(name, os.environ.get(name, s.default)))


def __getattr__(attr: str) -> str:
    """`switches.PDL` is `get("DSC_PDL")`."""
    name = f"DSC_{attr}"
    if attr.isupper() and name in SWITCHES:
        return get(name)
    raise AttributeError(f"module 'dsc.switches' has no attribute {attr!r}")


def reload() -> None:
    """Forget the values read: the next `get` reads the environment again."""
    get.cache_clear()


@contextlib.contextmanager
def override(**values: str) -> Iterator[None]:
    """Within the block, the switches named (without `DSC_`) have these values in this process
    (child processes read the environment): `with switches.override(PDL="off"): ...`. Each
    value is checked as the environment's would be; the previous values come back on exit."""
    names = {f"DSC_{k}": v for k, v in values.items()}
    for name, value in names.items():
        if name not in SWITCHES:
            raise KeyError(f"{name}: no such switch")
        SWITCHES[name].parse(value)
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(names)
    reload()
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)
        reload()


def check_all() -> None:
    """Re-read and check every switch (at `dsc.load`): the first bad one raises UserError."""
    reload()
    for name in SWITCHES:
        get(name)


def markdown() -> str:
    """docs/switches.md."""
    lines = [
        "# Runtime switches",
        "",
        "Environment variables that change how dsc runs. Each is read once, when `dsc.load` loads an",
        "artifact (or on first use outside an engine), and checked there: a bad value is one line,",
        "`error: DSC_PDL: must be one of auto, off, got 'x'`, on any device.",
        "",
        "Generated from `switches.py` by `python scripts/gen_docs.py`; do not edit by hand.",
        "",
    ]
    for s in SWITCHES.values():
        lines += [f"## `{s.name}`", "", s.doc, "", f"Default: `{s.default}`" if s.default else "Default: unset", ""]
        if s.choices:
            lines += ["| value | effect |", "|---|---|"]
            lines += [f"| `{value}` | {effect} |" for value, effect in s.choices.items()]
        else:
            lines.append(f"Value: {s.value_doc}.")
        lines.append("")
    return "\n".join(lines)
