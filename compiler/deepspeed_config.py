"""DeepSpeed inference configs read into CompileOptions fields.

Every field of DeepSpeed's inference config (`DeepSpeedInferenceConfig` and its sub-configs in
deepspeed/inference/config.py; `deepspeed.init_inference(config=...)`) is declared here as
DeepSpeed declares it: name, alias, default, type. Each field is one of
  mapped    its value becomes a compile option (`dsc`: which one, and how);
  accepted  any value is consistent with what dsc does (`accepted`: why);
  refused   only DeepSpeed's default is accepted; any other value is one line naming the field
            and why dsc does not do it (`refused`).
Unknown keys are refused by name at any depth. As DeepSpeed reads it, a value "auto" (what Hugging
Face's integration writes) means the field's default. `quantization_setting`, an argument of
DeepSpeed's older `init_inference`, is read too. docs/deepspeed.md is generated from these
declarations (scripts/gen_docs.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from dsc.errors import UserError

# DeepSpeed's dtype spellings (DtypeEnum), case-insensitive here; int8 asks for int8 weights
DS_DTYPES = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "torch.float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "bfloat": "bf16",
    "torch.bfloat16": "bf16",
    "int8": "int8",
    "torch.int8": "int8",
}
# the attention input projections, as the supported architectures' checkpoints name them
QKV_MODULES = ("*.q_proj", "*.k_proj", "*.v_proj", "*.qkv_proj", "*.query_key_value", "*.c_attn")

_PY_OBJECT = "a Python object, which a JSON config cannot hold; dsc starts its own process groups"
_CKPT_EXPERTS = "the experts are the checkpoint's: dsc reads their count and top-k from its config.json"
_RESIDUAL_MOE = (
    "dsc runs the checkpoint's experts as transformers defines them; DeepSpeed's residual (PR-MoE) layers are not read"
)
_CHECKPOINT = (
    "dsc reads the Hugging Face checkpoint given as `dsc compile MODEL`; DeepSpeed checkpoint "
    "files and load policies are not read"
)


def mapped(default: Any, to: str, **kw: Any) -> Any:
    return Field(default, json_schema_extra={"dsc": to}, **kw)


def accepted(default: Any, why: str, **kw: Any) -> Any:
    return Field(default, json_schema_extra={"accepted": why}, **kw)


def refused(default: Any, why: str, **kw: Any) -> Any:
    return Field(default, json_schema_extra={"refused": why}, **kw)


class DSConfig(BaseModel):
    """A DeepSpeed config section: unknown keys refused, fields by name or alias, "auto" = default,
    values of their JSON type (no "8" for 8: a config is checked, not coerced)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _auto_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):  # DeepSpeedConfigModel drops "auto" values, replace_method's aside
            return {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto" and k != "replace_method")}
        return data


class TensorParallelConfig(DSConfig):
    enabled: bool = mapped(True, "false: `tp` 1 (refused with a tp_size above 1)")
    tp_size: int = mapped(1, "`tp`: ranks, one rank file each", ge=1)
    tp_grain_size: int = refused(64, "dsc splits heads and MLP columns evenly over the ranks, at no other granularity")
    mpu: Any = refused(None, _PY_OBJECT)
    tp_group: Any = refused(None, _PY_OBJECT)


class MoEConfig(DSConfig):
    enabled: bool = accepted(True, "whether a model has experts is its checkpoint's")
    ep_size: int = mapped(1, "`ep`: expert-parallel ranks (whole experts per rank)", ge=1)
    moe_experts: list = accepted([1], _CKPT_EXPERTS, alias="num_experts")
    type: Literal["standard", "residual"] = refused("standard", _RESIDUAL_MOE)
    ep_mp_group: Any = refused(None, _PY_OBJECT)
    ep_group: Any = refused(None, _PY_OBJECT, alias="expert_group")


class WeightQuantConfig(DSConfig):
    enabled: bool = mapped(True, "false: no int8 weights (refused with dtype int8)")
    num_bits: int = refused(
        8, "this config maps onto dsc's int8 options only; 4-bit weights are dsc's `int4` (groups of `int4_group_size`)"
    )
    q_type: Literal["symmetric", "asymmetric"] = mapped("symmetric", "asymmetric: `int8_asymmetric` (zero points)")
    q_groups: int = mapped(
        1,
        "`int8_q_groups`: scale groups per matrix (up to its rows: one scale per output "
        "channel, finer than DeepSpeed's)",
        ge=1,
    )
    quantized_initialization: dict = refused(
        {}, "ZeRO's quantization of parameters as they are created; dsc quantizes at compile time"
    )
    post_init_quant: dict = refused(
        {},
        "ZeRO's per-module quantization after loading; dsc quantizes every linear "
        "layer at compile time (`int8_skip` keeps some in 16-bit)",
    )


_W8A8 = "DeepSpeed's int8 inference keeps activations 16-bit; for W8A8 give dsc's `int8_mode: \"w8a8\"`"


class ActivationQuantConfig(DSConfig):
    enabled: bool = accepted(
        True,
        "as in DeepSpeed's int8 inference, activations stay 16-bit (W8A16) whatever this "
        'says; W8A8 is dsc\'s `int8_mode: "w8a8"`',
    )
    num_bits: int = refused(8, _W8A8)
    q_type: Literal["symmetric", "asymmetric"] = refused("symmetric", _W8A8)
    q_groups: int = refused(1, _W8A8, ge=1)


class QKVQuantConfig(DSConfig):
    enabled: bool = mapped(
        True, "false: the attention's q/k/v projections stay 16-bit (`int8_skip` " + ", ".join(QKV_MODULES) + ")"
    )


class QuantizationConfig(DSConfig):
    enabled: bool = mapped(True, "false: no int8 weights (refused with dtype int8)")
    activation: ActivationQuantConfig = mapped(ActivationQuantConfig(), "see quant.activation.*")
    weight: WeightQuantConfig = mapped(WeightQuantConfig(), "see quant.weight.*")
    qkv: QKVQuantConfig = mapped(QKVQuantConfig(), "see quant.qkv.*")


class CheckpointConfig(DSConfig):
    checkpoint_dir: str | None = refused(None, _CHECKPOINT)
    save_mp_checkpoint_path: str | None = refused(None, "dsc's artifact (`-o`) is already one weight file per rank")
    base_dir: str | None = refused(None, _CHECKPOINT)


# DeepSpeedZeroConfig's fields and aliases (deepspeed/runtime/zero/config.py) other than the three
# below: ZeRO's training and partitioning settings, which do nothing to an inference artifact
ZERO_SETTINGS = (
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "offload_optimizer",
    "zenflow",
    "sub_group_size",
    "cpu_offload_use_pin_memory",
    "cpu_offload",
    "prefetch_bucket_size",
    "stage3_prefetch_bucket_size",
    "param_persistence_threshold",
    "stage3_param_persistence_threshold",
    "model_persistence_threshold",
    "stage3_model_persistence_threshold",
    "max_live_parameters",
    "stage3_max_live_parameters",
    "max_reuse_distance",
    "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "leaf_module",
)
_ZERO_INFERENCE = (
    "ZeRO-Inference's parameter offload is chosen at load over the same artifact: `dsc generate|serve "
    "ART --offload cpu` (device cpu) or `--offload disk` (device nvme), with `--gpu-memory GIB` of "
    "weights kept on the GPU; the artifact does not depend on it"
)
_ZERO_STAGE = (
    "stage 3 is ZeRO-Inference's setting for its offload (see zero.offload_param); each rank holds its "
    "tensor-parallel shard, no data-parallel partition"
)
_ZERO_SETTING = "a ZeRO training or partitioning setting: no effect on an inference artifact"


class _ZeroBase(DSConfig):
    stage: int = accepted(0, _ZERO_STAGE, ge=0, le=3)
    offload_param: dict | None = accepted(None, _ZERO_INFERENCE)
    cpu_offload_param: bool | None = accepted(None, _ZERO_INFERENCE)

    @field_validator("offload_param", mode="before")
    @classmethod
    def _no_device_is_none(cls, v: Any) -> Any:
        return None if isinstance(v, dict) and v.get("device", "none") == "none" else v

    @field_validator("cpu_offload_param", mode="after")
    @classmethod
    def _false_is_none(cls, v: Any) -> Any:
        return v or None


ZeroConfig = create_model(
    "ZeroConfig", __base__=_ZeroBase, **{name: (Any, accepted(None, _ZERO_SETTING)) for name in ZERO_SETTINGS}
)


class InferenceConfig(DSConfig):
    """DeepSpeedInferenceConfig, field by field, in DeepSpeed's order."""

    replace_with_kernel_inject: bool = mapped(
        False,
        "`fuse`: true runs the fusion passes (dsc's kernel injection); "
        "false, DeepSpeed's default, compiles without them",
        alias="kernel_inject",
    )
    dtype: str = mapped(
        "fp16",
        "fp16, bf16, fp32 (any DeepSpeed spelling): `dtype`; int8 or torch.int8: `int8` "
        "(int8 weights, computing in the checkpoint's dtype or `--dtype`). Left out: the "
        "checkpoint's dtype, not DeepSpeed's fp16",
    )
    tensor_parallel: TensorParallelConfig = mapped(TensorParallelConfig(), "see tensor_parallel.*", alias="tp")
    enable_cuda_graph: bool = accepted(
        False,
        "graphs are the runtime's choice, not the artifact's: on CUDA it "
        "captures and replays them (`dsc.load(..., cuda_graphs=False)` does not)",
    )
    use_triton: bool = accepted(False, "dsc's GPU kernels are its own Triton kernels either way")
    triton_autotune: bool = refused(
        False,
        "dsc does not autotune at load: kernel configs come from "
        "kernels/tuning.json (scripts/tune_kernels.py, DSC_TUNING)",
    )
    zero: ZeroConfig = mapped(ZeroConfig(), "see zero.*")
    triangular_masking: bool = refused(True, "dsc compiles causal LMs: attention is always causal", alias="tm")
    moe: MoEConfig = mapped(MoEConfig(), "true, false or an object: see moe.*")
    keep_module_on_host: bool = refused(False, "the runtime loads each rank's weights onto its device")
    quant: QuantizationConfig = mapped(
        QuantizationConfig(),
        "see quant.*; applies to int8 weights: with dtype int8, "
        "or without a dtype when it is not empty; with a float dtype, as in "
        "DeepSpeed, it asks for nothing and may hold only defaults",
    )
    checkpoint: str | dict | None = refused(None, _CHECKPOINT)
    base_dir: str = refused("", _CHECKPOINT)
    set_empty_params: bool = refused(False, "dsc reads every weight from the checkpoint")
    save_mp_checkpoint_path: str | None = refused(None, "dsc's artifact (`-o`) is already one weight file per rank")
    checkpoint_config: CheckpointConfig = mapped(CheckpointConfig(), "see checkpoint_config.*", alias="ckpt_config")
    return_tuple: bool = refused(True, "an artifact has no Python modules whose outputs could change form")
    training_mp_size: int = refused(
        1, "DeepSpeed's model-parallel checkpoints are not read; dsc splits a Hugging Face checkpoint itself (`tp`)"
    )
    replace_method: str = refused("auto", 'deprecated in DeepSpeed ("no longer needed")')
    injection_policy: dict | None = refused(
        None,
        "maps Python classes to policies; dsc's fusion passes match the traced graph (`replace_with_kernel_inject`)",
        alias="injection_dict",
    )
    injection_policy_tuple: Any = refused(None, "the same, as a tuple of classes")
    config: dict | None = refused(
        None, "the model's Python config, which the checkpoint's config.json gives dsc", alias="args"
    )
    max_out_tokens: int = mapped(
        1024,
        "`max_seq`: prompt + generated tokens. Left out: dsc's default (512, or the "
        "model's max positions when smaller)",
        alias="max_tokens",
        ge=2,
    )
    min_out_tokens: int = mapped(
        1,
        "`min_tokens`: the artifact's default SamplingParams.min_tokens (tokens "
        "generated before a stop token can end a sequence)",
        alias="min_tokens",
        ge=0,
    )
    transposed_mode: bool = refused(False, "DeepSpeed's kernel weight layout; dsc's plan chooses its layouts")
    mp_size: int = mapped(1, "`tp` (DeepSpeed's deprecated spelling of tensor_parallel.tp_size)", ge=1)
    mpu: Any = refused(None, _PY_OBJECT)
    ep_size: int = mapped(1, "`ep` (as moe.ep_size)", ge=1)
    ep_group: Any = refused(None, _PY_OBJECT, alias="expert_group")
    ep_mp_group: Any = refused(None, _PY_OBJECT, alias="expert_mp_group")
    moe_experts: list = accepted([1], _CKPT_EXPERTS)
    moe_type: Literal["standard", "residual"] = refused("standard", _RESIDUAL_MOE)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        if not isinstance(v, str) or v.lower() not in DS_DTYPES:
            raise ValueError(
                f"unknown dtype {v!r}; use one of fp16, bf16, fp32, int8 (or DeepSpeed's spellings: "
                "torch.float16, half, bfloat16, float, torch.int8, ...)"
            )
        return DS_DTYPES[v.lower()]

    @field_validator("moe", mode="before")
    @classmethod
    def _moe_bool(cls, v: Any) -> Any:
        return {"enabled": v} if isinstance(v, bool) else v  # DeepSpeed: moe=True is MoEConfig(enabled=True)


# `init_inference(quantization_setting=...)`: q_groups, (mlp_extra_grouping, q_groups), or an object
QUANTIZATION_SETTING_KEYS = {"q_bits": 8, "q_type": "symmetric", "q_groups": 1, "mlp_extra_grouping": False}
QUANTIZATION_SETTING_DOC = (
    "DeepSpeed's older `init_inference` argument, which asks for int8 weights: q_groups (an "
    "integer), [mlp_extra_grouping, q_groups], or {q_bits, q_type, q_groups, "
    "mlp_extra_grouping}; q_groups: `int8_q_groups`, q_type: `int8_asymmetric`, q_bits: 8 "
    "only; mlp_extra_grouping: false only (dsc gives every matrix the same q_groups)"
)


def _aliases(model: type[BaseModel]) -> dict[str, str]:
    """key -> field name, for both spellings of every field."""
    out = {}
    for name, f in model.model_fields.items():
        out[name] = name
        if f.alias:
            out[f.alias] = name
    return out


def field_names(model: type[BaseModel] = InferenceConfig) -> set[str]:
    """Every key the section takes (names and aliases)."""
    return set(_aliases(model))


def _spellings(raw: dict, model: type[BaseModel], path: Path, where: str = "", written: str = "") -> dict[str, str]:
    """Dotted field name -> the key path as the config spells it (an alias, perhaps); one field
    given under two spellings is refused."""
    out: dict[str, str] = {}
    for key in raw:
        name = _aliases(model).get(key)
        if name is None:
            continue
        if f"{where}{name}" in out:
            raise UserError(f"{path}: field '{written}{key}': given twice, also as '{out[where + name]}'")
        out[f"{where}{name}"] = f"{written}{key}"
        sub = model.model_fields[name].annotation
        if isinstance(raw[key], dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            out.update(_spellings(raw[key], sub, path, f"{where}{name}.", f"{written}{key}."))
    return out


def _validation_error(path: Path, e: ValidationError) -> UserError:
    errs = e.errors()
    extra = [".".join(str(x) for x in err["loc"]) for err in errs if err["type"] == "extra_forbidden"]
    if extra:
        return UserError(
            f"{path}: unknown config keys: {', '.join(sorted(extra))} (neither dsc compile options "
            "nor fields of DeepSpeed's inference config)"
        )
    err = errs[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] != "value_error" and not isinstance(err.get("input"), (dict, list)):
        msg += f", got {err.get('input')!r}"
    return UserError(f"{path}: field '{loc}': {msg}")


def _check_refused(cfg: BaseModel, path: Path, spelled: dict[str, str], where: str = "") -> None:
    """Every field given at a value other than DeepSpeed's default that dsc refuses: one line."""
    for name in cfg.model_fields_set:
        info = type(cfg).model_fields[name]
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            _check_refused(value, path, spelled, f"{where}{name}.")
            continue
        why = (info.json_schema_extra or {}).get("refused")
        if why and value != info.default:
            field = spelled.get(where + name, where + name)
            raise UserError(
                f"{path}: field '{field}': {_show(value)} is not supported ({why}); "
                f"only DeepSpeed's default {_show(info.default)} is"
            )


def _show(v: Any) -> str:
    """A value as the JSON config spells it."""
    s = json.dumps(list(v) if isinstance(v, tuple) else v, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


def _given(cfg: BaseModel, dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    for p in parents:
        if p not in cfg.model_fields_set:
            return False
        cfg = getattr(cfg, p)
    return leaf in cfg.model_fields_set


def _non_default(cfg: BaseModel, where: str = "") -> list[str]:
    """Dotted names of the mapped fields given at a value other than their default."""
    out = []
    for name in sorted(cfg.model_fields_set):
        info = type(cfg).model_fields[name]
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            out += _non_default(value, f"{where}{name}.")
        elif value != info.default and "accepted" not in (info.json_schema_extra or {}):
            out.append(f"{where}{name}")
    return out


def quantization_setting(path: Path, val: Any) -> dict[str, Any]:
    """`quantization_setting` in any of its forms -> {q_groups, q_type} (or UserError)."""
    field = "field 'quantization_setting'"
    if isinstance(val, (list, tuple)):
        if len(val) != 2:
            raise UserError(
                f"{path}: {field}: expected q_groups, [mlp_extra_grouping, q_groups] or an object, got {_show(val)}"
            )
        val = {"mlp_extra_grouping": val[0], "q_groups": val[1]}
    elif not isinstance(val, dict):
        val = {"q_groups": val}
    unknown = sorted(set(val) - set(QUANTIZATION_SETTING_KEYS))
    if unknown:
        raise UserError(
            f"{path}: unknown config keys: {', '.join('quantization_setting.' + k for k in unknown)} "
            f"(it takes {', '.join(QUANTIZATION_SETTING_KEYS)})"
        )
    s = {**QUANTIZATION_SETTING_KEYS, **val}
    if type(s["q_groups"]) is not int or s["q_groups"] < 1:
        raise UserError(f"{path}: {field}: q_groups must be an integer >= 1, got {_show(s['q_groups'])}")
    if type(s["q_bits"]) is not int or s["q_bits"] != 8:
        raise UserError(
            f"{path}: {field}: q_bits {_show(s['q_bits'])} is not supported (this setting maps onto "
            "dsc's int8 options only; 4-bit weights are dsc's `int4`)"
        )
    if s["q_type"] not in ("symmetric", "asymmetric"):
        raise UserError(f"{path}: {field}: q_type must be 'symmetric' or 'asymmetric', got {_show(s['q_type'])}")
    if not isinstance(s["mlp_extra_grouping"], bool):
        raise UserError(
            f"{path}: {field}: mlp_extra_grouping must be true or false, got {_show(s['mlp_extra_grouping'])}"
        )
    if s["mlp_extra_grouping"]:
        raise UserError(
            f"{path}: {field}: mlp_extra_grouping true is not supported (twice the groups in the MLP's "
            "matrices): dsc gives every matrix the same q_groups"
        )
    return {"q_groups": s["q_groups"], "q_type": s["q_type"]}


class _Out:
    """The compile options the config sets, each from one config field (a second one must agree)."""

    def __init__(self, path: Path, spelled: dict[str, str]):
        self.path, self.spelled, self.fields, self.source = path, spelled, {}, {}

    def name(self, field: str) -> str:
        """A field as the config spells it."""
        return self.spelled.get(field, field)

    def set(self, option: str, value: Any, field: str) -> None:
        field = self.name(field)
        if option in self.fields and self.fields[option] != value:
            raise UserError(
                f"{self.path}: field '{field}' ({_show(value)}) contradicts '{self.source[option]}' "
                f"({_show(self.fields[option])}): both set {option}"
            )
        self.fields[option], self.source[option] = value, self.source.get(option, field)


def deepspeed_options(path: Path, raw: dict[str, Any], dsc_int8: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """A DeepSpeed inference config (minus dsc's own fields) -> (CompileOptions fields, the config
    field each came from). `dsc_int8`: the same file asks for int8 with dsc's own `int8` field."""
    raw = dict(raw)
    qs = raw.pop("quantization_setting", None)
    spelled = _spellings(raw, InferenceConfig, path)
    try:
        cfg = InferenceConfig.model_validate(raw)
    except ValidationError as e:
        raise _validation_error(path, e) from None
    _check_refused(cfg, path, spelled)
    out = _Out(path, spelled)
    given = cfg.model_fields_set
    if "replace_with_kernel_inject" in given:
        out.set("fuse", cfg.replace_with_kernel_inject, "replace_with_kernel_inject")
    dtype = cfg.dtype if "dtype" in given else None
    if dtype in ("fp16", "bf16", "fp32"):
        out.set("dtype", dtype, "dtype")
    tp = cfg.tensor_parallel
    if _given(cfg, "tensor_parallel.tp_size"):
        out.set("tp", tp.tp_size, "tensor_parallel.tp_size")
    if not tp.enabled:
        if tp.tp_size > 1:
            raise UserError(
                f"{path}: field '{out.name('tensor_parallel.enabled')}': false, with tp_size {tp.tp_size}: "
                "give one of them"
            )
        out.set("tp", 1, "tensor_parallel.enabled")
    if "mp_size" in given:
        out.set("tp", cfg.mp_size, "mp_size")
    for field, ep in (("ep_size", cfg.ep_size), ("moe.ep_size", cfg.moe.ep_size)):
        if _given(cfg, field) and ep > 1:  # 1, DeepSpeed's default, is dsc's too
            out.set("ep", ep, field)
    if "max_out_tokens" in given:
        out.set("max_seq", cfg.max_out_tokens, "max_out_tokens")
    if "min_out_tokens" in given:
        out.set("min_tokens", cfg.min_out_tokens, "min_out_tokens")
    _quant(cfg, dtype, qs, out, dsc_int8)
    return out.fields, out.source


def _quant(cfg: InferenceConfig, dtype: str | None, qs: Any, out: _Out, dsc_int8: bool) -> None:
    """dtype int8, `quant` and `quantization_setting` -> the int8 options."""
    path, q = out.path, cfg.quant
    setting = quantization_setting(path, qs) if qs is not None else None
    quant_given = "quant" in cfg.model_fields_set and bool(q.model_fields_set)
    enabled = q.enabled and q.weight.enabled
    off = "quant.enabled" if not q.enabled else "quant.weight.enabled"
    # what asks for int8 weights (the field that sets `int8`, None: dsc's own `int8` does)
    if dtype == "int8":
        want, why, field = True, "dtype int8", "dtype"
    elif dsc_int8:
        want, why, field = True, "int8", None
    elif setting is not None:
        want, why, field = True, "quantization_setting", "quantization_setting"
    else:
        want, why, field = dtype is None and quant_given and enabled, "quant", "quant"
    if want and not enabled:
        raise UserError(f"{path}: field '{out.name(off)}': false, but {why} asks for int8 weights")
    if setting is not None and dtype in ("fp16", "bf16", "fp32"):
        raise UserError(
            f"{path}: field 'quantization_setting': applies to int8 weights, and dtype is {dtype} "
            "(set dtype to int8, or remove it)"
        )
    if not want:
        unused = [f for f in _non_default(q, "quant.") if f not in ("quant.enabled", "quant.weight.enabled")]
        if unused:
            reason = (
                f"quant.{'weight.' if not q.weight.enabled and q.enabled else ''}enabled is false"
                if not enabled
                else f"DeepSpeed quantizes only with dtype int8, and dtype is {dtype}"
            )
            raise UserError(
                f"{path}: field '{out.name(unused[0])}': has no effect ({reason}); set dtype to int8, or remove it"
            )
        return
    if field:
        out.set("int8", True, field)
    w = q.weight
    groups, qtype = w.q_groups, w.q_type
    if setting is not None:
        for name, value, mine in (("q_groups", setting["q_groups"], groups), ("q_type", setting["q_type"], qtype)):
            if _given(cfg, f"quant.weight.{name}") and value != mine:
                raise UserError(
                    f"{path}: field 'quantization_setting' ({name} {_show(value)}) contradicts "
                    f"'{out.name('quant.weight.' + name)}' ({_show(mine)})"
                )
        groups, qtype = setting["q_groups"], setting["q_type"]
    src = "quantization_setting" if setting is not None else "quant.weight"
    if groups > 1:
        out.set("int8_q_groups", groups, f"{src}.q_groups" if setting is None else src)
    if qtype == "asymmetric":
        out.set("int8_asymmetric", True, f"{src}.q_type" if setting is None else src)
    if not q.qkv.enabled:
        out.set("int8_skip", QKV_MODULES, "quant.qkv.enabled")


# -- docs/deepspeed.md ---------------------------------------------------------------------------
SECTIONS = [
    ("", InferenceConfig),
    ("tensor_parallel.", TensorParallelConfig),
    ("moe.", MoEConfig),
    ("quant.", QuantizationConfig),
    ("quant.weight.", WeightQuantConfig),
    ("quant.activation.", ActivationQuantConfig),
    ("quant.qkv.", QKVQuantConfig),
    ("checkpoint_config.", CheckpointConfig),
    ("zero.", _ZeroBase),
]


def _default_text(f) -> str:
    d = f.default
    if isinstance(d, BaseModel):
        return "`{}`"
    return "`" + ("null" if d is None else str(d).lower() if isinstance(d, bool) else repr(d).replace("'", '"')) + "`"


def markdown() -> str:
    """The mapping table of every field, for docs/deepspeed.md."""
    out = [
        "# DeepSpeed inference configs\n\n",
        "`dsc compile --config FILE` (and `dsc.compile(..., config_file=FILE)`) takes a DeepSpeed inference "
        "config: the JSON of `deepspeed.init_inference(config=...)`, whose fields DeepSpeed declares in "
        "`DeepSpeedInferenceConfig` (deepspeed/inference/config.py). The same file may also hold dsc's own "
        "option names (`max_batch`, `int8_mode`, ...); command-line flags win over the file.\n\n",
        "Every DeepSpeed field is mapped to a compile option, accepted (any value agrees with what dsc does), "
        "or refused: only DeepSpeed's default is accepted, and any other value stops the compile with one line "
        "naming the field and why. A key that is neither a DeepSpeed field nor a dsc option, at any depth, is "
        'refused by name. A value `"auto"` means the field\'s default, as DeepSpeed reads it. Two spellings of '
        "one field (`kernel_inject` and `replace_with_kernel_inject`), or two fields that set one option to "
        "different values (`mp_size` and `tensor_parallel.tp_size`), are refused.\n\n",
        "Generated from `compiler/deepspeed_config.py` by `python scripts/gen_docs.py`; do not edit by hand.\n\n",
        "| field | aliases | DeepSpeed's default | in dsc |\n|---|---|---|---|\n",
    ]
    for prefix, model in SECTIONS:
        for name, f in model.model_fields.items():
            extra = f.json_schema_extra or {}
            if "dsc" in extra:
                what = "mapped: " + extra["dsc"]
            elif "accepted" in extra:
                what = "accepted: " + extra["accepted"]
            else:
                what = "refused: " + extra["refused"]
            alias = f"`{prefix}{f.alias}`" if f.alias else ""
            out.append(f"| `{prefix}{name}` | {alias} | {_default_text(f)} | {what} |\n")
    out.append(
        f"| `zero.*`: the other {len(ZERO_SETTINGS)} fields and aliases of `DeepSpeedZeroConfig` | | "
        f"DeepSpeed's | accepted: {_ZERO_SETTING} |\n"
    )
    out.append(f"| `quantization_setting` | | (none) | mapped: {QUANTIZATION_SETTING_DOC} |\n")
    return "".join(out)
