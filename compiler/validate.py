"""Checks of the options against the model, before any tracing."""

from __future__ import annotations

from pathlib import Path

from dsc.compiler.architectures import Architecture
from dsc.compiler.source import Checkpoint
from dsc.errors import UserError

# option -> (the pass that implements it, whether the options ask for it). An option whose pass
# is not in the pipeline yet is rejected, never silently ignored.
_OPTION_PASSES = {
    "--tp": ("shard_tensor_parallel", lambda o: o.tp > 1),
    "--int8": ("quantize_int8", lambda o: o.int8),
    "--fp8": ("quantize_int8", lambda o: o.fp8),
    "--int4": ("quantize_int8", lambda o: o.int4),
    "--auto-precision": ("quantize_int8", lambda o: o.auto_precision is not None),
}


def reject_unbuilt_options(options) -> None:
    from dsc.compiler.pipeline import pipeline

    have = {name for name, _ in pipeline(options)}
    for flag, (pass_name, wanted) in _OPTION_PASSES.items():
        if wanted(options) and pass_name not in have:
            raise UserError(f"{flag}: not supported yet (this dsc has no '{pass_name}' pass)")


def tp_sizes(cfg: dict, arch: Architecture) -> dict[str, int]:
    """The config sizes a tensor-parallel split must divide."""
    # a mixture of experts whose intermediate_size is the experts' width has no dense MLP to
    # split (validate_experts checks the experts)
    experts_only = arch.experts(cfg) and arch.intermediate_field == arch.expert_intermediate_field
    return {
        "num_attention_heads": arch.heads(cfg),
        "num_key_value_heads": arch.kv_heads(cfg),
        "intermediate_size": 0 if experts_only else arch.intermediate(cfg),
    }


def tp_problem(sizes: dict[str, int], tp: int) -> str | None:
    """Why `tp` cannot shard a model of these sizes (None: it can). kv heads split when tp
    divides them and are replicated when tp is a multiple of them. The vocabulary never blocks
    a tp: shard_tensor_parallel replicates it when tp does not divide it."""
    heads, kv, inter = sizes["num_attention_heads"], sizes["num_key_value_heads"], sizes["intermediate_size"]
    if heads % tp:
        return f"does not divide num_attention_heads={heads}"
    if inter % tp:
        return f"does not divide intermediate_size={inter}"
    if tp <= kv and kv % tp:
        return f"does not divide num_key_value_heads={kv}"
    if tp > kv and tp % kv:
        return f"is larger than num_key_value_heads={kv} but not a multiple of it (kv heads are replicated whole)"
    return None


def validate_tp(ckpt: Checkpoint, arch: Architecture, tp: int) -> None:
    if tp == 1:
        return
    if why := arch.tp_blocker(ckpt.config):
        raise UserError(
            f"--tp {tp}: model_type '{arch.model_type}' ({ckpt.config_where}) compiles with --tp 1 only for now ({why})"
        )
    sizes = tp_sizes(ckpt.config, arch)
    problem = tp_problem(sizes, tp)
    if problem:
        ok = [t for t in range(1, sizes["num_attention_heads"] + 1) if tp_problem(sizes, t) is None]
        raise UserError(f"--tp {tp} {problem} in {ckpt.config_where}; tp values that work: {', '.join(map(str, ok))}")


def validate_experts(ckpt: Checkpoint, arch: Architecture, options) -> None:
    """--ep needs experts that divide over its ranks; --tp alone splits every expert's MLP."""
    experts, inter = arch.experts(ckpt.config), arch.expert_intermediate(ckpt.config)
    if options.ep > 1:
        if not experts:
            raise UserError(
                f"--ep {options.ep}: model_type '{arch.model_type}' ({ckpt.config_where}) has no experts; use --tp"
            )
        if experts % options.ep:
            ok = [e for e in range(2, experts + 1) if experts % e == 0]
            raise UserError(
                f"--ep {options.ep} does not divide the {experts} experts in {ckpt.config_where}; "
                f"ep values that work: {', '.join(map(str, ok))}"
            )
    elif experts and options.tp > 1 and inter % options.tp:
        raise UserError(
            f"--tp {options.tp} does not divide {arch.expert_intermediate_field}={inter} (each "
            f"expert's MLP width) in {ckpt.config_where}; --ep places whole experts instead"
        )


def check_destination(out: Path) -> None:
    """-o may name a new path, an empty folder or an artifact (replaced), nothing else."""
    if out.exists() and not (out.is_dir() and ((out / "manifest.json").exists() or not any(out.iterdir()))):
        raise UserError(f"{out}: exists and is not a dsc artifact; choose another -o")


def validate_options(ckpt: Checkpoint, arch: Architecture, options) -> None:
    reject_unbuilt_options(options)
    if options.pooling and arch.kind != "encoder":
        raise UserError(
            f"--pooling applies to encoder (embedding) models; {ckpt.config_where} is a {arch.model_type} decoder"
        )
    validate_tp(ckpt, arch, options.tp)
    validate_experts(ckpt, arch, options)
    cfg = ckpt.config
    max_pos = arch.max_positions(cfg)
    if max_pos and options.max_seq > max_pos:
        raise UserError(
            f"--max-seq {options.max_seq} exceeds the model's max_position_embeddings ({max_pos}) "
            f"in {ckpt.config_where}"
        )
