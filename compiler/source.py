"""Resolve and read a Hugging Face checkpoint without loading its weights.

MODEL is a local folder (config.json + model.safetensors, or sharded *.safetensors with
model.safetensors.index.json) or a hub id already in the local Hugging Face cache.
Every check here fails with one UserError line naming the file or field.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from dsc.errors import UserError

_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                   "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype tag, e.g. "BF16"
    shape: tuple[int, ...]


@dataclass
class Checkpoint:
    root: Path
    name: str  # as the user gave it
    config: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def file_hashes(self) -> dict[str, str]:
        names = ["config.json"] + [p.name for p in self.files]
        return {n: sha256_file(self.root / n) for n in sorted(set(names))}


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def resolve_model_path(model: str) -> Path:
    p = Path(model)
    if p.exists():
        if not p.is_dir():
            raise UserError(f"{model}: expected a checkpoint folder (config.json + *.safetensors)")
        return p
    if model.count("/") <= 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
            return Path(snapshot_download(model, local_files_only=True))
        except Exception as e:  # any failure means "not in the local cache"
            raise UserError(
                f"{model}: not a local folder, and not in the local Hugging Face cache "
                f"({type(e).__name__}); download it first with `hf download {model}`")
    raise UserError(f"{model}: no such folder")


def read_safetensors_header(path: Path) -> dict:
    """Parse and sanity-check a safetensors header; catches truncated or corrupt files."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise UserError(f"{path}: corrupt safetensors file (header length {n} exceeds file size)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: corrupt safetensors file (header is not valid JSON)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = info["data_offsets"]
            nbytes = _ST_DTYPE_BYTES[info["dtype"]]
            for d in info["shape"]:
                nbytes *= d
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: corrupt safetensors header entry for tensor '{name}'")
        if hi - lo != nbytes:
            raise UserError(f"{path}: corrupt safetensors file (tensor '{name}' has the wrong size)")
        end = max(end, hi)
    if 8 + n + end != size:
        raise UserError(
            f"{path}: truncated or corrupt safetensors file "
            f"({size} bytes, header says {8 + n + end})")
    return header


def open_checkpoint(model: str) -> Checkpoint:
    root = resolve_model_path(model)
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise UserError(f"{cfg_path}: missing config.json")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path}: malformed JSON ({e.msg} at line {e.lineno})")
    if not isinstance(config, dict):
        raise UserError(f"{cfg_path}: expected a JSON object")
    if "model_type" not in config:
        raise UserError(f"{cfg_path}: missing field 'model_type'")

    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{index}: malformed index (expected a 'weight_map' object)")
        files = sorted({root / f for f in weight_map.values()})
    elif (root / "model.safetensors").exists():
        files = [root / "model.safetensors"]
    else:
        if list(root.glob("*.bin")) or list(root.glob("*.pt")):
            raise UserError(f"{root}: only PyTorch .bin weights found; dsc reads safetensors "
                            "(convert with transformers' save_pretrained(safe_serialization=True))")
        raise UserError(f"{root}: no model.safetensors or model.safetensors.index.json")

    ckpt = Checkpoint(root=root, name=model, config=config, files=files)
    for f in files:
        if not f.exists():
            raise UserError(f"{f}: weight file named in the index is missing")
        for name, info in read_safetensors_header(f).items():
            if name != "__metadata__":
                ckpt.tensors[name] = TensorInfo(f, info["dtype"], tuple(info["shape"]))
    return ckpt


def tokenizer_files(root: Path) -> list[Path]:
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json"]
    return [root / n for n in names if (root / n).is_file()]


