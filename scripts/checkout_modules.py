"""dsc's modules from this checkout, for the self-contained GPU scripts beside this file.

    from checkout_modules import checkout_modules
    NORM, ROT = checkout_modules("kernels.norm", "kernels.rotary")

Imports dsc.<name> for each name without installing dsc and without dsc/__init__.py (which
imports the compiler, and with it transformers): `dsc` and each name's package (`dsc.kernels`,
`dsc.runtime`) become bare packages over the checkout's folders, unless a `dsc` is imported
already. A script then needs torch and triton only. The scripts run as `python scripts/X.py`,
which puts this folder on sys.path.
"""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_modules(*names: str) -> list:
    """[dsc.<name> for each name], e.g. "kernels.attention", "runtime.decode"."""
    packages = ["dsc", *sorted({"dsc." + name.rpartition(".")[0] for name in names if "." in name})]
    for package in packages:
        if package not in sys.modules:
            bare = types.ModuleType(package)
            bare.__path__ = [str(ROOT.joinpath(*package.split(".")[1:]))]
            sys.modules[package] = bare
    return [importlib.import_module(f"dsc.{name}") for name in names]
