"""Write the artifact: plan.json, rank{i}.safetensors, tokenizer/, manifest.json.

Everything goes to a temporary folder beside the destination, moved into place at the end:
an interrupted or failed compile leaves nothing at the destination. An existing artifact is
replaced by one atomic exchange (renameat2 RENAME_EXCHANGE on Linux), so the destination is
never missing; where the exchange is unavailable, two renames, and a compile that died between
them is recovered by the next compile to the same destination. The temporary folder is removed
on an error, Ctrl-C or SIGTERM, and a killed compile's leftovers are removed by the next compile
to the same destination. Output is deterministic: sorted keys, no timestamps or addresses.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsc.compiler import kernel_binaries
from dsc.compiler.ir import Model
from dsc.compiler.rank_files import Timing, write_rank_files
from dsc.compiler.serialize import program_nodes
from dsc.compiler.source import Checkpoint, tokenizer_files
from dsc.compiler.validate import check_destination
from dsc.errors import UserError
from dsc.runtime.artifact import FORMAT, FORMAT_VERSION, PROGRAM_INPUTS, UNLISTED, sha256_file


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True) + "\n"


def _experts_facts(model) -> dict:
    """A mixture of experts' shape, for `dsc inspect`: experts per MoE layer, routed per token,
    per rank (expert parallelism places E / tp whole experts on each rank)."""
    experts = model.arch.experts(model.config)
    if not experts:
        return {}
    per_rank = experts // model.options.tp if model.options.ep > 1 else experts
    return {
        "experts": {
            "experts": experts,
            "top_k": model.config.get("num_experts_per_tok"),
            "per_rank": per_rank,
            "placement": "expert-parallel"
            if model.options.ep > 1
            else "tensor-parallel"
            if model.options.tp > 1
            else "one rank",
        }
    }


def _encoder_facts(model, ckpt: Checkpoint) -> dict:
    """An encoder's plan facts: its kind, the pad token its rows are padded with, its width, and
    how the runtime pools token states into one embedding (compiler/pooling.py)."""
    if model.arch.kind != "encoder":
        return {}
    from dsc.compiler.pooling import pooling_for

    cfg = ckpt.config
    return {
        "kind": "encoder",
        "pad_token_id": cfg.get("pad_token_id") or 0,
        "hidden_size": model.arch.hidden(cfg),
        "pooling": pooling_for(ckpt.root, model.options.pooling),
    }


def _eos_ids(ckpt: Checkpoint) -> list[int]:
    ids = ckpt.config.get("eos_token_id")
    gen = ckpt.root / "generation_config.json"
    if gen.exists():
        try:
            ids = json.loads(gen.read_text()).get("eos_token_id", ids)
        except json.JSONDecodeError:
            pass
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def build_plan(model: Model, ckpt: Checkpoint, dtype: str) -> dict:
    opts = model.options
    programs = {}
    for name, graph in model.graphs():
        nodes = program_nodes(graph, model.sym_names.get(name, {}))
        for n in nodes:  # the pool's block count is the runtime's choice (runtime/kv_pool.py)
            if n["kind"] == "weight" and n["target"].startswith("kv_pool."):
                n["shape"][0] = "pool_blocks"
        programs[name] = {"inputs": PROGRAM_INPUTS[name], "nodes": nodes}
    cfg = ckpt.config
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": {
            "model_type": cfg["model_type"],
            "vocab_size": cfg["vocab_size"],
            "eos_token_ids": _eos_ids(ckpt),
            "bos_token_id": cfg.get("bos_token_id"),
            "dtype": dtype,
            "layers": model.arch.layers(cfg),
            **_experts_facts(model),
            **_encoder_facts(model, ckpt),
        },
        "limits": {"max_batch": opts.max_batch, "max_seq": opts.max_seq, "decode_buckets": list(opts.buckets())},
        "tp": opts.tp,
        "kv_cache": model.kv_cache,
        "kv_pool": model.kv_pool,
        "programs": programs,
        "notes": model.notes,
        "passes": {k: v for k, v in sorted(model.counters.items())},
    }


_SCRATCH = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(-[0-9a-f]+)?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _recover_leftovers(out: Path) -> None:
    """Scratch folders of compiles to `out` whose process is gone (killed with SIGKILL, or a
    power cut): a `.tmp-` folder is removed; an `.old-` folder is the previous artifact when a
    two-rename replacement died between its renames, and is put back when `out` is missing."""
    if not out.parent.is_dir():
        return
    for p in sorted(out.parent.iterdir()):
        m = _SCRATCH.match(p.name)
        if not m or m["name"] != out.name or _alive(int(m["pid"])):
            continue
        if m["kind"] == "old" and not out.exists() and (p / "manifest.json").exists():
            os.rename(p, out)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _prepare_destination(out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _recover_leftovers(out)
    check_destination(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE). False where the
    platform or file system lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished artifact `tmp` to `out`. A compile that loses a race to a new
    destination ends in one UserError line; the winner's artifact stays whole."""
    if out.exists():
        if _exchange(tmp, out):
            shutil.rmtree(tmp)  # now the previous artifact
            return
        old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
        return
    try:
        tmp.rename(out)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise UserError(
            f"{out}: another compile wrote this destination at the same time; "
            "its artifact was kept and this one discarded"
        ) from None


@contextlib.contextmanager
def _removed_on_termination(tmp: Path):
    """Remove `tmp` on any exception, Ctrl-C included, and turn SIGTERM/SIGHUP into an
    exception while the block runs (in the main thread), so a terminated compile cleans up too."""

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            saved[sig] = signal.signal(sig, terminate)
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def emit(
    model: Model,
    ckpt: Checkpoint,
    out: Path,
    dtype: str,
    command: list[str],
    on_bytes: Callable[[int], None] | None = None,
    extra_manifest: dict | None = None,
    before_manifest: Callable[[Path, dict | None], dict] | None = None,
    on_timing: Timing | None = None,
) -> Path:
    """Write the artifact at `out`. `before_manifest(folder, weight_sqnr)` runs once the rank
    files are in the (temporary) folder, before the manifest: it may read them, and returns
    more manifest entries (an exception leaves nothing at `out`). `weight_sqnr`: the int8
    report's per-layer weight SQNR, measured as the weights were written (None without --int8)."""
    out = Path(out)
    tmp = _prepare_destination(out)
    with _removed_on_termination(tmp):
        world = model.options.tp
        plan = build_plan(model, ckpt, dtype)
        (tmp / "plan.json").write_text(_json(plan))
        binaries = None
        if model.options.targets:
            t0 = time.perf_counter()
            binaries = kernel_binaries.write(tmp, plan, sorted(set(model.options.targets)))
            print(kernel_binaries.summary(binaries))
            if on_timing:
                on_timing("emit.kernel binaries", time.perf_counter() - t0)
        written = write_rank_files(
            model,
            ckpt,
            tmp,
            on_bytes=on_bytes,
            on_timing=on_timing,
            weight_sqnr=before_manifest is not None
            and (
                model.options.int8
                or model.options.fp8
                or model.options.int4
                or model.options.auto_precision is not None
            ),
        )
        extra = dict(extra_manifest or {})
        if binaries is not None:
            extra["kernel_binaries"] = binaries
        if before_manifest is not None:
            extra.update(before_manifest(tmp, written.weight_sqnr))
        toks = tokenizer_files(ckpt.root)
        for f in toks:
            dst = tmp / "tokenizer" / f.relative_to(ckpt.root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
        t0 = time.perf_counter()
        files = _file_hashes(tmp)
        if on_timing:
            on_timing("emit.hash artifact", time.perf_counter() - t0)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "versions": _versions(),
            "source": {"model": ckpt.name, "model_type": ckpt.config["model_type"], "files": written.source_hashes},
            "options": model.options.model_dump(mode="json"),
            "dtype": dtype,
            "tp": world,
            "command": command,
            "files": files,
            "passes": {k: v for k, v in sorted(model.counters.items())},
        }
        manifest.update(extra)
        (tmp / "manifest.json").write_text(_json(manifest))
        _publish(tmp, out)
    return out


def _file_hashes(root: Path) -> dict[str, str]:
    """runtime.artifact.file_hashes(root), two files at a time (sha256 and reads release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    names = [n for n in names if n not in UNLISTED]
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(root / n), names)))


def _versions() -> dict[str, str]:
    import transformers

    import dsc

    return {"dsc": dsc.__version__, "torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}
