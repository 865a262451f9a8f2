"""How an encoder's token states become one embedding, read from the checkpoint.

Embedding checkpoints published for sentence-transformers say it in their folder: modules.json
lists the modules in order (Transformer, Pooling, optionally Normalize), and the Pooling
module's config.json sets one `pooling_mode_*` flag. dsc compiles the Transformer and records
the pooling and normalization in the plan; the runtime applies them (runtime/embed.py), as
sentence-transformers' `encode` does. `--pooling` overrides the mode; without either, the
first token's state (CLS), normalized, as vLLM pools BERT-style models.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsc.errors import UserError

# sentence-transformers' Pooling flags -> dsc's modes
_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read it as JSON ({getattr(e, 'msg', None) or e})") from None


def sentence_transformers_modules(root: Path) -> list[dict] | None:
    """modules.json's entries ({"type", "path"}), None when the folder has none."""
    path = Path(root) / "modules.json"
    if not path.is_file():
        return None
    mods = _read(path)
    if not isinstance(mods, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str) for m in mods):
        raise UserError(f"{path}: expected a list of modules, each with a 'type'")
    return mods


def max_seq_length(root: Path) -> int | None:
    """sentence-transformers' truncation length (sentence_bert_config.json), where set."""
    path = Path(root) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    cfg = _read(path)
    n = cfg.get("max_seq_length") if isinstance(cfg, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 2 else None


def pooling_for(root: Path, override: str | None) -> dict:
    """{"mode": "mean" | "cls" | "last", "normalize": bool, "source": where it came from}."""
    mods = sentence_transformers_modules(root)
    if mods is None:
        return {"mode": override or "cls", "normalize": True, "source": "--pooling" if override else "default"}
    mode, normalize = None, False
    for m in mods:
        kind = m["type"].rsplit(".", 1)[-1]
        where = Path(root) / str(m.get("path") or "") / "config.json"
        if kind == "Pooling":
            cfg = _read(where)
            on = (
                [k for k, v in cfg.items() if k.startswith("pooling_mode") and v is True]
                if isinstance(cfg, dict)
                else []
            )
            if len(on) != 1 and override is None:
                raise UserError(
                    f"{where}: expected one pooling_mode_* set to true, got {on or 'none'} (choose one with --pooling)"
                )
            if on and on[0] in _UNSUPPORTED and override is None:
                raise UserError(
                    f"{where}: field '{on[0]}': dsc pools by mean, cls or last token (choose one with --pooling)"
                )
            mode = override or _MODES.get(on[0])
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise UserError(
                f"{Path(root) / 'modules.json'}: module {m['type']!r} is not compiled by dsc "
                "(supported: Transformer, Pooling, Normalize)"
            )
    if mode is None:
        mode = override or "cls"
    return {"mode": mode, "normalize": normalize, "source": "--pooling" if override else "modules.json"}
