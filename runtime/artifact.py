"""Read an artifact: manifest and plan, with format-version and checksum checks.

Only torch-free stdlib here; errors a user can cause are `UserError` with one line naming
the file or field.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dsc.errors import UserError

FORMAT = "dsc-artifact"
FORMAT_VERSION = 1


@dataclass
class Artifact:
    path: Path
    manifest: dict
    plan: dict

    @property
    def tp(self) -> int:
        return int(self.plan["tp"])

    def rank_file(self, rank: int) -> Path:
        return self.path / f"rank{rank}.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 24):
            h.update(b)
    return h.hexdigest()


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise UserError(f"{path}: missing (is {path.parent} a dsc artifact?)")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})")
    if not isinstance(d, dict):
        raise UserError(f"{path}: expected a JSON object")
    return d


def open_artifact(path: str | Path, ranks: list[int] | None = None, verify: bool = True) -> Artifact:
    """Open and check an artifact. With `verify`, every file this process reads (plan,
    tokenizer and the rank files in `ranks`; all rank files when ranks is None) must match
    the sha256 the manifest records."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such artifact folder")
    manifest = _read_json(path / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise UserError(f"{path / 'manifest.json'}: not a dsc artifact (field 'format' is {manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path / 'manifest.json'}: artifact format version {manifest.get('format_version')!r}, "
                        f"this dsc reads version {FORMAT_VERSION}; recompile with this dsc")
    files = manifest.get("files")
    if not isinstance(files, dict) or "plan.json" not in files:
        raise UserError(f"{path / 'manifest.json'}: field 'files' is missing or incomplete")
    tp = int(manifest.get("tp", 1))
    wanted = [f"rank{r}.safetensors" for r in (range(tp) if ranks is None else ranks)]
    for r in wanted:
        if not (path / r).exists():
            raise UserError(f"{path / r}: missing rank file (artifact compiled for tp={tp})")
    if verify:
        check = ["plan.json"] + wanted + [f for f in files if f.startswith("tokenizer/")]
        for rel in check:
            p = path / rel
            if rel not in files:
                raise UserError(f"{path / 'manifest.json'}: no checksum recorded for {rel}")
            if not p.exists():
                raise UserError(f"{p}: missing")
            if _sha256(p) != files[rel]:
                raise UserError(f"{p}: checksum mismatch (file changed or corrupt since compile)")
    try:
        plan = _read_json(path / "plan.json")
    except UserError:  # unreadable even unverified: say why, when the checksum knows
        if path.joinpath("plan.json").exists() and _sha256(path / "plan.json") != files["plan.json"]:
            raise UserError(f"{path / 'plan.json'}: checksum mismatch (file changed or corrupt since compile)")
        raise
    if plan.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path / 'plan.json'}: plan format version {plan.get('format_version')!r}, expected {FORMAT_VERSION}")
    return Artifact(path=path, manifest=manifest, plan=plan)
