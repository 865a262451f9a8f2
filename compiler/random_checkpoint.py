"""Random-weight Hugging Face checkpoints for demos, tests and benchmarks.

Real checkpoints cannot be downloaded here, so dsc makes its own: a config.json of a named
shape, weights written tensor by tensor (an 8B shape never sits in memory), and a real
byte-level BPE tokenizer trained on a small embedded corpus.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

SHAPES = {
    # name: (model_type, config fields)
    "llama-tiny": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=512,
        ),
    ),
    "llama-odd": (
        "llama",
        dict(
            hidden_size=72,
            intermediate_size=200,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_hidden_layers=3,
            vocab_size=509,
        ),
    ),
    "llama-demo": (
        "llama",
        dict(
            hidden_size=256,
            intermediate_size=688,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_hidden_layers=4,
            vocab_size=1024,
        ),
    ),
    # sliding-window attention: windows shorter than the tests' prompts plus new tokens;
    # Qwen2's first layer (< max_window_layers) keeps full attention
    "mistral-tiny": (
        "mistral",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=512,
            sliding_window=8,
        ),
    ),
    "qwen2-tiny": (
        "qwen2",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=512,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
    ),
    # OPT: pre-LN (125m, 1.3b and up), and 350m's post-LN with a narrower embedding projected in/out
    "opt-tiny": (
        "opt",
        dict(
            hidden_size=64,
            ffn_dim=176,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=512,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
        ),
    ),
    "opt-proj": (
        "opt",
        dict(
            hidden_size=64,
            ffn_dim=176,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=512,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
        ),
    ),
    # more architectures whose transformers code dsc traces unchanged
    "gptj-tiny": ("gptj", dict(n_embd=64, n_head=4, n_layer=2, vocab_size=512, n_positions=256, rotary_dim=8)),
    "gpt_neox-tiny": (
        "gpt_neox",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=512,
            max_position_embeddings=256,
            rotary_pct=0.25,
        ),
    ),
    "phi-tiny": (
        "phi",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=512,
            max_position_embeddings=256,
            partial_rotary_factor=0.5,
        ),
    ),
    "gemma-tiny": (
        "gemma",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=2,
            vocab_size=512,
        ),
    ),
    "phi3-tiny": (
        "phi3",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=512,
            max_position_embeddings=256,
            pad_token_id=0,
        ),
    ),
    # the families of tests/test_families.py: sizes that are not powers of two (72 hidden, 6 heads
    # of 12 over 2 kv heads, 200 MLP, 510 vocabulary), windows shorter than the tests' prompts
    **{
        f"{mt}-odd": (
            mt,
            dict(
                hidden_size=72,
                intermediate_size=200,
                num_attention_heads=6,
                num_key_value_heads=2,
                num_hidden_layers=2,
                vocab_size=510,
                max_position_embeddings=256,
                **extra,
            ),
        )
        for mt, extra in [
            ("qwen3", dict(head_dim=12)),
            ("stablelm", dict(partial_rotary_factor=0.5)),
            ("starcoder2", dict(sliding_window=8)),
            ("olmo", {}),
            ("olmo2", {}),
            ("cohere", dict(logit_scale=0.25)),
            (
                "granite",
                dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
            ),
            # soft-caps small enough to change these random weights' scores and logits
            (
                "gemma2",
                dict(
                    head_dim=12,
                    query_pre_attn_scalar=10,
                    sliding_window=6,
                    attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0,
                ),
            ),
            (
                "gemma3_text",
                dict(
                    head_dim=12,
                    query_pre_attn_scalar=10,
                    sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"],
                ),
            ),
        ]
    },
    # mixtures of experts: more experts than top-k, widths not powers of two; Qwen's second layer
    # a dense MLP (mlp_only_layers) and Qwen2-MoE's sigmoid-gated shared expert
    **{
        f"{mt}-odd": (
            mt,
            dict(
                hidden_size=72,
                num_attention_heads=6,
                num_key_value_heads=2,
                num_hidden_layers=2,
                vocab_size=510,
                max_position_embeddings=1024,
                **extra,
            ),
        )
        for mt, extra in [
            ("mixtral", dict(intermediate_size=56, num_local_experts=6, num_experts_per_tok=2)),
            (
                "qwen2_moe",
                dict(
                    intermediate_size=200,
                    moe_intermediate_size=40,
                    shared_expert_intermediate_size=88,
                    num_experts=6,
                    num_experts_per_tok=2,
                    mlp_only_layers=[1],
                ),
            ),
            (
                "qwen3_moe",
                dict(
                    intermediate_size=200,
                    moe_intermediate_size=40,
                    num_experts=6,
                    num_experts_per_tok=3,
                    norm_topk_prob=True,
                    head_dim=12,
                    mlp_only_layers=[1],
                ),
            ),
            ("olmoe", dict(intermediate_size=40, num_experts=6, num_experts_per_tok=2)),
        ]
    },
    # Falcon: 7B's layout (multi-query, one LayerNorm before parallel attention and MLP) and the
    # new decoder layout of 40B/180B (grouped kv heads fused per group, two LayerNorms)
    "falcon-odd": (
        "falcon",
        dict(
            hidden_size=72,
            num_attention_heads=6,
            num_hidden_layers=2,
            vocab_size=510,
            ffn_hidden_size=200,
            max_position_embeddings=256,
        ),
    ),
    "falcon-new-odd": (
        "falcon",
        dict(
            hidden_size=72,
            num_attention_heads=6,
            num_kv_heads=2,
            num_hidden_layers=2,
            vocab_size=510,
            ffn_hidden_size=200,
            max_position_embeddings=256,
            new_decoder_architecture=True,
            multi_query=False,
        ),
    ),
    # BLOOM: ALiBi; 6 heads take the slopes of a non-power-of-two head count
    "bloom-odd": ("bloom", dict(hidden_size=72, n_head=6, n_layer=2, vocab_size=510)),
    # encoders (bidirectional, post-LayerNorm): the odd sizes; RoBERTa's positions start past its pad id 1
    "bert-odd": (
        "bert",
        dict(
            hidden_size=72,
            intermediate_size=200,
            num_attention_heads=6,
            num_hidden_layers=2,
            vocab_size=510,
            max_position_embeddings=256,
        ),
    ),
    "roberta-odd": (
        "roberta",
        dict(
            hidden_size=72,
            intermediate_size=200,
            num_attention_heads=6,
            num_hidden_layers=2,
            vocab_size=510,
            max_position_embeddings=258,
            pad_token_id=1,
        ),
    ),
    "xlm-roberta-odd": (
        "xlm-roberta",
        dict(
            hidden_size=72,
            intermediate_size=200,
            num_attention_heads=6,
            num_hidden_layers=2,
            vocab_size=510,
            max_position_embeddings=258,
            pad_token_id=1,
        ),
    ),
    "distilbert-odd": (
        "distilbert",
        dict(dim=72, hidden_dim=200, n_heads=6, n_layers=2, vocab_size=510, max_position_embeddings=256),
    ),
    # BERT-large and all-MiniLM-L6-v2's shapes (benchmarks)
    "bert-large": (
        "bert",
        dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_attention_heads=16,
            num_hidden_layers=24,
            vocab_size=30522,
            max_position_embeddings=512,
        ),
    ),
    "minilm-l6": (
        "bert",
        dict(
            hidden_size=384,
            intermediate_size=1536,
            num_attention_heads=12,
            num_hidden_layers=6,
            vocab_size=30522,
            max_position_embeddings=512,
        ),
    ),
    "gpt2-tiny": ("gpt2", dict(n_embd=64, n_head=4, n_layer=2, vocab_size=512, n_positions=1024)),
    "gpt2-odd": ("gpt2", dict(n_embd=72, n_head=6, n_layer=3, vocab_size=509, n_positions=1024)),
    "llama-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=16,
            vocab_size=128256,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            head_dim=64,
            max_position_embeddings=131072,
        ),
    ),
    "llama-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=32,
            vocab_size=128256,
            rope_theta=500000.0,
            max_position_embeddings=131072,
        ),
    ),
    # batch-1 decode benchmarks of other families at their real sizes: Falcon-7B (multi-query:
    # 71 query heads over one kv head, parallel attention + MLP) and Qwen3-8B (per-head q/k norm)
    "falcon-7b": (
        "falcon",
        dict(
            hidden_size=4544,
            num_attention_heads=71,
            num_hidden_layers=32,
            vocab_size=65024,
            ffn_hidden_size=18176,
            max_position_embeddings=2048,
            parallel_attn=True,
            multi_query=True,
            bias=False,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=36,
            vocab_size=151936,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
    ),
    # mixtures of experts at their real layer sizes, fewer layers (a GPU box's disk holds neither
    # Mixtral-8x7B's 93 GB nor Qwen3-30B-A3B's 61 GB twice, as checkpoint and artifact)
    "mixtral-8x7b-4l": (
        "mixtral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=4,
            vocab_size=32000,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=1e6,
            max_position_embeddings=32768,
        ),
    ),
    "qwen3-30b-a3b-8l": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_hidden_layers=8,
            vocab_size=151936,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            rope_theta=1e6,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
    ),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_head=25, n_layer=48, vocab_size=50257, n_positions=1024)),
}

_CORPUS = """\
dsc is an ahead-of-time compiler for transformer inference. It traces a Hugging Face
checkpoint to a graph, runs fusion, tensor-parallel sharding and int8 quantization passes,
and writes an artifact that a thin runtime loads in production. The quick brown fox jumps
over the lazy dog. Once upon a time there was a small model that learned to count: one two
three four five six seven eight nine ten. Hello world! The weather today is sunny and warm.
"""


def make_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    """Train a byte-level BPE on the embedded corpus; save tokenizer.json and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1000),
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {"bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>")}
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 4096,
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    return ids


def saved_shapes(lm, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Parameter shapes -> the keys and shapes `save_pretrained` writes: transformers' own
    reverse key mapping (GPT-NeoX's lm_head is stored as `embed_out`, as in real Pythia
    checkpoints; a mixture of experts' 3-D weights as one tensor per expert and projection),
    run on small tags that say which parameter, and which of its rows, each saved tensor holds."""
    from transformers.core_model_loading import revert_weight_conversion

    order = list(shapes)
    tags = {}
    for i, name in enumerate(order):
        shp = shapes[name]
        rows = (
            torch.arange(shp[0] * shp[1]).view(shp[0], shp[1], 1)
            if len(shp) == 3
            else torch.zeros((), dtype=torch.long)
        )
        tags[name] = rows + (i << 32)
    out = {}
    for saved, t in revert_weight_conversion(lm, tags).items():
        shp = shapes[order[int(t.flatten()[0]) >> 32]]
        out[saved] = (t.numel(), shp[-1]) if len(shp) == 3 else shp  # an expert's rows, one tag each
    return out


def make_random_checkpoint(
    out: str | Path,
    shape: str = "llama-tiny",
    dtype: str = "float32",
    seed: int = 0,
    tokenizer: bool = True,
    outlier_channels: int = 0,
    shard_bytes: int | None = None,
    device: str = "cpu",
    **overrides,
) -> Path:
    """Write config.json, safetensors weights (sharded with an index when shard_bytes is set)
    and a tokenizer. `outlier_channels` > 0 scales that many input channels of every linear
    weight by 20x, the outliers that make int8 hard."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from dsc.compiler.architectures import ARCHITECTURES
    from dsc.compiler.trace import _parameters_on_meta
    from dsc.compiler.weights import write_safetensors

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_type, fields = SHAPES[shape]
    fields = {**fields, **overrides}
    ids = make_tokenizer(out, fields["vocab_size"]) if tokenizer else {"bos_token_id": 0, "eos_token_id": 1}
    cfg = AutoConfig.for_model(model_type, **fields, **ids, torch_dtype=dtype)
    cfg.save_pretrained(out)
    encoder = ARCHITECTURES[model_type].kind == "encoder"  # saved as its base model, pooler included
    with _parameters_on_meta():
        lm = AutoModel.from_config(cfg) if encoder else AutoModelForCausalLM.from_config(cfg)
    tied = set()
    if getattr(cfg, "tie_word_embeddings", False):
        tied = {n for n, _ in lm.named_parameters(remove_duplicate=False)} - {n for n, _ in lm.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in lm.named_parameters() if n not in tied}
    params = {n: (s, getattr(torch, dtype)) for n, s in saved_shapes(lm, shapes).items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda shape_: torch.randn(shape_, generator=gen, device=device)  # noqa: E731

    def produce(name: str) -> torch.Tensor:
        shape_, dt = params[name]
        if name.endswith(("norm.weight", "Norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
            return (1.0 + 0.1 * randn(shape_)).to(dt).cpu()
        if name.endswith("bias") or len(shape_) == 1:
            return (0.02 * randn(shape_)).to(dt).cpu()
        fan_in = shape_[0] if model_type == "gpt2" and "wte" not in name and "wpe" not in name else shape_[-1]
        t = randn(shape_) / math.sqrt(fan_in)
        if outlier_channels and t.dim() == 2 and "wte" not in name and "embed" not in name:
            in_dim = 0 if model_type == "gpt2" else 1
            idx = torch.randperm(t.shape[in_dim], generator=gen, device=device)[:outlier_channels]
            t.index_fill_(in_dim, idx, 0).index_add_(in_dim, idx, 20 * t.index_select(in_dim, idx))
        return t.to(dt).cpu()

    entries = sorted((n, s, d) for n, (s, d) in params.items())
    if not shard_bytes:
        write_safetensors(out / "model.safetensors", entries, produce)
        return out
    shards, cur, size = [], [], 0
    for e in entries:
        n = math.prod(e[1]) * torch.empty((), dtype=e[2]).element_size()
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    shards.append(cur)
    weight_map = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, group, produce)
        weight_map.update({n: fname for n, _, _ in group})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1, sort_keys=True) + "\n"
    )
    return out
