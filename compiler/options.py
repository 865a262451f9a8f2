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
    tp: int = Field(1, ge=1, strict=True, description="tensor-parallel ranks")
    max_batch: int = Field(8, ge=1, strict=True, description="largest batch the KV cache holds")
    max_seq: int = Field(512, ge=2, strict=True, description="longest sequence (prompt + generated)")
    block_size: Literal[16, 32] = Field(16, description="tokens per block of the paged KV cache (continuous batching)")
    # fusion (kernel injection)
    fuse: bool = Field(True, strict=True, description="run the fusion passes")
    # int8 quantization
    int8: bool = Field(False, strict=True, description="quantize linear weights to int8")
    int8_mode: Literal["w8a16", "w8a8"] = Field("w8a16", description="weight-only, or weights and activations")
    int8_group_size: int | None = Field(None, ge=1, strict=True, description="one scale per this many input channels")
    int8_q_groups: int | None = Field(None, ge=1, strict=True, description="DeepSpeed q_groups: scale groups per weight matrix")
    int8_asymmetric: bool = Field(False, strict=True, description="asymmetric quantization with zero points")
    int8_lm_head: bool = Field(False, strict=True, description="also quantize lm_head")
    int8_skip: tuple[str, ...] = Field((), description="module-path patterns (fnmatch) kept unquantized")
    int8_min_sqnr: float | None = Field(None, description="fail the compile if logits SQNR (dB) is lower")
    calibrate: str | None = Field(None, description="calibration prompts file (SmoothQuant), one per line")
    # runtime
    decode_buckets: tuple[int, ...] | None = Field(
        None, description="CUDA-graph batch buckets for decode; default powers of two up to max_batch")

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
        if not self.int8 and (self.int8_group_size or self.int8_q_groups or self.int8_asymmetric or self.int8_lm_head
                              or self.int8_mode != "w8a16" or self.int8_skip or self.calibrate
                              or self.int8_min_sqnr is not None):
            raise ValueError("int8 options need --int8")
        if self.calibrate and self.int8_mode != "w8a8":
            raise ValueError("--calibrate (SmoothQuant) applies to --int8-mode w8a8")
        if self.decode_buckets is not None:
            b = self.decode_buckets
            if not b or any(x < 1 for x in b) or list(b) != sorted(set(b)):
                raise ValueError("decode_buckets must be increasing positive batch sizes")
            if b[-1] > self.max_batch:
                raise ValueError(f"decode bucket {b[-1]} exceeds max_batch {self.max_batch}")
        return self

    def buckets(self) -> tuple[int, ...]:
        """The decode batch buckets: given, or 1, 2, 4, ... up to max_batch (always included)."""
        if self.decode_buckets:
            return tuple(self.decode_buckets)
        out, b = [], 1
        while b < self.max_batch:
            out.append(b)
            b *= 2
        return tuple(out + [self.max_batch])


# DeepSpeed inference config keys -> what dsc does with them.
_DS_ALIASES = {"dtype": "dtype", "max_out_tokens": "max_seq", "max_tokens": "max_seq"}
_DS_NOT_BUILT: dict[str, str] = {}
_DS_IGNORED_IF_DEFAULT: dict[str, tuple] = {}


def _ds_quant(path: Path, key: str, val: Any) -> dict[str, Any]:
    """DeepSpeed's `quant: {enabled, weight: {num_bits, q_groups}}` or
    `quantization_setting: q_groups | [mlp_extra_grouping, q_groups]` -> int8 options."""
    if val in (None, False, {}):
        return {}
    if key == "quantization_setting":
        groups = val[-1] if isinstance(val, (list, tuple)) and val else val
        if type(groups) is not int or groups < 1:
            raise UserError(f"{path}: field 'quantization_setting': expected q_groups (int) or [extra_grouping, q_groups]")
        return {"int8": True, "int8_group_size": None} if groups == 1 else {"int8": True, "int8_q_groups": groups}
    if not isinstance(val, dict):
        raise UserError(f"{path}: field 'quant' must be an object")
    extra = set(val) - {"enabled", "weight", "activation", "qkv"}
    if extra:
        raise UserError(f"{path}: unknown keys in 'quant': {', '.join(sorted(extra))}")
    for sub in ("weight", "activation", "qkv"):
        if not isinstance(val.get(sub) or {}, dict):
            raise UserError(f"{path}: field 'quant.{sub}' must be an object")
    flags = {"quant.enabled": val.get("enabled", True), "quant.activation.enabled": (val.get("activation") or {}).get("enabled", False)}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise UserError(f"{path}: field '{name}' must be true or false, got {flag!r}")
    if not val.get("enabled", True):
        return {}
    out: dict[str, Any] = {"int8": True}
    w = val.get("weight") or {}
    bits, groups = w.get("num_bits", 8), w.get("q_groups", 1)
    if type(bits) is not int or bits != 8:
        raise UserError(f"{path}: field 'quant.weight.num_bits': only the integer 8 is supported, got {bits!r}")
    if type(groups) is not int or groups < 1:
        raise UserError(f"{path}: field 'quant.weight.q_groups': expected an integer >= 1, got {groups!r}")
    if groups > 1:
        out["int8_q_groups"] = groups
    if flags["quant.activation.enabled"]:
        out["int8_mode"] = "w8a8"
    return out


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
        elif key == "replace_with_kernel_inject":
            out["fuse"] = val
        elif key == "enable_cuda_graph":
            if val is False:
                raise UserError(f"{path}: 'enable_cuda_graph': false is not supported; the dsc runtime "
                                "always replays CUDA graphs on GPU")
        elif key in ("quant", "quantization_setting"):
            out.update(_ds_quant(path, key, val))
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
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise UserError(f"{path_for_errors}: field '{loc}': {msg}" if loc else f"{path_for_errors}: {msg}")
