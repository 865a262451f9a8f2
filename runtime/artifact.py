"""Read an artifact: manifest and plan, with format-version, path and checksum checks.

An artifact is untrusted data (a model hub, a colleague's CI, a cache): everything read here is
checked for type and range before anything uses it, the manifest's file list must name exactly
the artifact's files (relative paths inside it, no links), and nothing the manifest does not
list is read. Checksums catch corruption; a signature (runtime/signature.py) catches tampering.
See docs/security.md.

Only torch-free stdlib here; errors a user can cause are `UserError` with one line naming
the file or field.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dsc.errors import UserError

FORMAT = "dsc-artifact"
FORMAT_VERSION = 2
# files of an artifact folder that its manifest does not list: the manifest itself, and the
# signature made over the manifest's bytes
UNLISTED = ("manifest.json", "signature.json")

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# a tensor or node name as the compiler writes it (an HF module path): no quotes, line breaks,
# spaces or other characters that could leave a name's place in generated code
# (also the rule runtime/plan.py applies to node names and targets; at most 300 characters)
SAFE_NAME = re.compile(r"(?=.{1,300}\Z)[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*", re.ASCII | re.DOTALL)
# safetensors dtype tag -> bytes per element; plan (torch) dtype name -> safetensors tag
ST_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
PLAN_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_HEADER_LIMIT = 100_000_000  # bytes of a safetensors JSON header
_MAX_DIM = 1 << 40
_MAX_TP = 1024
_MAX_BATCH = 1 << 16
_MAX_SEQ = 1 << 24


def _show(value, limit: int = 40) -> str:
    """A value from the artifact, quoted and cut short, for an error line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Artifact:
    path: Path
    manifest: dict
    plan: dict
    pending_checks: list | None = None  # (path, sha256 wanted, future of the sha256 found) per rank file

    def finish_checks(self) -> None:
        """Wait for the deferred rank-file checksums; a mismatch is the same error as at open."""
        pending, self.pending_checks = self.pending_checks or [], None
        for p, want, got in pending:
            if got.result() != want:
                raise UserError(f"{p}: checksum mismatch (file changed or corrupt since compile)")

    @property
    def tp(self) -> int:
        return int(self.plan["tp"])

    def rank_file(self, rank: int) -> Path:
        return self.path / f"rank{rank}.safetensors"

    def planned_weights(self) -> dict[str, tuple[str, list[int]]]:
        """target -> (dtype, shape) of every rank-file tensor the plan's programs read."""
        out: dict[str, tuple[str, list[int]]] = {}
        for prog in self.plan["programs"].values():
            for n in prog["nodes"]:
                if n["kind"] == "weight" and not n["target"].startswith(("kv_cache.", "kv_pool.")):
                    out[n["target"]] = (n.get("dtype"), n.get("shape"))
        return out

    def rank_header(self, rank: int) -> dict:
        """The rank file's safetensors header, checked against the plan (every tensor the plan
        reads is there with the plan's dtype and shape; every name a module path, every tensor
        inside the file: read_safetensors_header) before any tensor is read."""
        path = self.rank_file(rank)
        header = read_safetensors_header(path)
        planned = self.planned_weights()
        for name, (dtype, shape) in sorted(planned.items()):
            info = header.get(name)
            if info is None:
                raise UserError(f"{path}: missing tensor '{name}' the plan reads")
            if (PLAN_DTYPES.get(dtype), shape) != (info["dtype"], info["shape"]):
                raise UserError(
                    f"{path}: tensor '{name}' is {info['dtype']}{info['shape']}, the plan reads {dtype}{shape}"
                )
        return header

    def tokenizer(self):
        """The artifact's tokenizer (tokenizers.Tokenizer), or None when it has none. Its files
        were listed and, with verification, checked by `open_artifact` before this parse."""
        f = self.path / "tokenizer" / "tokenizer.json"
        if "tokenizer/tokenizer.json" not in self.manifest["files"]:
            return None
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(f))
        except Exception as e:  # tokenizers raises a bare Exception for any malformed file
            raise UserError(
                f"{f}: not a valid tokenizer ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"
            ) from None
        # a tokenizer.json may carry the padding and truncation of its training (BERT-style
        # embedding models: padded and cut to 128): the runtime pads batches itself, and a
        # prompt over the artifact's max_seq is refused, never silently cut
        tok.no_padding()
        tok.no_truncation()
        return tok


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root that a manifest lists (all but UNLISTED):
    what `dsc compile` records in manifest.json and `open_artifact` checks against."""
    files = sorted(p for p in Path(root).rglob("*") if p.is_file())
    return {
        p.relative_to(root).as_posix(): sha256_file(p) for p in files if p.relative_to(root).as_posix() not in UNLISTED
    }


_MAX_INT_DIGITS = 300  # an integer literal longer than this is no size, count or id an artifact holds


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer literal of {len(text)} digits")
    return int(text)


def _json_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"the number {text[:40]} overflows a float")
    return x


def _json_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def load_json(data: bytes | str):
    """json.loads with the limits an artifact's JSON keeps: integers of at most _MAX_INT_DIGITS
    digits, finite floats only (no NaN, Infinity or overflowing literals). Raises ValueError
    (JSONDecodeError included) or RecursionError."""
    return json.loads(data, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)


def read_json_object(path: Path, data: bytes | None = None) -> dict:
    if data is None:
        if not path.exists():
            raise UserError(f"{path}: missing (is {path.parent} a dsc artifact?)")
        data = path.read_bytes()
    try:
        d = load_json(data)
    except RecursionError:
        raise UserError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and the limits of load_json
        raise UserError(f"{path}: not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(d, dict):
        raise UserError(f"{path}: expected a JSON object")
    return d


def read_safetensors_header(path: Path) -> dict:
    """Parse and check a safetensors header without reading any tensor: a JSON object of
    tensors with known dtypes, non-negative shapes, and data offsets that match their sizes and
    tile the data section exactly (so no tensor reads outside the file or overlaps another)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > _HEADER_LIMIT:
                raise UserError(f"{path}: corrupt safetensors file (header length {n} exceeds file size)")
            raw = f.read(n)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = load_json(raw)
    except (ValueError, RecursionError):
        raise UserError(f"{path}: corrupt safetensors file (header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise UserError(f"{path}: corrupt safetensors header ('__metadata__' is not a string map)")
            continue
        if not SAFE_NAME.fullmatch(name):
            raise UserError(f"{path}: tensor name {name[:80]!r} is not a module path")
        try:
            lo, hi = info["data_offsets"]
            nbytes = ST_DTYPE_BYTES[info["dtype"]]
            shape = info["shape"]
            if not (
                isinstance(shape, list)
                and len(shape) <= 16
                and all(type(d) is int and 0 <= d < _MAX_DIM for d in shape + [lo, hi])
            ):
                raise ValueError
            for d in shape:
                nbytes *= d
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: corrupt safetensors header entry for tensor '{name}'") from None
        if hi - lo != nbytes:
            raise UserError(f"{path}: corrupt safetensors file (tensor '{name}' has the wrong size)")
        spans.append((lo, hi, name))
    end = 0
    for lo, hi, name in sorted(spans):
        if lo != end and hi != lo:
            raise UserError(f"{path}: corrupt safetensors file (tensor '{name}' overlaps or leaves a gap)")
        end = max(end, hi)
    if 8 + n + end != size:
        raise UserError(f"{path}: truncated or corrupt safetensors file ({size} bytes, header says {8 + n + end})")
    return header


# -- the manifest -------------------------------------------------------------------------
def _check_rel_path(where: Path, rel) -> str:
    """A manifest file entry: a plain relative path inside the artifact."""
    if not isinstance(rel, str) or not rel or len(rel) > 255:
        raise UserError(f"{where}: field 'files' has an entry that is not a file name")
    p = PurePosixPath(rel)
    if (
        p.is_absolute()
        or "\\" in rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
        or any(ord(c) < 32 for c in rel)
        or rel in UNLISTED
    ):
        raise UserError(f"{where}: field 'files': {rel[:80]!r} is not a relative path inside the artifact")
    return rel


def _listed_files(path: Path, manifest: dict) -> dict[str, str]:
    """The manifest's file list, checked against the folder: every entry a regular file inside
    the artifact, every file of the artifact (but UNLISTED) an entry, and no links anywhere."""
    where = path / "manifest.json"
    files = manifest.get("files")
    if not isinstance(files, dict) or "plan.json" not in files:
        raise UserError(f"{where}: field 'files' is missing or incomplete")
    for rel, digest in files.items():
        _check_rel_path(where, rel)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise UserError(f"{where}: field 'files': {rel!r} has no sha256")
    present = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(path).as_posix()
            mode = full.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise UserError(f"{path}: {_show(rel, 80)} is a link; an artifact holds plain files only")
            if stat.S_ISREG(mode):
                if full.lstat().st_nlink > 1:  # a hard link: the same file may be reachable from outside
                    raise UserError(
                        f"{path}: {_show(rel, 80)} has {full.lstat().st_nlink} hard links; an artifact "
                        "holds plain files with one link each (copy it, do not link it)"
                    )
                present.add(rel)
            elif not stat.S_ISDIR(mode):
                raise UserError(f"{path}: {_show(rel, 80)} is not a plain file; an artifact holds plain files only")
    unlisted = sorted(present - set(files) - set(UNLISTED))
    if unlisted:
        raise UserError(
            f"{path}: file {_show(unlisted[0], 80)} is not listed in manifest.json "
            "(files added after compile are refused)"
        )
    return files


def _check_manifest(path: Path, manifest: dict) -> None:
    where = path / "manifest.json"
    if manifest.get("format") != FORMAT:
        raise UserError(f"{where}: not a dsc artifact (field 'format' is {_show(manifest.get('format'), 40)})")
    if manifest.get("format_version") != FORMAT_VERSION or type(manifest.get("format_version")) is not int:
        raise UserError(
            f"{where}: artifact format version {_show(manifest.get('format_version'), 40)}, "
            f"this dsc reads version {FORMAT_VERSION}; recompile with this dsc"
        )
    tp = manifest.get("tp", 1)
    if type(tp) is not int or not 1 <= tp <= _MAX_TP:
        raise UserError(f"{where}: field 'tp' must be an integer from 1 to {_MAX_TP}")


# -- the plan -----------------------------------------------------------------------------
def _is_dtype(v) -> bool:
    return isinstance(v, str) and v in PLAN_DTYPES


def _is_count(v, lo: int = 0, hi: int = _MAX_DIM) -> bool:
    return type(v) is int and lo <= v <= hi


def _check_shape(shape, depth: int = 0) -> str | None:
    """Why a node's shape is malformed (None: it is fine): a list of dims (a non-negative int,
    or a symbolic dim runtime/memory_plan.py parses), a list of such lists (a tuple output),
    "int" (a scalar), or null."""
    from dsc.runtime.memory_plan import parse_dim

    if shape is None or shape == "int":
        return None
    if not isinstance(shape, list) or len(shape) > 16:
        return "shape must be a list of at most 16 dims"
    for d in shape:
        if isinstance(d, list) and depth == 0:
            why = _check_shape(d, 1)
            if why:
                return why
        elif d is None and depth == 0:
            continue
        elif isinstance(d, str):
            try:
                parse_dim(d)
            except ValueError as e:
                return str(e)
        elif not _is_count(d):
            return f"dim {_show(d, 40)} is not a size"
    return None


_NODE_KINDS = ("input", "weight", "call", "output")


def _check_node(where: str, n) -> None:
    if not isinstance(n, dict):
        raise UserError(f"{where}: a node is not an object")
    name = n.get("name")
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
        raise UserError(f"{where}: node name {_show(name, 80)} is not a module path")
    where = f"{where}: node '{name}'"
    kind = n.get("kind")
    if kind not in _NODE_KINDS:
        raise UserError(f"{where}: field 'kind' must be one of {', '.join(_NODE_KINDS)}")
    if kind == "weight":
        t = n.get("target")
        if not isinstance(t, str) or not SAFE_NAME.fullmatch(t):
            raise UserError(f"{where}: field 'target' {_show(t, 80)} is not a module path")
    if kind == "call" and not isinstance(n.get("op"), str):
        raise UserError(f"{where}: field 'op' must be a string")
    if kind == "call" and not isinstance(n.get("args"), list):
        raise UserError(f"{where}: field 'args' must be a list")
    if not isinstance(n.get("kwargs", {}), dict):
        raise UserError(f"{where}: field 'kwargs' must be an object")
    why = _check_shape(n.get("shape"))
    if why:
        raise UserError(f"{where}: field 'shape': {why}")
    if "dtype" in n and not _is_dtype(n["dtype"]):
        raise UserError(f"{where}: field 'dtype' {_show(n['dtype'], 40)} is not a dtype")
    if kind == "weight" and (
        not isinstance(n.get("shape"), list)
        or "dtype" not in n
        or not all(_is_count(d) for d in (n["shape"][1:] if _is_pool(n) else n["shape"]))
    ):
        raise UserError(f"{where}: a weight needs a concrete shape and a dtype")
    k = n.get("kernel")
    if k is not None and not (
        isinstance(k, dict)
        and isinstance(k.get("name"), str)
        and _is_count(k.get("launches"))
        and isinstance(k.get("config", {}), dict)
    ):
        raise UserError(f"{where}: field 'kernel' must be {{name, launches, config}}")


def _is_pool(n: dict) -> bool:
    """A paged KV pool's node: its block count is the runtime's choice ("pool_blocks")."""
    return str(n.get("target", "")).startswith("kv_pool.") and n["shape"][:1] == ["pool_blocks"]


# the programs the runtime runs, and the inputs each takes, in order
PROGRAM_INPUTS = {
    "prefill": ["input_ids", "position_ids", "cache_pos", "last_idx"],
    "decode": ["input_ids", "position_ids", "cache_pos", "last_idx"],
    # continuous batching (kernels/paged_attention.py has the layout)
    "ragged": [
        "input_ids",
        "position_ids",
        "slot_mapping",
        "query_start",
        "query_lens",
        "cache_lens",
        "block_tables",
        "logits_idx",
    ],
    "encode": ["input_ids", "lengths"],  # an encoder's one program: right-padded rows and their lengths
}
# the programs of each model kind (plan "model.kind"; a plan without one is a decoder's)
KIND_PROGRAMS = {"decoder": ("prefill", "decode", "ragged"), "encoder": ("encode",)}


def _check_program(where: str, prog: dict, want_inputs: list[str]) -> None:
    """Nodes well-formed, names unique, every node reference to an earlier node, the inputs
    the runtime passes, one output, last."""
    from dsc.runtime.memory_plan import node_refs

    if prog.get("inputs") != want_inputs:
        raise UserError(f"{where}: field 'inputs' must be {want_inputs}")
    seen: set[str] = set()
    inputs = []
    for i, n in enumerate(prog["nodes"]):
        _check_node(where, n)
        name = n["name"]
        if name in seen:
            raise UserError(f"{where}: node name '{name}' is used twice")
        try:
            refs = node_refs(n.get("args", [])) + node_refs(list(n.get("kwargs", {}).values()))
        except (AttributeError, TypeError):
            raise UserError(f"{where}: node '{name}' has a malformed argument") from None
        for r in refs:
            if not isinstance(r, str) or r not in seen:
                raise UserError(f"{where}: node '{name}' reads {_show(r, 80)}, which is not an earlier node")
        seen.add(name)
        if n["kind"] == "input":
            inputs.append(name)
        if (n["kind"] == "output") != (i == len(prog["nodes"]) - 1):
            raise UserError(f"{where}: the program must end in its one output node")
    if inputs != want_inputs:
        raise UserError(f"{where}: the input nodes must be {', '.join(want_inputs)}")


def check_plan(where: Path, plan: dict, tp: int) -> None:
    """The plan's structure and ranges, before anything reads it (the loader, `dsc inspect`,
    `dsc diff`, `dsc export-onnx`). Op names, argument encodings and node references are
    checked where the graph is built (runtime/plan.py)."""
    if plan.get("format_version") != FORMAT_VERSION or type(plan.get("format_version")) is not int:
        raise UserError(
            f"{where}: plan format version {_show(plan.get('format_version'), 40)}, expected {FORMAT_VERSION}"
        )
    if plan.get("tp") != tp or type(plan.get("tp")) is not int:
        raise UserError(f"{where}: field 'tp' must be the manifest's tp ({tp})")
    model, limits = plan.get("model"), plan.get("limits")
    if (
        not isinstance(model, dict)
        or not _is_dtype(model.get("dtype"))
        or not _is_count(model.get("vocab_size"), 1)
        or not isinstance(model.get("model_type"), str)
    ):
        raise UserError(f"{where}: field 'model' must hold model_type, a dtype and vocab_size")
    eos = model.get("eos_token_ids") or []
    if not isinstance(eos, list) or not all(_is_count(t) for t in eos):
        raise UserError(f"{where}: field 'model.eos_token_ids' must be a list of token ids")
    if (
        not isinstance(limits, dict)
        or not _is_count(limits.get("max_batch"), 1, _MAX_BATCH)
        or not _is_count(limits.get("max_seq"), 2, _MAX_SEQ)
    ):
        raise UserError(f"{where}: field 'limits' must hold max_batch (1..{_MAX_BATCH}) and max_seq (2..{_MAX_SEQ})")
    buckets = limits.get("decode_buckets")
    if buckets is not None and not (
        isinstance(buckets, list)
        and buckets
        and all(_is_count(b, 1, limits["max_batch"]) for b in buckets)
        and buckets == sorted(set(buckets))
    ):
        raise UserError(f"{where}: field 'limits.decode_buckets' must be increasing batch sizes up to max_batch")
    kv = plan.get("kv_cache")
    if kv is not None and not (
        isinstance(kv, dict)
        and _is_dtype(kv.get("dtype"))
        and _is_count(kv.get("layers"), 0, 4096)
        and isinstance(kv.get("shape"), list)
        and len(kv["shape"]) == 4
        and all(_is_count(d, 1, 1 << 20) for d in kv["shape"])
        and kv["shape"][0] == limits["max_batch"]
        and kv["shape"][2] == limits["max_seq"]
    ):
        raise UserError(
            f"{where}: field 'kv_cache' must hold dtype, layers and a [max_batch, heads, max_seq, dim] shape"
        )
    pool = plan.get("kv_pool")
    if pool is not None and not (
        isinstance(pool, dict)
        and _is_dtype(pool.get("dtype"))
        and _is_count(pool.get("layers"), 0, 4096)
        and pool.get("block_size") in (16, 32)
        and _is_count(pool.get("kv_heads"), 1, 1 << 12)
        and _is_count(pool.get("head_dim"), 1, 1 << 12)
    ):
        raise UserError(
            f"{where}: field 'kv_pool' must hold dtype, layers, block_size (16 or 32), kv_heads and head_dim"
        )
    kind = model.get("kind", "decoder")
    if kind not in KIND_PROGRAMS:
        raise UserError(f"{where}: field 'model.kind' must be one of {', '.join(KIND_PROGRAMS)}")
    programs, want = plan.get("programs"), KIND_PROGRAMS[kind]
    if not isinstance(programs, dict) or set(want) != set(programs):
        raise UserError(f"{where}: field 'programs' must hold the programs {', '.join(want)}")
    for pname, prog in programs.items():
        if not SAFE_NAME.fullmatch(pname) or not isinstance(prog, dict) or not isinstance(prog.get("nodes"), list):
            raise UserError(f"{where}: program {_show(pname)} must be an object with a 'nodes' list")
        try:
            _check_program(f"{where}: program '{pname}'", prog, PROGRAM_INPUTS[pname])
        except RecursionError:
            raise UserError(f"{where}: program '{pname}' is nested too deeply") from None
    weights: dict[str, tuple] = {}
    kv_targets = {f"kv_cache.{i}.{t}" for i in range(kv["layers"]) for t in "kv"} if kv else set()
    pool_targets = {f"kv_pool.{i}.{t}" for i in range(pool["layers"]) for t in "kv"} if pool else set()
    pool_sig = (
        (pool["dtype"], ["pool_blocks", pool["kv_heads"], pool["block_size"], pool["head_dim"]]) if pool else None
    )
    for prog in programs.values():
        for n in prog["nodes"]:
            if n["kind"] == "weight":
                sig = (n["dtype"], n["shape"])
                if weights.setdefault(n["target"], sig) != sig:
                    raise UserError(f"{where}: weight '{n['target']}' has two different shapes or dtypes")
                if n["target"].startswith("kv_cache.") and (
                    kv is None or n["target"] not in kv_targets or sig != (kv["dtype"], kv["shape"])
                ):
                    raise UserError(f"{where}: weight '{n['target']}' is not a layer of field 'kv_cache'")
                if n["target"].startswith("kv_pool.") and (n["target"] not in pool_targets or sig != pool_sig):
                    raise UserError(f"{where}: weight '{n['target']}' is not a layer of field 'kv_pool'")
    for key in ("passes", "notes"):
        if not isinstance(plan.get(key, {}), dict):
            raise UserError(f"{where}: field '{key}' must be an object")


def open_artifact(
    path: str | Path,
    ranks: list[int] | None = None,
    verify: bool = True,
    require_signature: str | Path | None = None,
    defer_rank_checksums: bool = False,
) -> Artifact:
    """Open and check an artifact. With `verify`, every file this process reads (plan,
    tokenizer and the rank files in `ranks`; all rank files when ranks is None) must match
    the sha256 the manifest records. With `require_signature` (a public key file), the
    manifest must carry a valid signature by that key, and verification is on whatever
    `verify` says. defer_rank_checksums: the rank files are hashed on threads of their own
    (sha256 releases the GIL) while the caller goes on loading; the caller must call
    `Artifact.finish_checks()` before it uses what it read."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such artifact folder")
    mpath = path / "manifest.json"
    if not mpath.is_file() or mpath.is_symlink():
        raise UserError(f"{mpath}: missing (is {path} a dsc artifact?)")
    raw = mpath.read_bytes()
    if require_signature is not None:
        from dsc.runtime.signature import verify_signature

        verify_signature(path, raw, require_signature)
        verify = True
    manifest = read_json_object(mpath, raw)
    _check_manifest(path, manifest)
    files = _listed_files(path, manifest)
    tp = manifest.get("tp", 1)
    if ranks is not None and not all(type(r) is int and 0 <= r < tp for r in ranks):
        raise UserError(f"{path}: rank out of range for tp={tp}")
    wanted = [f"rank{r}.safetensors" for r in (range(tp) if ranks is None else ranks)]
    for r in wanted:
        if r not in files:
            raise UserError(f"{path / r}: missing rank file (artifact compiled for tp={tp})")
    for rel in files:
        if not (path / rel).is_file():
            rank_file = re.fullmatch(r"rank\d+\.safetensors", rel)
            raise UserError(
                f"{path / rel}: missing "
                + (f"rank file (artifact compiled for tp={tp})" if rank_file else "(listed in manifest.json)")
            )
    pending = None
    if verify:
        check = ["plan.json"] + [f for f in files if f.startswith("tokenizer/")]
        if defer_rank_checksums:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="dsc-checksum")
            pending = [(path / rel, files[rel], pool.submit(sha256_file, path / rel)) for rel in wanted]
            pool.shutdown(wait=False)
        else:
            check += wanted
        for rel in check:
            p = path / rel
            if sha256_file(p) != files[rel]:
                raise UserError(f"{p}: checksum mismatch (file changed or corrupt since compile)")
    try:
        plan = read_json_object(path / "plan.json")
    except UserError:  # unreadable even unverified: say why, when the checksum knows
        if sha256_file(path / "plan.json") != files["plan.json"]:
            raise UserError(
                f"{path / 'plan.json'}: checksum mismatch (file changed or corrupt since compile)"
            ) from None
        raise
    check_plan(path / "plan.json", plan, tp)
    return Artifact(path=path, manifest=manifest, plan=plan, pending_checks=pending)


def sign(artifact: str | Path, private_key: str | Path) -> Path:
    """Sign the artifact's manifest.json with PRIVATE_KEY (`dsc sign`); writes signature.json
    beside it. The artifact is checked first (listed files, checksums), so that only an intact
    artifact is signed."""
    from dsc.runtime.signature import write_signature

    art = open_artifact(artifact, ranks=None, verify=True)
    return write_signature(art.path, (art.path / "manifest.json").read_bytes(), private_key)
