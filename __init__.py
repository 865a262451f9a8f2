"""dsc: an ahead-of-time compiler for transformer inference.

import dsc
dsc.compile("path/to/hf-checkpoint", "build/model", dtype="bf16")   # compiler (needs transformers)
engine = dsc.load("build/model")                                   # runtime (torch + safetensors)
engine.generate([[1, 2, 3]], max_new_tokens=16)
llm = dsc.LLM("build/model"); llm.generate(["Hello"], dsc.SamplingParams(max_tokens=16))
"""

__version__ = "0.1.0"


def load(path, rank=None, device=None, **kwargs):
    """Load a compiled artifact; see dsc.runtime.load."""
    from dsc.runtime import load as _load

    return _load(path, rank=rank, device=device, **kwargs)


def compile(model, out, **options):  # noqa: A001  (mirrors torch.compile / deepspeed naming)
    """Compile a checkpoint folder, hub id or loaded transformers model; see dsc.compiler.compile."""
    from dsc.compiler import compile as _compile

    return _compile(model, out, **options)


def __getattr__(name):
    """dsc.LLM, dsc.SamplingParams, dsc.LLMEngine: the continuous-batching API (runtime/llm.py),
    imported on first use."""
    if name in ("LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"):
        from dsc.runtime import llm

        return getattr(llm, name)
    if name in ("EmbeddingEngine", "EmbeddingParams", "EmbeddingRequestOutput"):  # runtime/embed.py
        from dsc.runtime import embed

        return getattr(embed, name)
    raise AttributeError(f"module 'dsc' has no attribute {name!r}")
