"""Compile options: one validated pydantic model, built by the CLI, the Python API or a
(DeepSpeed-style) config file, and written into the artifact's manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsc.errors import UserError

TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90")  # `--target`: the GPU archs kernels compile for
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


class CompileOptions(BaseModel):
    """Everything that decides what `dsc compile` writes. Recorded in manifest.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="compute/storage dtype; default: the checkpoint's dtype"
    )
    tp: int = Field(1, ge=1, strict=True, description="tensor-parallel ranks")
    ep: int = Field(
        1,
        ge=1,
        strict=True,
        description="expert-parallel ranks: a mixture of experts' experts placed "
        "whole across the ranks (the rest tensor-parallel over them)",
    )
    max_batch: int = Field(8, ge=1, strict=True, description="largest batch the KV cache holds")
    max_seq: int = Field(512, ge=2, strict=True, description="longest sequence (prompt + generated)")
    block_size: Literal[16, 32] = Field(16, description="tokens per block of the paged KV cache (continuous batching)")
    # fusion (kernel injection)
    fuse: bool = Field(True, strict=True, description="run the fusion passes")
    # int8 quantization
    int8: bool = Field(False, strict=True, description="quantize linear weights to int8")
    int8_mode: Literal["w8a16", "w8a8"] = Field("w8a16", description="weight-only, or weights and activations")
    int8_group_size: int | None = Field(None, ge=1, strict=True, description="one scale per this many input channels")
    int8_q_groups: int | None = Field(
        None, ge=1, strict=True, description="DeepSpeed q_groups: scale groups per weight matrix"
    )
    int8_asymmetric: bool = Field(False, strict=True, description="asymmetric quantization with zero points")
    int8_lm_head: bool = Field(False, strict=True, description="also quantize lm_head")
    int8_skip: tuple[str, ...] = Field((), description="module-path patterns (fnmatch) kept unquantized")
    int8_min_sqnr: float | None = Field(None, description="fail the compile if logits SQNR (dB) is lower")
    calibrate: str | None = Field(None, description="calibration prompts file (SmoothQuant), one per line")
    # fp8 quantization (--int8-skip, --int8-lm-head and --int8-min-sqnr apply to it as well)
    fp8: bool = Field(False, strict=True, description="quantize linear weights and activations to fp8 (e4m3)")
    # a precision per linear layer (int4, int8 W8A16 or 16-bit), the cheapest meeting this logits SQNR
    auto_precision: float | None = Field(
        None,
        gt=0,
        description="choose int4/int8/16-bit per linear layer: the "
        "cheapest keeping the logits SQNR (dB) at or above this",
    )
    # int4 weights (as --fp8, the --int8-skip, --int8-lm-head and --int8-min-sqnr options apply)
    int4: bool = Field(False, strict=True, description="quantize linear weights to 4 bits in groups (W4A16)")
    int4_group_size: int | None = Field(
        None,
        ge=32,
        strict=True,
        description="input features per int4 scale "
        "group (a multiple of 32); default per layer: 32 for a GGUF file's 4-bit "
        "blocks, else the largest of 128, 64, 32 dividing its input features",
    )
    # encoders
    pooling: Literal["mean", "cls", "last"] | None = Field(
        None,
        description="how an encoder's token states become one embedding; default: the checkpoint's "
        "sentence-transformers config, else cls",
    )
    # kernels compiled ahead of time (compiler/kernel_binaries.py)
    targets: tuple[str, ...] = Field(
        (), description="GPU archs to compile the plan's Triton kernels for, into the artifact (no GPU needed)"
    )
    # runtime
    min_tokens: int = Field(
        0,
        ge=0,
        strict=True,
        description="default SamplingParams.min_tokens: tokens generated before a stop token or eos can end a sequence",
    )
    decode_buckets: tuple[int, ...] | None = Field(
        None, description="CUDA-graph batch buckets for decode; default powers of two up to max_batch"
    )

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for t in v:
            if t not in TARGETS:
                raise ValueError(f"--target: unknown GPU arch {t!r}; use one of {', '.join(TARGETS)}")
        return v

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        if v is None:
            return v
        key = str(v).lower()
        if key not in _DTYPE_ALIASES:
            why = {
                "int8": " (int8 weights: --int8)",
                "torch.int8": " (int8 weights: --int8)",
                "int4": " (4-bit weights: --int4)",
                "fp8": " (fp8 weights: --fp8)",
            }.get(key, "")
            raise ValueError(f"unknown dtype {v!r}; use one of fp32, fp16, bf16{why}")
        return _DTYPE_ALIASES[key]

    @model_validator(mode="before")
    @classmethod
    def _ep_ranks(cls, v: Any) -> Any:
        """--ep N runs on N ranks: tp defaults to N, and any other tp is refused."""
        if isinstance(v, dict) and isinstance(v.get("ep"), int) and v["ep"] > 1:
            if v.get("tp") in (None, 1):
                v = {**v, "tp": v["ep"]}
            elif v["tp"] != v["ep"]:
                raise ValueError(
                    f"ep {v['ep']} must equal tp {v['tp']}: the experts are placed over the "
                    "tensor-parallel ranks (give --ep alone)"
                )
        return v

    @model_validator(mode="after")
    def _check(self) -> CompileOptions:
        if sum((self.fp8, self.int8, self.int4, self.auto_precision is not None)) > 1:
            raise ValueError("--int8, --fp8, --int4 and --auto-precision: give one")
        if self.int4_group_size is not None and self.int4_group_size % 32:
            raise ValueError(f"int4_group_size {self.int4_group_size} is not a multiple of 32")
        if self.int4_group_size is not None and not self.int4 and self.auto_precision is None:
            raise ValueError("--int4-group-size needs --int4")
        if (self.int4 or self.auto_precision is not None) and (
            self.int8_group_size
            or self.int8_q_groups
            or self.int8_asymmetric
            or self.int8_mode != "w8a16"
            or self.calibrate
        ):
            raise ValueError(
                "--int4 and --auto-precision take --int4-group-size: the int8 grouping, zero-point, "
                "mode and calibration options do not apply"
            )
        if self.fp8 and (
            self.int8_group_size
            or self.int8_q_groups
            or self.int8_asymmetric
            or self.int8_mode != "w8a16"
            or self.calibrate
        ):
            raise ValueError(
                "--fp8 takes one scale per output channel and per token: the int8 grouping, "
                "zero-point, mode and calibration options do not apply"
            )
        if not (self.int8 or self.fp8 or self.int4 or self.auto_precision is not None) and (
            self.int8_group_size
            or self.int8_q_groups
            or self.int8_asymmetric
            or self.int8_lm_head
            or self.int8_mode != "w8a16"
            or self.int8_skip
            or self.calibrate
            or self.int8_min_sqnr is not None
        ):
            raise ValueError(
                "int8 options need --int8 (or --fp8 / --int4, for --int8-skip, --int8-lm-head and --int8-min-sqnr)"
            )
        if self.calibrate and self.int8_mode != "w8a8":
            raise ValueError("--calibrate (SmoothQuant) applies to --int8-mode w8a8")
        if self.min_tokens >= self.max_seq:
            raise ValueError(f"min_tokens {self.min_tokens} leaves no room for a prompt in max_seq {self.max_seq}")
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


def options_from_config_file(path: Path) -> dict[str, Any]:
    """Read a dsc or DeepSpeed inference config (JSON) into CompileOptions fields: dsc's own
    field names as they are, DeepSpeed's fields as compiler/deepspeed_config.py maps them."""
    from dsc.compiler.deepspeed_config import deepspeed_options, field_names

    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the config file ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object")
    ds_names = field_names() | {"quantization_setting"}
    # dsc's `tp` is a count; DeepSpeed's `tp` (an alias of tensor_parallel) an object
    own = {
        k: v
        for k, v in raw.items()
        if k in CompileOptions.model_fields and (k not in ds_names or (k == "tp" and not isinstance(v, dict)))
    }
    ds = {k: v for k, v in raw.items() if k not in own}
    mapped, source = deepspeed_options(Path(path), ds, dsc_int8=own.get("int8") is True)
    for option, value in mapped.items():
        if option in own and own[option] != value:
            raise UserError(f"{path}: field '{source[option]}' ({value!r}) contradicts '{option}' ({own[option]!r})")
    return {**mapped, **own}


def make_options(path_for_errors: str = "options", **fields: Any) -> CompileOptions:
    """Build CompileOptions, turning validation errors into one UserError line."""
    try:
        return CompileOptions(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise UserError(f"{path_for_errors}: field '{loc}': {msg}" if loc else f"{path_for_errors}: {msg}") from None
