"""Edits of a copied artifact as an attacker would make them: change a file, then recompute the
manifest's sha256 list (runtime/artifact.py's own `file_hashes`), so that only the loader's
structural checks, not the checksums, stand between the edit and the runtime."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dsc.runtime.artifact import file_hashes


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def rehash(art: Path, drop: tuple[str, ...] = (), extra: dict[str, str] | None = None) -> None:
    """Rewrite manifest.json's file list to the folder's current files and their sha256 (less
    `drop`, plus `extra` entries verbatim)."""
    m = read_json(art / "manifest.json")
    files = {k: v for k, v in file_hashes(art).items() if k not in drop}
    m["files"] = {**files, **(extra or {})}
    write_json(art / "manifest.json", m)
