"""Resolve and read a Hugging Face checkpoint without loading its weights.

MODEL is a local folder (config.json + model.safetensors, or sharded *.safetensors with
model.safetensors.index.json) or a hub id already in the local Hugging Face cache.
Every check here fails with one UserError line naming the file or field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsc.errors import UserError
from dsc.runtime.artifact import read_safetensors_header, sha256_file

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


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
    gguf: Any = None  # compiler.gguf_source.GGUFTensors: the weights are a GGUF file's (files[0])

    @property
    def config_where(self) -> Path:
        """Where the config came from, as messages name it: config.json, or the GGUF file."""
        return self.files[0] if self.gguf is not None else self.root / "config.json"

    def file_hashes(self) -> dict[str, str]:
        paths = {"config.json": self.root / "config.json"} | {p.name: p for p in self.files}
        return {n: sha256_file(p) for n, p in sorted(paths.items())}


def resolve_model_path(model: str) -> Path:
    p = Path(model)
    if p.exists():
        if not p.is_dir():
            raise UserError(f"{model}: expected a checkpoint folder (config.json + *.safetensors) or a .gguf file")
        return p
    if model.count("/") <= 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception as e:  # any failure means "not in the local cache"
            raise UserError(
                f"{model}: not a local folder, and not in the local Hugging Face cache "
                f"({type(e).__name__}); download it first with `hf download {model}`"
            ) from None
    raise UserError(f"{model}: no such folder")


def check_weight_dtype(info: TensorInfo, key: str) -> None:
    """A checkpoint tensor a model parameter loads from holds floating-point values."""
    if info.dtype not in FLOAT_DTYPES:
        raise UserError(
            f"{info.file}: tensor '{key}' is {info.dtype}; a weight must be one of {', '.join(FLOAT_DTYPES)}"
        )


def open_checkpoint(model: str) -> Checkpoint:
    root = resolve_model_path(model)
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise UserError(f"{cfg_path}: missing config.json")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path}: malformed JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(config, dict):
        raise UserError(f"{cfg_path}: expected a JSON object")
    if "model_type" not in config:
        raise UserError(f"{cfg_path}: missing field 'model_type'")

    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{index}: malformed index (expected a 'weight_map' object)") from None
        files = sorted({root / f for f in weight_map.values()})
    elif (root / "model.safetensors").exists():
        files = [root / "model.safetensors"]
    else:
        if list(root.glob("*.bin")) or list(root.glob("*.pt")):
            raise UserError(
                f"{root}: only PyTorch .bin weights found; dsc reads safetensors "
                "(convert with transformers' save_pretrained(safe_serialization=True))"
            )
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
    """The checkpoint's tokenizer files the artifact's tokenizer/ folder takes (paths under
    root): the tokenizer, its config, the generation defaults, and the chat templates as
    transformers saves them (chat_template.jinja, additional_chat_templates/NAME.jinja)."""
    names = [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "vocab.txt",
        "generation_config.json",
        "chat_template.jinja",
    ]
    files = [root / n for n in names if (root / n).is_file()]
    extra = root / "additional_chat_templates"
    if extra.is_dir():
        files += sorted(f for f in extra.iterdir() if f.suffix == ".jinja" and f.is_file())
    return files
