"""The dsc runtime. Loads artifacts with torch and safetensors alone (no transformers).

`Engine`, `GenerateResult` and `load` are imported on first use, so that the torch-free tools
of this package (`dsc inspect`: runtime/inspect.py, runtime/artifact.py) load without torch."""

from __future__ import annotations

__all__ = ["Engine", "GenerateResult", "load"]


def __getattr__(name: str):
    if name in __all__:
        from dsc.runtime import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dsc.runtime' has no attribute {name!r}")
