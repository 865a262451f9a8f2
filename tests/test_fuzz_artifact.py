"""Fuzz the loader with random structural edits of plan.json and manifest.json, the manifest
re-hashed after each edit (so the checksums pass, as an attacker would arrange): wrong types,
names with quotes and line breaks, code payloads, huge and negative numbers, deep nesting,
deleted, added, duplicated and swapped entries. Every case must end in a correct run
(`dsc.load` + a short greedy generate, and `describe`, what `dsc inspect` shows) or in one
UserError line: never another exception, a hang, or code execution. Node fields `op`, `args`
and `kwargs` are edited like any other (runtime/plan.py checks them against the op table and
the ops' argument kinds)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from artifact_edits import copy_artifact, read_json, rehash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsc
from dsc.errors import UserError
from dsc.runtime.inspect import describe

MARKER = Path(tempfile.gettempdir()) / f"dsc-fuzz-executed-{os.getpid()}"
DEEP = "__deeply_nested__"
NASTY_STRINGS = [
    "",
    " ",
    "'",
    '"',
    "\n",
    "a\nb",
    "x'); import os; os.system('touch " + str(MARKER) + "'); ('",
    f"__import__('os').system('touch {MARKER}')",
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]"
    f".__init__.__globals__['system']('touch {MARKER}')",
    "9**9**9",
    "batch*" * 40 + "1",
    "../../../../etc/passwd",
    "/dev/zero",
    "tokenizer/../../x",
    "rank0.safetensors",
    "plan.json",
    "kv_cache.0.k",
    "kv_cache.9.v",
    "model.layers.0.mlp.down_proj.weight",
    "nan",
    "inf",
    "-1",
    "batch",
    "seq",
    "int",
    "float32",
    "int64",
    "bool",
    "decode",
    "prefill",
    "input",
    "weight",
    "call",
    "output",
    "[bold]",
    "[/x]",
    "\x00",
    "é",
    "a" * 400,
]
INTS = st.sampled_from([0, 1, 2, -1, -5, 3, 16, 512, 2**31, 2**62, -(2**63), 2**80, 10**30])
LEAVES = (
    st.none()
    | st.booleans()
    | INTS
    | st.integers(-100, 100)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(NASTY_STRINGS)
    | st.just(DEEP)
)
VALUES = st.recursive(
    LEAVES,
    lambda c: (
        st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(NASTY_STRINGS) | st.text(max_size=6), c, max_size=3)
    ),
    max_leaves=8,
)


def _children(obj) -> list:
    if isinstance(obj, dict):
        return list(obj)
    if isinstance(obj, list):
        return list(range(len(obj)))
    return []


@st.composite
def edits(draw):
    """(file, path into its JSON, operation, value)."""
    file = draw(st.sampled_from(["plan.json", "plan.json", "plan.json", "manifest.json"]))
    return (
        file,
        draw(st.randoms(use_true_random=False)),
        draw(st.sampled_from(["replace", "replace", "delete", "add_key", "duplicate", "swap", "deep"])),
        draw(VALUES),
    )


def _apply(doc: dict, rnd, op: str, value) -> None:
    """Walk from the root to a random container and edit it."""
    path: list = []
    node = doc
    while True:
        keys = _children(node)
        if not keys:
            break
        k = rnd.choice(keys)
        child = node[k]
        if not _children(child) or rnd.random() < 0.3:
            break
        path.append(k)
        node = child
    if isinstance(node, dict) and not keys:
        node[rnd.choice(NASTY_STRINGS)] = value
        return
    if not keys:
        return
    if op == "replace":
        node[k] = value
    elif op == "deep":
        node[k] = DEEP
    elif op == "delete":
        del node[k]
    elif op == "add_key" and isinstance(node, dict):
        node[rnd.choice(NASTY_STRINGS)] = value
    elif op == "duplicate" and isinstance(node, list):
        node.insert(rnd.randrange(len(node) + 1), json.loads(json.dumps(node[k])))
    elif op == "swap" and isinstance(node, list) and len(node) > 1:
        j = rnd.randrange(len(node))
        node[k], node[j] = node[j], node[k]
    else:
        node[k] = value


def _write(path: Path, doc) -> None:
    text = json.dumps(doc, allow_nan=True)
    path.write_text(text.replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000))


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("no result within the time limit")


@pytest.fixture(scope="module")
def tiny(compile_artifact):
    art = compile_artifact("llama-tiny", dtype="fp32", max_seq=16, max_batch=2)
    dsc.load(art, device="cpu", cuda_graphs=False).generate([[1, 2, 3]], max_new_tokens=2)  # warm up torch
    return art


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(edit=edits())
def test_random_edits_of_a_rehashed_artifact(tiny, edit):
    file, rnd, op, value = edit
    work = Path(tempfile.mkdtemp(prefix="dsc-fuzz-"))
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        art = copy_artifact(tiny, work / "art")
        doc = read_json(art / file)
        _apply(doc, rnd, op, value)
        if file == "plan.json":
            _write(art / file, doc)
            rehash(art)
        else:
            _write(art / file, doc)
        signal.alarm(30)
        try:
            describe(art)
            engine = dsc.load(art, device="cpu", cuda_graphs=False)
            res = engine.generate([[1, 2, 3]], max_new_tokens=2)
            assert len(res.tokens) == 1
        except UserError as e:
            assert "\n" not in str(e) and str(e), repr(str(e))
        finally:
            signal.alarm(0)
        assert not MARKER.exists(), f"artifact text ran code: {file} {op}"
    finally:
        signal.signal(signal.SIGALRM, old)
        shutil.rmtree(work, ignore_errors=True)
        MARKER.unlink(missing_ok=True)
