"""Compile options: one validated pydantic model, built by the CLI, the Python API or a
(DeepSpeed-style) config file, and written into the artifact's manifest."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsc.errors import UserError

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


class CompileOptions(BaseModel):
    """Everything that decides what `dsc compile` writes. Recorded in manifest.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="compute/storage dtype; default: the checkpoint's dtype")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks")
    max_batch: int = Field(8, ge=1, description="largest batch the KV cache holds")
    max_seq: int = Field(512, ge=2, description="longest sequence (prompt + generated)")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        if v is None:
            return v
        key = str(v).lower()
        if key not in _DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {v!r}; use one of fp32, fp16, bf16")
        return _DTYPE_ALIASES[key]

    @model_validator(mode="after")
    def _check(self) -> "CompileOptions":
        return self


# DeepSpeed inference config keys -> what dsc does with them.
_DS_ALIASES = {"dtype": "dtype", "max_out_tokens": "max_seq", "max_tokens": "max_seq"}
_DS_NOT_BUILT = {
    "replace_with_kernel_inject": "kernel injection is dsc's fusion passes (not built yet)",
    "enable_cuda_graph": "CUDA-graph capture is done by the runtime (not built yet)",
    "quant": "int8 quantization (`--int8`) is not built yet",
    "quantization_setting": "int8 quantization (`--int8`) is not built yet",
}
_DS_IGNORED_IF_DEFAULT = {"replace_with_kernel_inject": (False,), "enable_cuda_graph": (False,)}


def options_from_config_file(path: Path) -> dict[str, Any]:
    """Read a dsc or DeepSpeed inference config (JSON) into CompileOptions fields."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found")
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object")
    fields = set(CompileOptions.model_fields)
    out: dict[str, Any] = {}
    unknown = []
    for key, val in raw.items():
        if key in fields:
            out[key] = val
        elif key in _DS_ALIASES:
            out[_DS_ALIASES[key]] = val
        elif key == "tensor_parallel":
            if not isinstance(val, dict):
                raise UserError(f"{path}: field 'tensor_parallel' must be an object")
            extra = set(val) - {"tp_size", "enabled"}
            if extra:
                raise UserError(f"{path}: unknown keys in 'tensor_parallel': {', '.join(sorted(extra))}")
            if "tp_size" in val:
                out["tp"] = val["tp_size"]
        elif key == "mp_size":
            out["tp"] = val
        elif key in _DS_NOT_BUILT:
            if val in _DS_IGNORED_IF_DEFAULT.get(key, ()) or val in (None, {}, False):
                continue
            raise UserError(f"{path}: option '{key}' is not supported yet: {_DS_NOT_BUILT[key]}")
        else:
            unknown.append(key)
    if unknown:
        raise UserError(f"{path}: unknown config keys: {', '.join(sorted(unknown))}")
    return out


def make_options(path_for_errors: str = "options", **fields: Any) -> CompileOptions:
    """Build CompileOptions, turning validation errors into one UserError line."""
    try:
        return CompileOptions(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "options"
        raise UserError(f"{path_for_errors}: field '{loc}': {err['msg']}")
