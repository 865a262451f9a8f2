"""What dsc adds to transformers' model code so that every family traces the same way.

Most families call attention through transformers' AttentionInterface with the decoder's
keyword arguments passed down, and need nothing here. The gaps:
  - decoder layers that do not pass their keyword arguments on to attention (StableLM): the
    cache positions (`dsc_cache_pos`; the ragged program's `dsc_paged`) reach every
    attention module by a forward pre-hook;
  - families whose attention is a class of their own rather than the interface (Falcon, BLOOM):
    a subclass (registered under the "dsc" implementation where the family has a registry)
    computes q, k and v with the model's own projections and layout, and calls the registered
    dsc attention function; BLOOM's passes its ALiBi slopes, a buffer of the module;
  - linears that spell nn.Linear's math as `x @ W.T + b` (FalconLinear): they run nn.Linear's
    forward, so the graph holds the aten.linear every pass expects;
  - mixture-of-experts layers: the router runs as the model's code computes it, and the experts
    module calls `dsc::moe` through transformers' ExpertsInterface (registered as "dsc"), with
    its 3-D weights made 2-D ([E * 2I, H] gate/up, [E * H, I] down: kernels/moe.py), the rows
    the checkpoint's per-expert tensors concatenate to.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from dsc.errors import UserError

ATTENTION_KWARGS = ("dsc_cache_pos", "dsc_paged")  # what compiler/trace.py's programs pass attention


def _falcon_attention_class():
    from transformers.models.falcon import modeling_falcon as mf

    class DscFalconAttention(mf.FalconAttention):
        """Falcon's fused query_key_value, split per its layout, RoPE, then dsc attention."""

        def _split_qkv(self, fused: torch.Tensor):
            """fused [B, S, (H + 2 Hkv) D] -> q [B, H, S, D], k and v [B, Hkv, S, D]."""
            B, S, _ = fused.shape
            if self.new_decoder_architecture:  # per kv group: its q heads, then k, then v
                qkv = fused.view(B, S, self.num_kv_heads, self.num_heads // self.num_kv_heads + 2, self.head_dim)
                q, k, v = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
            elif self.multi_query:  # q heads, then one k and one v head
                H, D = self.num_heads, self.head_dim
                q, k, v = (t.view(B, S, -1, D) for t in fused.split([H * D, D, D], dim=-1))
            else:  # per head: its q, k and v
                q, k, v = self._split_heads(fused)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def forward(
            self,
            hidden_states,
            alibi,
            attention_mask,
            position_ids=None,
            layer_past=None,
            use_cache=False,
            output_attentions=False,
            position_embeddings=None,
            **kwargs,
        ):
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            B, S, _ = hidden_states.shape
            q, k, v = self._split_qkv(self.query_key_value(hidden_states))
            q, k = mf.apply_rotary_pos_emb(q, k, *position_embeddings)
            out, _ = ALL_ATTENTION_FUNCTIONS["dsc"](
                self, q, k, v, None, scaling=self.inv_norm_factor, **kwargs
            )  # [B, S, H, D]
            return self.dense(out.reshape(B, S, self.num_heads * self.head_dim)), None

    return mf, DscFalconAttention


def dsc_experts(module, hidden_states, top_k_index, top_k_weights):
    """transformers experts function: x [T, H], routed ids and weights [T, K] -> [T, H]."""
    return torch.ops.dsc.moe(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, 0)


def register_dsc_experts() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("dsc", dsc_experts)


def _flatten_experts(lm: nn.Module, where) -> None:
    """Every experts module (3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]) gets the
    2-D meta parameters dsc::moe reads; layouts it does not implement are refused."""
    for name, mod in lm.named_modules():
        gate_up, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if not (isinstance(gate_up, nn.Parameter) and gate_up.dim() == 3):
            continue
        layout = {
            "bias": getattr(mod, "has_bias", False),
            "transposed": getattr(mod, "is_transposed", False),
            "interleaved gate/up": not getattr(mod, "is_concatenated", True),
            "no gate": not getattr(mod, "has_gate", True),
            "post-expert norm": getattr(mod, "has_post_expert_norm", False),
        }
        act = getattr(mod.config, "hidden_act", "silu")
        if unsupported := [k for k, v in layout.items() if v] + ([f"activation {act!r}"] if act != "silu" else []):
            raise UserError(
                f"{where}: the experts of '{name}' ({', '.join(unsupported)}) are not supported yet "
                "(dsc::moe computes SwiGLU experts without biases)"
            )
        experts, rows, hidden = gate_up.shape
        mod.gate_up_proj = nn.Parameter(
            torch.empty(experts * rows, hidden, dtype=gate_up.dtype, device="meta"), requires_grad=False
        )
        mod.down_proj = nn.Parameter(
            torch.empty(experts * down.shape[1], down.shape[2], dtype=down.dtype, device="meta"), requires_grad=False
        )


def _bloom_attention_class():
    from transformers.models.bloom import modeling_bloom as mb

    class DscBloomAttention(mb.BloomAttention):
        """BLOOM's fused query_key_value (per head: its q, k and v), then dsc attention with the
        ALiBi slopes as its bias: no [S, S] alibi tensor or mask. `alibi_slopes` [H] fp32 is a
        buffer, so the graph reads it as a constant weight the sharding pass splits with the
        q heads."""

        def forward(
            self,
            hidden_states,
            residual,
            alibi,
            attention_mask,
            layer_past=None,
            use_cache=False,
            output_attentions=False,
            **kwargs,
        ):
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            B, S, _ = hidden_states.shape
            q, k, v = self._reshape(self.query_key_value(hidden_states))  # each [B, H, S, D]
            out, _ = ALL_ATTENTION_FUNCTIONS["dsc"](
                self, q, k, v, None, scaling=self.inv_norm_factor, alibi_slopes=self.alibi_slopes, **kwargs
            )  # [B, S, H, D]
            out = self.dense(out.reshape(B, S, self.num_heads * self.head_dim))
            return mb.dropout_add(out, residual, self.hidden_dropout, self.training), None

    return mb, DscBloomAttention


def _use_bloom_attention(lm: nn.Module) -> None:
    """BloomBlock builds BloomAttention by name, with no registry to choose another class: each
    instance becomes the dsc subclass (same parameters) and gets the slopes of its heads."""
    mb, cls = _bloom_attention_class()
    for mod in lm.modules():
        if type(mod) is mb.BloomAttention:
            mod.__class__ = cls
            mod.register_buffer(
                "alibi_slopes", mb._get_alibi_slopes(mod.num_heads, torch.device("cpu")), persistent=False
            )


def register_attention_classes(hf_config, where) -> None:
    """Before the model is built: the "dsc" attention class of families without the interface."""
    if hf_config.model_type == "falcon":
        if hf_config.alibi:
            raise UserError(f"{where}: falcon with alibi=true is not supported yet (RoPE Falcon is)")
        mf, cls = _falcon_attention_class()
        mf.FALCON_ATTENTION_CLASSES["dsc"] = cls


def _attention_classes(lm: nn.Module) -> tuple[type, ...]:
    """The model's attention module classes, as transformers records their outputs."""
    rec = getattr(lm.base_model, "_can_record_outputs", None) or {}
    target = rec.get("attentions")
    classes = {getattr(t, "target_class", t) for t in (target if isinstance(target, list) else [target]) if t}
    from transformers.models.bloom.modeling_bloom import BloomAttention
    from transformers.models.falcon.modeling_falcon import FalconAttention

    return tuple(c for c in classes | {BloomAttention, FalconAttention} if isinstance(c, type))


def adapt_model(lm: nn.Module, where) -> None:
    """After the model is built: cache positions to attention, nn.Linear's forward for linears,
    the experts' weights as dsc::moe reads them."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    if lm.config.model_type == "bloom":
        _use_bloom_attention(lm)
    _flatten_experts(lm, where)
    _pass_cache_pos_to_attention(lm)
    for mod in lm.modules():
        if isinstance(mod, FalconLinear):
            mod.forward = types.MethodType(nn.Linear.forward, mod)


def _pass_cache_pos_to_attention(lm: nn.Module) -> None:
    """Every attention module receives the base model's dsc keywords (ATTENTION_KWARGS) of this
    call, whether or not the decoder layers between them pass their keyword arguments on."""
    seen: dict[str, torch.Tensor] = {}

    def capture(module, args, kwargs):
        seen.clear()
        seen.update({k: kwargs[k] for k in ATTENTION_KWARGS if k in kwargs})

    def inject(module, args, kwargs):
        missing = {k: v for k, v in seen.items() if k not in kwargs}
        return (args, {**kwargs, **missing}) if missing else None

    lm.base_model.register_forward_pre_hook(capture, with_kwargs=True)
    classes = _attention_classes(lm)
    for mod in lm.modules():
        if isinstance(mod, classes):
            mod.register_forward_pre_hook(inject, with_kwargs=True)
