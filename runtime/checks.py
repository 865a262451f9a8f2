"""Checks of values a user hands the runtime, shared by every entry point (the Python API, the
CLI, the server, the compiler's tools): each raises one UserError line naming the field."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeGuard

from dsc.errors import UserError


def is_int(x: Any) -> TypeGuard[int]:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_token_ids(ids: Iterable[Any], vocab_size: int, where: str) -> list[int]:
    """ids as a list, each an integer within the vocabulary; else UserError naming `where` and the
    first bad id."""
    out = list(ids)
    for t in out:
        if not is_int(t):
            raise UserError(f"{where}: expected integer token ids, got {t!r}")
        if not 0 <= t < vocab_size:
            raise UserError(f"{where}: token id {t} is outside the vocabulary (0..{vocab_size - 1})")
    return out
