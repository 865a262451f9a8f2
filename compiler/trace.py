"""Trace a Hugging Face causal LM into dsc programs with torch.export.

The model is built with its parameters on the meta device and then swapped for fake CPU
tensors, so tracing an 8B model holds no weights. Attention enters the graph as
`dsc::causal_attention` through transformers' AttentionInterface (registered as "dsc"); the
mask interface returns no mask, because the dsc op is causal by construction.

Both programs take
    input_ids    [batch, seq] int64   (right-padded prompts in prefill; seq == 1 in decode)
    position_ids [batch, seq] int64   cache_pos[:, None] + arange(seq)
    cache_pos    [batch]      int64   tokens already in each sequence's KV cache
    last_idx     [batch]      int64   the position whose logits are returned
and return logits [batch, vocab] for the token at last_idx.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import dsc.kernels  # noqa: F401  (registers dsc ops)
from dsc.compiler.architectures import ARCHITECTURES, Architecture
from dsc.compiler.ir import Model, WeightSpec
from dsc.compiler.model_adapters import adapt_model, register_attention_classes, register_dsc_experts
from dsc.compiler.source import Checkpoint, check_weight_dtype
from dsc.errors import UserError

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dsc_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: q [B,H,S,D], k/v [B,Hkv,S,D] -> ([B,S,H,D], None)."""
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    # sliding-window layers (Mistral, Qwen2's use_sliding_window) pass their window, gemma2 its
    # softcap, bloom its ALiBi slopes ([H] fp32); the trailing arguments are recorded only up to
    # the last one set, so plain graphs keep the five-argument form
    window, softcap = int(kwargs.get("sliding_window") or 0), float(kwargs.get("softcap") or 0.0)
    slopes = kwargs.get("alibi_slopes")
    extra = (
        (window, softcap, slopes)
        if slopes is not None
        else (window, softcap)
        if softcap
        else (window,)
        if window
        else ()
    )
    if "dsc_lengths" in kwargs:  # an encoder: bidirectional over each sequence's real tokens
        return torch.ops.dsc.encoder_attention(query, key, value, kwargs["dsc_lengths"], scale), None
    if "dsc_paged" in kwargs:  # the ragged program: flat tokens of several sequences, a paged cache
        return torch.ops.dsc.ragged_attention(query, key, value, *kwargs["dsc_paged"], scale, *extra), None
    return torch.ops.dsc.causal_attention(query, key, value, kwargs["dsc_cache_pos"], scale, *extra), None


def _no_mask(*args, **kwargs):
    return None


def register_dsc_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("dsc", dsc_attention)
    AttentionMaskInterface.register("dsc", _no_mask)


class CausalLMProgram(nn.Module):
    """What dsc traces: the base model, a gather of one position per sequence, the LM head."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids, cache_pos, last_idx):
        h = self.lm.base_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, dsc_cache_pos=cache_pos
        ).last_hidden_state  # [B, S, E]
        h = h[torch.arange(h.shape[0], device=h.device), last_idx]  # [B, E]
        logits = self.lm.get_output_embeddings()(h)  # [B, V]
        return ARCHITECTURES[self.lm.config.model_type].logit_epilogue(self.lm.config, logits)


class RaggedProgram(nn.Module):
    """The continuous-batching step: T new tokens of N sequences as one flat batch (prompt
    chunks and decode tokens alike; kernels/paged_attention.py has the layout): input_ids and
    position_ids [1, T], the batch of one the model code sees. Returns the logits [N, V] of the
    tokens at logits_idx [N] (each sequence's last new token)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids, position_ids, slot_mapping, query_start, query_lens, cache_lens, block_tables, logits_idx
    ):
        paged = (slot_mapping, query_start, query_lens, cache_lens, block_tables)
        h = self.lm.base_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, dsc_paged=paged
        ).last_hidden_state  # [1, T, E]
        logits = self.lm.get_output_embeddings()(h[0, logits_idx])  # [N, V]
        return ARCHITECTURES[self.lm.config.model_type].logit_epilogue(self.lm.config, logits)


class EncoderProgram(nn.Module):
    """An encoder's one program: input_ids [B, S] right-padded (with the config's pad token),
    lengths [B] the real tokens of each row -> the last hidden states [B, S, E]. Pooling into
    embeddings is the runtime's (runtime/embed.py), as the artifact's plan says."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, lengths):
        return self.lm(input_ids=input_ids, use_cache=False, dsc_lengths=lengths).last_hidden_state


# the ragged program's inputs: name -> (sample size of each dim, the dims' names, dtype)
RAGGED_INPUTS = {
    "input_ids": ((1, 6), ("one", "tokens"), torch.long),
    "position_ids": ((1, 6), ("one", "tokens"), torch.long),
    "slot_mapping": ((6,), ("tokens",), torch.int32),
    "query_start": ((3,), ("seqs",), torch.int32),
    "query_lens": ((3,), ("seqs",), torch.int32),
    "cache_lens": ((3,), ("seqs",), torch.int32),
    "block_tables": ((3, 4), ("seqs", "blocks"), torch.int32),
    "logits_idx": ((3,), ("seqs",), torch.long),
}


@contextlib.contextmanager
def _parameters_on_meta():
    """Create parameters on the meta device while buffers (rotary tables) stay real."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        orig(self, name, param)
        if param is not None and param.device.type != "meta":  # keep tied parameters tied
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def target_dtype(ckpt: Checkpoint, options) -> str:
    if options.dtype:
        return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[options.dtype]
    d = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype") or "float32"
    return d if d in _TORCH_DTYPES else "float32"


def _static_rope(hf_config) -> None:
    """Dynamic-NTK rotary ("rope_type": "dynamic") rescales its frequencies only once a sequence
    grows past max_position_embeddings, a data-dependent branch torch.export cannot trace.
    dsc never compiles a --max-seq beyond max_position_embeddings (compiler/validate.py), and
    below it dynamic NTK computes exactly the unscaled table, so it is traced as plain RoPE."""
    for attr in ("rope_parameters", "rope_scaling"):
        rp = getattr(hf_config, attr, None)
        if isinstance(rp, dict) and rp.get("rope_type", rp.get("type")) == "dynamic":
            setattr(
                hf_config,
                attr,
                {k: v for k, v in rp.items() if k in ("rope_theta", "partial_rotary_factor")}
                | {"rope_type": "default"},
            )


def build_meta_model(ckpt: Checkpoint, dtype: str) -> nn.Module:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    register_dsc_attention()
    register_dsc_experts()
    try:
        hf_config = AutoConfig.from_pretrained(ckpt.root)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise UserError(f"{ckpt.root / 'config.json'}: invalid config ({str(e).splitlines()[0]})") from None
    _static_rope(hf_config)
    register_attention_classes(hf_config, ckpt.root / "config.json")
    with _parameters_on_meta(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if _is_encoder(hf_config):  # the base model: hidden states, no pooler (pooling is the runtime's)
                pooler = {"add_pooling_layer": False} if hf_config.model_type != "distilbert" else {}
                lm = AutoModel.from_config(hf_config, attn_implementation="dsc", dtype=_TORCH_DTYPES[dtype], **pooler)
            else:
                lm = AutoModelForCausalLM.from_config(
                    hf_config,
                    attn_implementation="dsc",
                    dtype=_TORCH_DTYPES[dtype],
                    **({"experts_implementation": "dsc"} if _has_experts(hf_config) else {}),
                )
        except KeyError as e:  # a family whose attention classes are looked up by implementation name
            if e.args != ("dsc",):
                raise
            import transformers

            raise UserError(
                f"{ckpt.root / 'config.json'}: model_type {hf_config.model_type!r}: transformers "
                f"{transformers.__version__} builds its attention from classes of its own, which dsc "
                "cannot route; a newer transformers calls it through the attention interface "
                "(dsc is tested with 5.24)"
            ) from None
    adapt_model(lm, ckpt.root / "config.json")
    return lm.eval()


def _is_encoder(hf_config) -> bool:
    arch = ARCHITECTURES.get(hf_config.model_type)
    return bool(arch and arch.kind == "encoder")


def _has_experts(hf_config) -> bool:
    arch = ARCHITECTURES.get(hf_config.model_type)
    return bool(arch and arch.experts(hf_config.to_dict()))


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _merged_experts(converter) -> bool:
    """A converter that stacks per-expert linears into 3-D experts weights (and concatenates
    gate and up): the experts' 2-D weights are the sources' rows in order (_flatten_experts)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = [(type(op), getattr(op, "dim", None)) for op in getattr(converter, "operations", [])]
    return ops in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]) and all(
        ".experts.*." in p for p in converter.source_patterns
    )


def _loaded_names(lm: nn.Module, ckpt: Checkpoint, where) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the checkpoint keys it loads from, by transformers' own key mapping
    (conversion_mapping: GPT-NeoX's `embed_out` -> `lm_head`, legacy gamma/beta names, the
    base-model prefix added or dropped), as `from_pretrained` renames them. An experts weight
    loads from its per-expert tensors, by expert and then in the converter's order (gate, up)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(lm)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    model_names = dict.fromkeys((n for n, _ in lm.named_parameters(remove_duplicate=False)), True)
    loaded: dict[str, tuple[str, ...]] = {}
    merged: dict[str, list[tuple[int, int, str]]] = {}
    for key in sorted(ckpt.tensors):
        name, converted = rename_source_key(key, renamings, converters, lm.base_model_prefix, model_names)
        if converted is not None and name in model_names:  # tensors merged or split on load
            conv = next(c for c in converters if converted in c.source_patterns)
            expert = _EXPERT_INDEX.search(key)
            if not _merged_experts(conv) or expert is None:
                raise UserError(
                    f"{where}: tensor '{key}' needs transformers' weight conversion "
                    f"'{converted}', which dsc does not stream yet"
                )
            merged.setdefault(name, []).append((int(expert.group(1)), conv.source_patterns.index(converted), key))
            continue
        loaded.setdefault(name, (key,))
    for name, parts in merged.items():
        loaded[name] = tuple(key for _, _, key in sorted(parts))
    return loaded


def weight_specs(lm: nn.Module, ckpt: Checkpoint, dtype: str) -> dict[str, WeightSpec]:
    """Map every parameter of the model to the checkpoint tensors it is loaded from."""
    aliases: dict[int, list[str]] = {}
    for name, p in lm.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    specs: dict[str, WeightSpec] = {}
    where = ckpt.files[0] if len(ckpt.files) == 1 else ckpt.root / "model.safetensors.index.json"
    loaded = _loaded_names(lm, ckpt, where)
    for names in aliases.values():  # tied parameters: any of their names may be the stored one
        keys = next((loaded[n] for n in names if n in loaded), None)
        if keys is None:
            raise UserError(f"{where}: missing weight tensor '{names[0]}'")
        shape = tuple(lm.get_parameter(names[0]).shape)
        if shape[0] % len(keys):  # an experts weight's rows are split evenly over its sources
            raise UserError(
                f"{where}: '{names[0]}' has {len(keys)} per-expert tensors; config.json implies "
                f"a multiple of them that divides its {shape[0]} rows (is an expert missing?)"
            )
        part = (shape[0] // len(keys), *shape[1:])
        for key in keys:
            info = ckpt.tensors[key]
            check_weight_dtype(info, key)
            if tuple(info.shape) != part:
                raise UserError(
                    f"{info.file}: tensor '{key}' has shape {list(info.shape)}, config.json implies {list(part)}"
                )
        for n in names:
            specs[n] = WeightSpec(sources=keys, shape=shape, dtype=dtype)
    return specs


def _fake_parameters(lm: nn.Module, fake_mode: FakeTensorMode) -> None:
    for mod in lm.modules():
        for n, p in list(mod._parameters.items()):
            if p is not None:
                with fake_mode:
                    mod._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)


def _export(
    program: nn.Module, fake_mode: FakeTensorMode, batch: int, seq: int, options, dynamic_seq: bool
) -> torch.export.ExportedProgram:
    with fake_mode:
        ids = torch.zeros(batch, seq, dtype=torch.long)
        pos = torch.zeros(batch, seq, dtype=torch.long)
        cp = torch.zeros(batch, dtype=torch.long)
        li = torch.zeros(batch, dtype=torch.long)
    B = torch.export.Dim("batch", min=1, max=max(options.max_batch, 2))
    S = torch.export.Dim("seq", min=2, max=max(options.max_seq, 3)) if dynamic_seq else None
    bs = {0: B, 1: S} if dynamic_seq else {0: B}
    logging.getLogger("torch._export").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(program, (ids, pos, cp, li), dynamic_shapes=(bs, bs, {0: B}, {0: B}), strict=False)


def _export_ragged(program: nn.Module, fake_mode: FakeTensorMode, options) -> torch.export.ExportedProgram:
    dims = {
        "tokens": torch.export.Dim("tokens", min=1, max=max(options.max_batch * options.max_seq, 7)),
        "seqs": torch.export.Dim("seqs", min=1, max=max(options.max_batch, 4)),
        "blocks": torch.export.Dim("blocks", min=1, max=max(options.max_seq, 5)),
    }
    with fake_mode:
        args = tuple(torch.zeros(size, dtype=dtype) for size, _, dtype in RAGGED_INPUTS.values())
    shapes = tuple({i: dims[n] for i, n in enumerate(names) if n in dims} for _, names, _ in RAGGED_INPUTS.values())
    logging.getLogger("torch._export").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(program, args, dynamic_shapes=shapes, strict=False)


def _export_encoder(program: nn.Module, fake_mode: FakeTensorMode, options) -> torch.export.ExportedProgram:
    with fake_mode:
        ids = torch.zeros(2, 4, dtype=torch.long)
        lengths = torch.full((2,), 4, dtype=torch.long)
    B = torch.export.Dim("batch", min=1, max=max(options.max_batch, 2))
    S = torch.export.Dim("seq", min=2, max=max(options.max_seq, 3))
    logging.getLogger("torch._export").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(program, (ids, lengths), dynamic_shapes=({0: B, 1: S}, {0: B}), strict=False)


def _to_graph(ep: torch.export.ExportedProgram, const_specs: dict[str, WeightSpec]) -> fx.Graph:
    """Copy an exported graph, turning lifted parameters/buffers/constants into get_attr."""
    from torch.export.graph_signature import InputKind

    lifted = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            lifted[spec.arg.name] = spec.target.removeprefix("lm.")
            if spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                val = ep.constants.get(spec.target)
                if val is None:
                    val = ep.state_dict.get(spec.target)
                if val is not None and not isinstance(val, torch._subclasses.FakeTensor):
                    name = spec.target.removeprefix("lm.")
                    const_specs.setdefault(
                        name,
                        WeightSpec(
                            sources=(),
                            shape=tuple(val.shape),
                            dtype=str(val.dtype).removeprefix("torch."),
                            const=val.detach().clone(),
                        ),
                    )
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name in lifted:
            new = g.get_attr(lifted[n.name])
            new.meta.update(n.meta)
        elif n.op == "output":
            outs = n.args[0]
            new = g.output(env[outs[0]] if len(outs) == 1 else tuple(env[o] for o in outs))
        else:
            new = g.node_copy(n, lambda x: env[x])
        env[n] = new
    return g


def trace(ckpt: Checkpoint, arch: Architecture, options) -> Model:
    dtype = target_dtype(ckpt, options)
    lm = build_meta_model(ckpt, dtype)
    weights = weight_specs(lm, ckpt, dtype)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fake_parameters(lm, fake_mode)
    program = CausalLMProgram(lm)
    programs = {}
    sym_names: dict[str, dict[str, str]] = {}
    kinds = (
        (("encode", 0, True),)
        if arch.kind == "encoder"
        else (("prefill", 4, True), ("decode", 1, False), ("ragged", 0, True))
    )
    for name, seq, dynamic in kinds:
        try:
            ep = (
                _export_ragged(RaggedProgram(lm), fake_mode, options)
                if name == "ragged"
                else _export_encoder(EncoderProgram(lm), fake_mode, options)
                if name == "encode"
                else _export(program, fake_mode, 2, seq, options, dynamic)
            )
        except Exception as e:  # export failures are compiler bugs or unsupported models
            raise RuntimeError(
                f"torch.export failed for the {name} program of {arch.model_type}: {type(e).__name__}: {e}"
            ) from e
        graph = _to_graph(ep, weights)
        programs[name] = graph
        # every input's dim 0 is the batch, ids' and positions' dim 1 the sequence (the ragged
        # program's: RAGGED_INPUTS); with a batch range of 1..2 (--max-batch 1) export does not
        # unify the inputs' batch symbols
        inputs = (
            {k: names for k, (_, names, _) in RAGGED_INPUTS.items()}
            if name == "ragged"
            else {"input_ids": ("batch", "seq"), "lengths": ("batch",)}
            if name == "encode"
            else dict.fromkeys(("input_ids", "position_ids", "cache_pos", "last_idx"), ("batch", "seq"))
        )
        for n in graph.nodes:
            if n.op == "placeholder" and n.name in inputs:
                for d, dim_name in zip(n.meta["val"].shape, inputs[n.name]):
                    if isinstance(d, torch.SymInt):
                        sym_names.setdefault(name, {})[str(d)] = dim_name
    return Model(
        programs=programs,
        weights=weights,
        config=ckpt.config,
        arch=arch,
        checkpoint=ckpt,
        options=options,
        fake_mode=fake_mode,
        sym_names=sym_names,
    )
