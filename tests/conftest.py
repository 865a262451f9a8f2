"""Shared fixtures: random-weight checkpoints and compiled artifacts, made once per session.

    ckpt = make_checkpoint("llama-tiny")                       # Path to a HF checkpoint folder
    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)   # Path to a dsc artifact
Both are cached by their arguments for the whole test session.
"""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _fresh_switches():
    """The DSC_* switches are read once and kept (switches.py): a test that sets one calls
    `switches.reload()`; this drops what a test read, after its environment is restored."""
    from dsc import switches

    switches.reload()
    yield
    switches.reload()


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    cache: dict = {}

    def make(shape: str = "llama-tiny", dtype: str = "float32", **kw):
        key = (shape, dtype, json.dumps(kw, sort_keys=True))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ckpt-{shape}")
            cache[key] = make_random_checkpoint(d, shape, dtype=dtype, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def compile_artifact(tmp_path_factory, make_checkpoint):
    import dsc

    cache: dict = {}

    def compile_(shape: str = "llama-tiny", ckpt_kwargs: dict | None = None, **options):
        key = (shape, json.dumps(ckpt_kwargs or {}, sort_keys=True), json.dumps(options, sort_keys=True, default=str))
        if key not in cache:
            ckpt = make_checkpoint(shape, **(ckpt_kwargs or {}))
            out = tmp_path_factory.mktemp(f"art-{shape}") / "artifact"
            cache[key] = dsc.compile(str(ckpt), out, **options)
        return cache[key]

    return compile_
