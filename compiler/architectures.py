"""The architectures dsc compiles, and what it needs to know of each.

Tracing goes through transformers' own model code, and sharding is derived from the graph's
dataflow, so an architecture entry is small: the model_type, and the config facts the
passes cannot read off the graph. Adding one is a new entry here plus its test config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsc.errors import UserError

# What a family's ForCausalLM forward does to the lm_head's output, by the config field it reads.
# dsc traces the base model and applies the head itself (at one position per sequence), so the
# head's epilogue is named here.
LOGIT_EPILOGUES = {
    "logit_scale": lambda x, v: x * v,  # Cohere
    "logits_scaling": lambda x, v: x / v,  # Granite
    "final_logit_softcapping": lambda x, v: torch.tanh(x / v) * v,  # Gemma 2 and 3
}


@dataclass(frozen=True)
class Architecture:
    model_type: str
    family: str  # for readers: the nearer of "llama" (RMSNorm, RoPE, gated MLP), "gpt2" (LayerNorm, GELU MLP), "bert"
    intermediate_field: str = "intermediate_size"  # the config field of the MLP width
    no_tp: str = ""  # why shard_tensor_parallel cannot split this architecture yet ("" = it can)
    logits: tuple[str, ...] = ()  # LOGIT_EPILOGUES applied after lm_head, where the config sets them
    # mixture of experts: the config fields of the expert count and of one expert's MLP width
    # ("" = a dense model); the experts trace as one dsc::moe op (compiler/model_adapters.py)
    experts_field: str = ""
    expert_intermediate_field: str = ""
    # "decoder" (a causal LM: prefill, decode and ragged programs) or "encoder" (bidirectional
    # attention over padded sequences: one `encode` program returning hidden states, pooled by
    # the runtime into embeddings)
    kind: str = "decoder"

    def logit_epilogue(self, hf_config, logits: torch.Tensor) -> torch.Tensor:
        for field in self.logits:
            if (value := getattr(hf_config, field, None)) is not None:
                logits = LOGIT_EPILOGUES[field](logits, value)
        return logits

    def tp_blocker(self, cfg: dict) -> str:
        """Why this checkpoint compiles with --tp 1 only ("" = it shards)."""
        return self.no_tp

    def heads(self, cfg: dict) -> int:
        return cfg.get("num_attention_heads", cfg.get("n_head"))

    def kv_heads(self, cfg: dict) -> int:
        return cfg.get("num_key_value_heads") or self.heads(cfg)

    def hidden(self, cfg: dict) -> int:  # GPT-2's n_embd, older BLOOM configs' n_embed
        return cfg.get("hidden_size", cfg.get("n_embd", cfg.get("n_embed")))

    def head_dim(self, cfg: dict) -> int:
        return cfg.get("head_dim") or self.hidden(cfg) // self.heads(cfg)

    def layers(self, cfg: dict) -> int:
        return cfg.get("num_hidden_layers", cfg.get("n_layer"))

    def intermediate(self, cfg: dict) -> int:
        return cfg.get(self.intermediate_field) or cfg.get("n_inner") or 4 * self.hidden(cfg)

    def experts(self, cfg: dict) -> int:
        """The experts of each MoE layer (0: a dense model). Configs spell the count either way
        (transformers' attribute maps: Qwen3-MoE's `num_experts` is saved as `num_local_experts`)."""
        if not self.experts_field:
            return 0
        return cfg.get(self.experts_field) or cfg.get("num_local_experts") or cfg.get("num_experts") or 0

    def expert_intermediate(self, cfg: dict) -> int:
        """One expert's MLP width (0: a dense model)."""
        return (cfg.get(self.expert_intermediate_field) or 0) if self.experts_field else 0

    def max_positions(self, cfg: dict) -> int | None:
        return cfg.get("max_position_embeddings", cfg.get("n_positions"))


@dataclass(frozen=True)
class DistilBert(Architecture):
    """DistilBERT's config names: n_heads, dim, n_layers, hidden_dim."""

    def heads(self, cfg: dict) -> int:
        return cfg.get("n_heads")

    def hidden(self, cfg: dict) -> int:
        return cfg.get("dim")

    def layers(self, cfg: dict) -> int:
        return cfg.get("n_layers")

    def intermediate(self, cfg: dict) -> int:
        return cfg.get("hidden_dim") or 4 * self.hidden(cfg)


@dataclass(frozen=True)
class Roberta(Architecture):
    """RoBERTa numbers positions from padding_idx + 1, so max_position_embeddings (514 in the
    released checkpoints) holds that many fewer tokens."""

    def max_positions(self, cfg: dict) -> int | None:
        n = super().max_positions(cfg)
        return n - (cfg.get("pad_token_id") or 0) - 1 if n else n


@dataclass(frozen=True)
class Falcon(Architecture):
    """Falcon's kv heads: `num_kv_heads` in the new decoder layout, one in 7B's multi-query."""

    def kv_heads(self, cfg: dict) -> int:
        if cfg.get("new_decoder_architecture"):
            return cfg.get("num_kv_heads") or self.heads(cfg)
        return 1 if cfg.get("multi_query", True) else self.heads(cfg)


ARCHITECTURES = {
    a.model_type: a
    for a in [
        Architecture("llama", "llama"),
        Architecture("mistral", "llama"),
        Architecture("qwen2", "llama"),
        Architecture("gpt2", "gpt2"),
        Architecture("opt", "gpt2", intermediate_field="ffn_dim"),  # LayerNorm, learned positions, ReLU
        Architecture("phi", "gpt2"),  # partial RoPE, parallel attention + MLP off one LayerNorm, GELU
        Architecture("gemma", "llama"),  # RMSNorm (1 + w), scaled embeddings, GeGLU, GQA
        Architecture("qwen3", "llama"),  # per-head RMSNorm of q and k
        Architecture("stablelm", "llama"),  # LayerNorm, partial RoPE, gated MLP
        Architecture("starcoder2", "gpt2"),  # LayerNorm with biases, GELU MLP, GQA, sliding window
        Architecture("olmo", "llama"),  # LayerNorm without parameters
        Architecture("olmo2", "llama"),  # RMSNorm after attention and MLP, RMSNorm of all q and k heads
        Architecture(
            "cohere", "llama", logits=("logit_scale",)
        ),  # parallel attention + MLP off one LayerNorm, interleaved RoPE, logit scale
        Architecture(
            "granite", "llama", logits=("logits_scaling",)
        ),  # embedding, residual, attention and logit multipliers
        Architecture(
            "gemma2", "llama", logits=("final_logit_softcapping",)
        ),  # alternating sliding/full layers, attention and logit soft-capping, pre/post norms
        Architecture(
            "gemma3_text", "llama", logits=("final_logit_softcapping",)
        ),  # local and global layers, per-head q/k RMSNorm, pre/post norms
        Architecture(
            "bloom", "gpt2"
        ),  # ALiBi (no positions), fused query_key_value per head, embedding LayerNorm, tied head
        Falcon("falcon", "gpt2", intermediate_field="ffn_hidden_size"),  # multi-query or grouped kv, parallel
        Architecture("gptj", "gpt2"),  # interleaved partial rotary, parallel attention + MLP
        Architecture("gpt_neox", "gpt2"),  # query_key_value fused per head, partial rotary
        Architecture("phi3", "llama"),  # checkpoint-fused qkv_proj sliced by offsets, gate_up chunked
        # mixtures of experts: a router (linear, softmax, top-k, renormalized or not) and experts
        Architecture(
            "mixtral", "llama", experts_field="num_local_experts", expert_intermediate_field="intermediate_size"
        ),  # top-k renormalized
        Architecture(
            "qwen2_moe", "llama", experts_field="num_experts", expert_intermediate_field="moe_intermediate_size"
        ),  # a sigmoid-gated shared expert, dense layers
        Architecture(
            "qwen3_moe", "llama", experts_field="num_experts", expert_intermediate_field="moe_intermediate_size"
        ),  # per-head q/k RMSNorm, dense layers
        Architecture(
            "olmoe", "llama", experts_field="num_experts", expert_intermediate_field="intermediate_size"
        ),  # RMSNorm of all q and k heads
        # encoders: bidirectional attention with a key-padding mask, post-LayerNorm, GELU MLP
        Architecture("bert", "bert", kind="encoder"),  # absolute positions, token types
        Roberta("roberta", "bert", kind="encoder"),  # positions counted from padding_idx + 1
        Roberta("xlm-roberta", "bert", kind="encoder"),
        DistilBert("distilbert", "bert", kind="encoder"),  # no token types; sinusoidal or learned positions
    ]
}


def architecture_for(config: dict, where: str) -> Architecture:
    mt = config.get("model_type")
    if mt not in ARCHITECTURES:
        raise UserError(f"{where}: unsupported model_type {mt!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[mt]
    for field in ("vocab_size",):
        if not isinstance(config.get(field), int):
            raise UserError(f"{where}: missing or invalid field '{field}'")
    if not isinstance(arch.heads(config), int) or not isinstance(arch.hidden(config), int):
        raise UserError(f"{where}: missing or invalid field 'num_attention_heads'/'hidden_size'")
    if not isinstance(arch.layers(config), int) or arch.layers(config) < 1:
        raise UserError(f"{where}: missing or invalid field 'num_hidden_layers' (a positive integer)")
    return arch
