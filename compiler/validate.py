"""Checks of the options against the model, before any tracing."""
from __future__ import annotations

from dsc.compiler.architectures import Architecture
from dsc.compiler.source import Checkpoint
from dsc.errors import UserError


def validate_options(ckpt: Checkpoint, arch: Architecture, options) -> None:
    cfg = ckpt.config
    max_pos = arch.max_positions(cfg)
    if max_pos and options.max_seq > max_pos:
        raise UserError(f"--max-seq {options.max_seq} exceeds the model's max_position_embeddings ({max_pos}) "
                        f"in {ckpt.root / 'config.json'}")
