"""`--config` with a DeepSpeed inference config: every field of DeepSpeed's
DeepSpeedInferenceConfig (deepspeed/inference/config.py, with its sub-configs) is mapped to a
compile option or refused by name; DeepSpeed's defaults are accepted; nothing is dropped.

DS_FIELDS below is DeepSpeed's field list, written out from its source (not read from dsc), so a
field dsc does not declare fails here. Most tests only read the config; two compile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

import dsc
from dsc.compiler.deepspeed_config import QKV_MODULES, SECTIONS, ZERO_SETTINGS, InferenceConfig
from dsc.compiler.options import make_options, options_from_config_file
from dsc.errors import UserError

REFUSED = "refused"
# (dotted field, alias, DeepSpeed's default, another value, the options that value gives or REFUSED);
# quant.* without a dtype ask for int8 weights (with a float dtype they would ask for nothing)
DS_FIELDS = [
    ("replace_with_kernel_inject", "kernel_inject", False, True, {"fuse": True}),
    ("dtype", None, "torch.float16", "torch.int8", {"int8": True}),
    ("tensor_parallel.enabled", None, True, False, {"tp": 1}),
    ("tensor_parallel.tp_size", None, 1, 2, {"tp": 2}),
    ("tensor_parallel.tp_grain_size", None, 64, 128, REFUSED),
    ("tensor_parallel.mpu", None, None, "mpu", REFUSED),
    ("tensor_parallel.tp_group", None, None, "group", REFUSED),
    ("enable_cuda_graph", None, False, True, {}),
    ("use_triton", None, False, True, {}),
    ("triton_autotune", None, False, True, REFUSED),
    ("zero.stage", None, 0, 3, {}),
    ("zero.offload_param", None, None, {"device": "cpu"}, {}),
    ("zero.cpu_offload_param", None, None, True, {}),
    ("triangular_masking", "tm", True, False, REFUSED),
    ("moe.enabled", None, True, False, {}),
    ("moe.ep_size", None, 1, 2, {"ep": 2}),
    ("moe.moe_experts", "num_experts", [1], [8], {}),
    ("moe.type", None, "standard", "residual", REFUSED),
    ("moe.ep_mp_group", None, None, "group", REFUSED),
    ("moe.ep_group", "expert_group", None, "group", REFUSED),
    ("keep_module_on_host", None, False, True, REFUSED),
    ("quant.enabled", None, True, False, {}),
    ("quant.weight.enabled", None, True, False, {}),
    ("quant.weight.num_bits", None, 8, 4, REFUSED),
    ("quant.weight.q_type", None, "symmetric", "asymmetric", {"int8": True, "int8_asymmetric": True}),
    ("quant.weight.q_groups", None, 1, 4, {"int8": True, "int8_q_groups": 4}),
    ("quant.weight.quantized_initialization", None, {}, {"num_bits": 8}, REFUSED),
    ("quant.weight.post_init_quant", None, {}, {"fc1": {"num_bits": 8}}, REFUSED),
    ("quant.activation.enabled", None, True, False, {"int8": True}),
    ("quant.activation.num_bits", None, 8, 4, REFUSED),
    ("quant.activation.q_type", None, "symmetric", "asymmetric", REFUSED),
    ("quant.activation.q_groups", None, 1, 2, REFUSED),
    ("quant.qkv.enabled", None, True, False, {"int8": True, "int8_skip": QKV_MODULES}),
    ("checkpoint", None, None, "checkpoint.json", REFUSED),
    ("base_dir", None, "", "/models", REFUSED),
    ("set_empty_params", None, False, True, REFUSED),
    ("save_mp_checkpoint_path", None, None, "/out", REFUSED),
    ("checkpoint_config.checkpoint_dir", None, None, "/ckpt", REFUSED),
    ("checkpoint_config.save_mp_checkpoint_path", None, None, "/out", REFUSED),
    ("checkpoint_config.base_dir", None, None, "/models", REFUSED),
    ("return_tuple", None, True, False, REFUSED),
    ("training_mp_size", None, 1, 2, REFUSED),
    ("replace_method", None, "auto", "layer", REFUSED),
    ("injection_policy", "injection_dict", None, {"LlamaDecoderLayer": ["o_proj"]}, REFUSED),
    ("injection_policy_tuple", None, None, ["o_proj"], REFUSED),
    ("config", "args", None, {"hidden_size": 64}, REFUSED),
    ("max_out_tokens", "max_tokens", 1024, 64, {"max_seq": 64}),
    ("min_out_tokens", "min_tokens", 1, 3, {"min_tokens": 3}),
    ("transposed_mode", None, False, True, REFUSED),
    ("mp_size", None, 1, 2, {"tp": 2}),
    ("mpu", None, None, "mpu", REFUSED),
    ("ep_size", None, 1, 2, {"ep": 2}),
    ("ep_group", "expert_group", None, "group", REFUSED),
    ("ep_mp_group", "expert_mp_group", None, "group", REFUSED),
    ("moe_experts", None, [1], [4], {}),
    ("moe_type", None, "standard", "residual", REFUSED),
]
# sub-configs whose parents DS_FIELDS names through their own fields
_PARENTS = {
    "tensor_parallel": "tp",
    "zero": None,
    "moe": None,
    "quant": None,
    "quant.weight": None,
    "quant.activation": None,
    "quant.qkv": None,
    "checkpoint_config": "ckpt_config",
}

# DeepSpeedInferenceConfig().model_dump(mode="json"): a config written with every default
DEFAULTS_DUMP = {
    "replace_with_kernel_inject": False,
    "dtype": "torch.float16",
    "tensor_parallel": {"enabled": True, "tp_size": 1, "tp_grain_size": 64, "mpu": None, "tp_group": None},
    "enable_cuda_graph": False,
    "use_triton": False,
    "triton_autotune": False,
    "zero": {
        "stage": 0,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 500000000,
        "use_multi_rank_bucket_allreduce": True,
        "allgather_partitions": True,
        "allgather_bucket_size": 500000000,
        "overlap_comm": False,
        "load_from_fp32_weights": True,
        "elastic_checkpoint": False,
        "offload_param": None,
        "offload_optimizer": None,
        "zenflow": None,
        "sub_group_size": 1000000000,
        "cpu_offload_param": None,
        "cpu_offload_use_pin_memory": None,
        "cpu_offload": None,
        "prefetch_bucket_size": 50000000,
        "param_persistence_threshold": 100000,
        "model_persistence_threshold": 9223372036854775807,
        "max_live_parameters": 1000000000,
        "max_reuse_distance": 1000000000,
        "gather_16bit_weights_on_model_save": False,
        "module_granularity_threshold": 0,
        "use_all_reduce_for_fetch_params": False,
        "allgather_sequential": False,
        "stage3_gather_fp16_weights_on_model_save": False,
        "ignore_unused_parameters": True,
        "legacy_stage1": False,
        "round_robin_gradients": False,
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False,
        "zeropp_loco_param": None,
        "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False,
        "memory_efficient_linear": True,
        "pipeline_loading_checkpoint": False,
        "override_module_apply": True,
        "log_trace_cache_warnings": False,
        "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False,
        "leaf_module": {"classes": [], "names": [], "name_suffixes": []},
    },
    "triangular_masking": True,
    "moe": {
        "enabled": True,
        "ep_size": 1,
        "moe_experts": [1],
        "type": "standard",
        "ep_mp_group": None,
        "ep_group": None,
    },
    "keep_module_on_host": False,
    "quant": {
        "enabled": True,
        "activation": {"enabled": True, "num_bits": 8, "q_type": "symmetric", "q_groups": 1},
        "weight": {
            "enabled": True,
            "num_bits": 8,
            "q_type": "symmetric",
            "q_groups": 1,
            "quantized_initialization": {},
            "post_init_quant": {},
        },
        "qkv": {"enabled": True},
    },
    "checkpoint": None,
    "base_dir": "",
    "set_empty_params": False,
    "save_mp_checkpoint_path": None,
    "checkpoint_config": {"checkpoint_dir": None, "save_mp_checkpoint_path": None, "base_dir": None},
    "return_tuple": True,
    "training_mp_size": 1,
    "replace_method": "auto",
    "injection_policy": None,
    "injection_policy_tuple": None,
    "config": None,
    "max_out_tokens": 1024,
    "min_out_tokens": 1,
    "transposed_mode": False,
    "mp_size": 1,
    "mpu": None,
    "ep_size": 1,
    "ep_group": None,
    "ep_mp_group": None,
    "moe_experts": [1],
    "moe_type": "standard",
}


def _nested(dotted: str, value, leaf_key: str | None = None) -> dict:
    *parents, leaf = dotted.split(".")
    out = {leaf_key or leaf: value}
    for p in reversed(parents):
        out = {p: out}
    return out


def _read(tmp_path: Path, config: dict):
    f = tmp_path / "ds_config.json"
    f.write_text(json.dumps(config))
    return f, options_from_config_file(f)


def _declared() -> set[str]:
    """Every field dsc declares, dotted, the sub-configs themselves left out."""
    subs = {p.rstrip(".") for p, _ in SECTIONS if p}
    names = {f"{p}{n}" for p, model in SECTIONS for n in model.model_fields}
    return names - subs


def test_every_field_of_deepspeeds_config_is_declared():
    assert {f for f, *_ in DS_FIELDS} == _declared()
    aliases = {f"{p}{f.alias}" for p, model in SECTIONS for f in model.model_fields.values() if f.alias}
    expect = {(f.rsplit(".", 1)[0] + "." + a) if "." in f else a for f, a, *_ in DS_FIELDS if a}
    assert aliases - {"tp", "ckpt_config"} == expect
    assert InferenceConfig.model_fields["tensor_parallel"].alias == "tp"
    assert InferenceConfig.model_fields["checkpoint_config"].alias == "ckpt_config"


@pytest.mark.parametrize("field, alias, default, other, expect", DS_FIELDS, ids=[f[0] for f in DS_FIELDS])
def test_each_field_is_mapped_or_refused_by_name(tmp_path, field, alias, default, other, expect):
    # DeepSpeed's default is accepted and, for a field dsc refuses, changes nothing (but a quant
    # section without a dtype asks for int8 weights)
    _, opts = _read(tmp_path, _nested(field, default))
    if expect == REFUSED:
        assert opts == ({"int8": True} if field.startswith("quant.") else {})
    for key in [None] + ([alias] if alias else []):
        config = _nested(field, other, key)
        if expect == REFUSED:
            with pytest.raises(UserError) as e:
                _read(tmp_path, config)
            msg = str(e.value)
            written = ".".join(field.split(".")[:-1] + [key or field.split(".")[-1]])
            assert f"field '{written}'" in msg
            assert "not supported" in msg and "\n" not in msg
        else:
            f, opts = _read(tmp_path, config)
            assert opts == expect
            make_options(str(f), **opts)  # valid compile options


def test_a_config_of_deepspeeds_defaults_is_accepted(tmp_path):
    _, opts = _read(tmp_path, DEFAULTS_DUMP)
    assert opts == {"fuse": False, "dtype": "fp16", "tp": 1, "max_seq": 1024, "min_tokens": 1}
    # the same with the aliases, "auto" values (DeepSpeed: the default) and moe as a bool
    short = {
        "kernel_inject": False,
        "dtype": "auto",
        "tp": {"tp_size": 1, "tp_grain_size": "auto"},
        "enable_cuda_graph": False,
        "replace_method": "auto",
        "min_tokens": 1,
        "max_tokens": "auto",
        "moe": False,
        "zero": {},
        "quant": {},
        "tm": True,
        "ckpt_config": {},
    }
    _, opts = _read(tmp_path, short)
    assert opts == {"fuse": False, "tp": 1, "min_tokens": 1}
    assert _read(tmp_path, {"moe": True})[1] == {}
    assert len(ZERO_SETTINGS) + 3 == 53  # DeepSpeedZeroConfig's names and aliases


@pytest.mark.parametrize(
    "spelling, dtype",
    [
        ("fp16", "fp16"),
        ("half", "fp16"),
        ("torch.float16", "fp16"),
        ("float16", "fp16"),
        ("bf16", "bf16"),
        ("bfloat16", "bf16"),
        ("bfloat", "bf16"),
        ("torch.bfloat16", "bf16"),
        ("fp32", "fp32"),
        ("float", "fp32"),
        ("float32", "fp32"),
        ("torch.float32", "fp32"),
        ("int8", "int8"),
        ("torch.int8", "int8"),
    ],
)
def test_dtype_takes_every_deepspeed_spelling(tmp_path, spelling, dtype):
    _, opts = _read(tmp_path, {"dtype": spelling})
    assert opts == ({"int8": True} if dtype == "int8" else {"dtype": dtype})


@pytest.mark.parametrize(
    "setting, expect",
    [
        (8, {"int8": True, "int8_q_groups": 8}),
        (1, {"int8": True}),
        ([False, 4], {"int8": True, "int8_q_groups": 4}),
        (
            {"q_bits": 8, "q_type": "asymmetric", "q_groups": 2},
            {"int8": True, "int8_q_groups": 2, "int8_asymmetric": True},
        ),
        ({"q_groups": 16, "mlp_extra_grouping": False}, {"int8": True, "int8_q_groups": 16}),
        ([True, 8], "mlp_extra_grouping"),
        ({"q_bits": 4}, "q_bits"),
        ({"q_groups": 0}, "q_groups"),
        ({"q_type": "nf4"}, "q_type"),
        ({"groups": 2}, "quantization_setting.groups"),
        ([1, 2, 3], "quantization_setting"),
        ("eight", "q_groups"),
    ],
)
def test_quantization_setting_in_all_its_forms(tmp_path, setting, expect):
    config = {"quantization_setting": setting}
    if isinstance(expect, str):
        with pytest.raises(UserError, match=expect):
            _read(tmp_path, config)
    else:
        assert _read(tmp_path, config)[1] == expect
        assert _read(tmp_path, config | {"dtype": "int8"})[1] == expect


@pytest.mark.parametrize(
    "config, expect",
    [
        # dtype int8 is the request; quant configures it
        (
            {"dtype": "int8", "quant": {"weight": {"q_type": "asymmetric", "q_groups": 8}}},
            {"int8": True, "int8_asymmetric": True, "int8_q_groups": 8},
        ),
        ({"dtype": "torch.int8", "quant": {"qkv": {"enabled": False}}}, {"int8": True, "int8_skip": QKV_MODULES}),
        # a float dtype, as in DeepSpeed: quant asks for nothing, and holds only defaults
        ({"dtype": "fp16", "quant": {"enabled": True, "weight": {"num_bits": 8}}}, {"dtype": "fp16"}),
        # dsc's own names beside DeepSpeed's; flags are applied later
        (
            {"int8": True, "int8_mode": "w8a8", "quant": {"weight": {"q_groups": 2}}},
            {"int8": True, "int8_mode": "w8a8", "int8_q_groups": 2},
        ),
        ({"tp": 2, "max_batch": 4, "mp_size": 2}, {"tp": 2, "max_batch": 4}),
        ({"quant": {"enabled": False, "weight": {"enabled": True}}}, {}),
    ],
)
def test_quant_and_dtype_together(tmp_path, config, expect):
    assert _read(tmp_path, config)[1] == expect


@pytest.mark.parametrize(
    "config, names",
    [
        ({"dtype": "fp16", "quant": {"weight": {"q_type": "asymmetric"}}}, ["quant.weight.q_type", "dtype is fp16"]),
        ({"dtype": "bf16", "quantization_setting": 4}, ["quantization_setting", "dtype is bf16"]),
        ({"dtype": "int8", "quant": {"weight": {"enabled": False}}}, ["quant.weight.enabled", "dtype int8"]),
        ({"dtype": "int8", "quant": {"enabled": False}}, ["quant.enabled"]),
        (
            {"quant": {"weight": {"enabled": False, "q_groups": 4}}},
            ["quant.weight.q_groups", "quant.weight.enabled is false"],
        ),
        ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, ["mp_size", "tensor_parallel.tp_size"]),
        ({"tensor_parallel": {"enabled": False, "tp_size": 2}}, ["tensor_parallel.enabled"]),
        ({"tp": 2, "mp_size": 4}, ["mp_size", "'tp'"]),
        ({"max_seq": 64, "max_out_tokens": 128}, ["max_out_tokens", "max_seq"]),
        ({"kernel_inject": True, "replace_with_kernel_inject": False}, ["kernel_inject", "replace_with_kernel_inject"]),
        ({"quantization_setting": {"q_groups": 4}, "quant": {"weight": {"q_groups": 2}}}, ["quantization_setting"]),
        ({"dtype": "fp16", "zero_optimization": {}, "train_batch_size": 8}, ["train_batch_size", "zero_optimization"]),
        ({"tensor_parallel": {"tp_size": 2, "tp_grain": 64}}, ["tensor_parallel.tp_grain"]),
        ({"quant": {"enabled": True, "bits": 4}}, ["quant.bits"]),
        ({"quant": {"weight": {"bits": 4}}}, ["quant.weight.bits"]),
        ({"moe": {"experts": 8}}, ["moe.experts"]),
        ({"zero": {"stage": 0, "offload_params": {}}}, ["zero.offload_params"]),
        ({"checkpoint_config": {"dir": "/x"}}, ["checkpoint_config.dir"]),
        ({"dtype": "int4"}, ["dtype", "int4"]),
        ({"tensor_parallel": {"tp_size": "two"}}, ["tensor_parallel.tp_size"]),
        ({"max_out_tokens": 1}, ["max_out_tokens"]),
        ({"quant": {"weight": {"q_type": "nf4"}}}, ["quant.weight.q_type"]),
        ({"dtype": "int8", "int8": False}, ["'dtype'", "'int8'"]),
        ({"enable_cuda_graph": "false"}, ["enable_cuda_graph", "'false'"]),  # checked, not coerced
        ({"dtype": "int8", "quant": {"weight": {"q_groups": "4"}}}, ["quant.weight.q_groups", "'4'"]),
    ],
)
def test_bad_configs_are_one_line_naming_the_field(tmp_path, config, names):
    with pytest.raises(UserError) as e:
        f, opts = _read(tmp_path, config)
        make_options(str(f), **opts)
    msg = str(e.value)
    assert "ds_config.json" in msg and "\n" not in msg and all(n in msg for n in names), msg


def test_min_tokens_is_a_compile_option_checked_against_max_seq():
    assert make_options().min_tokens == 0
    assert make_options(min_tokens=5).min_tokens == 5
    with pytest.raises(UserError, match="min_tokens"):
        make_options(min_tokens=-1)
    with pytest.raises(UserError, match="min_tokens 64 leaves no room"):
        make_options(min_tokens=64, max_seq=64)
    with pytest.raises(UserError, match=r"unknown dtype 'int8'.*--int8"):
        make_options(dtype="int8")


def test_a_config_of_defaults_asking_for_int8_compiles_as_it_says(tmp_path, make_checkpoint):
    """DeepSpeed's defaults, changed to ask for int8 weights (asymmetric, q/k/v kept 16-bit), kernel
    injection, 64 tokens and min_out_tokens 3: the manifest records it, the rank file holds it
    (q/k/v, fused or not, unquantized; the MLP's weights int8 with zero points)."""
    config = json.loads(json.dumps(DEFAULTS_DUMP))
    del config["replace_with_kernel_inject"]
    config["quant"]["weight"]["q_type"], config["quant"]["qkv"]["enabled"] = "asymmetric", False
    config |= {
        "dtype": "torch.int8",
        "kernel_inject": True,
        "max_out_tokens": 64,
        "min_out_tokens": 3,
        "enable_cuda_graph": True,
    }
    f = tmp_path / "ds_config.json"
    f.write_text(json.dumps(config))
    art = dsc.compile(str(make_checkpoint("llama-tiny")), tmp_path / "art", config_file=f, dtype="fp32")
    opts = json.loads((art / "manifest.json").read_text())["options"]
    assert (
        opts["int8"],
        opts["int8_asymmetric"],
        opts["min_tokens"],
        opts["max_seq"],
        opts["fuse"],
        opts["dtype"],
    ) == (True, True, 3, 64, True, "fp32")
    assert tuple(opts["int8_skip"]) == QKV_MODULES
    with safe_open(art / "rank0.safetensors", "pt") as r:
        names = list(r.keys())
        dtypes = {n: r.get_slice(n).get_dtype() for n in names}
    attn_in = [n for n in names if ".self_attn." in n and "o_proj" not in n]
    assert attn_in and all(dtypes[n] != "I8" for n in attn_in) and not any(n.endswith(".zero") for n in attn_in)
    mlp = [n for n in names if ".mlp." in n and n.endswith(".qweight")]
    assert mlp and all(dtypes[n] == "I8" for n in mlp)
    assert all(n.removesuffix(".qweight") + ".zero" in dtypes for n in mlp)


def test_a_bad_deepspeed_config_on_the_command_line_is_one_line(tmp_path, make_checkpoint):
    from typer.testing import CliRunner

    from dsc.cli import app

    f = tmp_path / "ds_config.json"
    f.write_text(json.dumps({"dtype": "fp16", "keep_module_on_host": True}))
    out = tmp_path / "art"
    r = CliRunner().invoke(app, ["compile", str(make_checkpoint("llama-tiny")), "-o", str(out), "--config", str(f)])
    assert r.exit_code == 2 and not out.exists()
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "field 'keep_module_on_host'" in lines[0], r.output


def test_the_docs_page_lists_every_field():
    from dsc.compiler.deepspeed_config import markdown

    page = markdown()
    for field, _alias, *_ in DS_FIELDS:
        assert f"| `{field}` |" in page
    assert "`quantization_setting`" in page
