"""Load an artifact's ahead-of-time kernel binaries (kernels/binaries.json and its cubins).

A cubin is GPU code: it runs with the process's rights on the device. The binaries are loaded
only when the operator vouches for them: the artifact's signature verified against the key
they named (`--require-signature KEY.pub`), or `--trust-kernels`. Otherwise the runtime
compiles the kernels from its own sources with Triton, as an artifact without binaries does
(docs/security.md). Every binary read is checked against the sha256 the manifest records,
whatever `verify` says, and binaries.json is checked field by field before anything uses it.
"""

from __future__ import annotations

import hashlib
import re
import sys
import time

import torch

from dsc.errors import UserError
from dsc.kernels import binaries as B
from dsc.runtime.artifact import Artifact, read_json_object, sha256_file

INDEX = "kernels/binaries.json"
INDEX_FORMAT, INDEX_VERSION = "dsc-kernel-binaries", 1
_TARGET = re.compile(r"sm_\d{2,3}")
_HEX = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}")
_KERNEL = re.compile(r"dsc\.kernels\.[a-z0-9_]+:[A-Za-z_][A-Za-z0-9_]{0,200}")
_TYPE = re.compile(r"\*?(fp|bf|i|u)\d{1,2}(e4nv|e5)?|u1|constexpr")
_MAX_SHARED = 1 << 20


def _scalar(v) -> bool:
    return v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 4096)


def _pairs(v, name_ok) -> bool:
    return isinstance(v, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and name_ok(p[0]) and _scalar(p[1]) for p in v
    )


def _check_entry(where: str, i: int, e, files: dict) -> B.Spec:
    field = f"{where}: binaries[{i}]"
    if not isinstance(e, dict):
        raise UserError(f"{field}: expected an object")
    f = e.get("file")
    if not isinstance(f, str) or not f.startswith("kernels/") or not f.endswith(".cubin") or f not in files:
        raise UserError(f"{field}: field 'file' must name a kernels/*.cubin file the manifest lists")
    if not (isinstance(e.get("target"), str) and _TARGET.fullmatch(e["target"])):
        raise UserError(f"{field}: field 'target' must be an arch like sm_90")
    if not (isinstance(e.get("entry"), str) and _NAME.fullmatch(e["entry"])):
        raise UserError(f"{field}: field 'entry' must be a kernel name")
    if not (type(e.get("num_warps")) is int and 1 <= e["num_warps"] <= 32):
        raise UserError(f"{field}: field 'num_warps' must be an integer from 1 to 32")
    if not (type(e.get("shared")) is int and 0 <= e["shared"] <= _MAX_SHARED):
        raise UserError(f"{field}: field 'shared' must be a byte count up to {_MAX_SHARED}")
    params = e.get("params")
    if not (isinstance(params, list) and len(params) <= 256 and all(p in B.PTX_TYPES for p in params)):
        raise UserError(f"{field}: field 'params' must list PTX parameter types ({', '.join(sorted(B.PTX_TYPES))})")
    s = e.get("spec")
    try:
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("kernel"), str)
            and _KERNEL.fullmatch(s["kernel"])
            and s.get("dialect") in ("triton", "gluon")
            and isinstance(s.get("source"), str)
            and _HEX.fullmatch(s["source"])
            and isinstance(s.get("args"), list)
            and all(
                isinstance(a, list)
                and len(a) == 3
                and isinstance(a[0], str)
                and _NAME.fullmatch(a[0])
                and isinstance(a[1], str)
                and _TYPE.fullmatch(a[1])
                and type(a[2]) is bool
                for a in s["args"]
            )
            and _pairs(s.get("constants"), lambda n: bool(_NAME.fullmatch(n)))
            and _pairs(s.get("options"), lambda n: n in B.OPTIONS)
        )
    except TypeError:
        ok = False
    if not ok:
        raise UserError(f"{field}: field 'spec' is not a kernel launch spec")
    assert isinstance(s, dict)  # ok holds for an object only
    spec = B.Spec.from_json(s)
    if sum(ty != "constexpr" for _, ty, _ in spec.args) > len(params):
        raise UserError(f"{field}: field 'params' has fewer entries than the spec's arguments")
    return spec


def _index(artifact: Artifact) -> list:
    """binaries.json's entries, each checked ([] when the artifact has none)."""
    files = artifact.manifest["files"]
    if INDEX not in files:
        return []
    where = str(artifact.path / INDEX)
    index = read_json_object(artifact.path / INDEX)
    if index.get("format") != INDEX_FORMAT or index.get("format_version") != INDEX_VERSION:
        raise UserError(f"{where}: not a dsc kernel-binaries index (fields 'format', 'format_version')")
    entries = index.get("binaries")
    if not isinstance(entries, list):
        raise UserError(f"{where}: field 'binaries' must be a list")
    return [(e, _check_entry(where, i, e, files)) for i, e in enumerate(entries)]


def arch_of_device(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def read_binaries(artifact: Artifact, arch: str) -> list[B.Binary]:
    """The artifact's binaries for `arch`, each file checked against its manifest sha256 (and
    binaries.json too) whatever the artifact was opened with."""
    files = artifact.manifest["files"]
    path = artifact.path / INDEX
    if sha256_file(path) != files[INDEX]:
        raise UserError(f"{path}: checksum mismatch (file changed or corrupt since compile)")
    out = []
    for e, spec in _index(artifact):
        if e["target"] != arch:
            continue
        p = artifact.path / e["file"]
        data = p.read_bytes()
        if hashlib.sha256(data).hexdigest() != files[e["file"]]:
            raise UserError(f"{p}: checksum mismatch (file changed or corrupt since compile)")
        out.append(B.Binary(spec, data, e["entry"], e["num_warps"], e["shared"], e["params"]))
    return out


def load_binaries(artifact: Artifact, device: torch.device, trusted: bool) -> dict:
    """Install the artifact's binaries for `device`'s arch when `trusted` (kernels/binaries.py);
    returns what happened: {"status": "loaded" | "untrusted" | "no binaries for <arch>" | "none",
    "binaries": n, "seconds": s}. Prints one line when binaries are there but not used."""
    files = artifact.manifest["files"]
    B.uninstall()
    if INDEX not in files or device.type != "cuda":
        return {"status": "none", "binaries": 0}
    if not trusted:
        print(
            f"dsc: {artifact.path}: its kernel binaries are not loaded (GPU code: give --require-signature "
            "KEY.pub for a signed artifact, or --trust-kernels); kernels compile with Triton",
            file=sys.stderr,
        )
        return {"status": "untrusted", "binaries": 0}
    t = time.perf_counter()
    arch = arch_of_device(device)
    out = read_binaries(artifact, arch)
    if not out:
        targets = sorted({e["target"] for e, _ in _index(artifact)})
        print(
            f"dsc: {artifact.path}: no kernel binaries for this GPU ({arch}; the artifact has "
            f"{', '.join(targets) or 'none'}); kernels compile with Triton",
            file=sys.stderr,
        )
        return {"status": f"no binaries for {arch}", "binaries": 0}
    B.install(out)
    return {"status": "loaded", "binaries": len(out), "seconds": time.perf_counter() - t}
