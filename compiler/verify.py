"""Check a compiled artifact against transformers' own model on the same weights.

Greedy tokens are compared token for token; logits are compared teacher-forced (both models
see the same token sequence), step by step, as the largest absolute difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsc.compiler.sample_text import random_prompts as sample_prompts  # (the random prompts' name here)


@dataclass
class VerifyReport:
    prompts: list[list[int]]
    ref_tokens: list[list[int]]
    dsc_tokens: list[list[int]]
    max_abs_err: float  # over all steps and prompts, teacher-forced logits
    max_rel_err: float  # max_abs_err / max |ref logit|
    per_step_err: list[float] = field(default_factory=list)

    @property
    def tokens_equal(self) -> bool:
        return self.ref_tokens == self.dsc_tokens

    @property
    def token_agreement(self) -> float:
        pairs = [(a, b) for r, d in zip(self.ref_tokens, self.dsc_tokens) for a, b in zip(r, d)]
        return sum(a == b for a, b in pairs) / max(len(pairs), 1)

    def summary(self) -> str:
        return (
            f"verify: {len(self.prompts)} prompts, greedy tokens "
            f"{'identical' if self.tokens_equal else 'DIFFER'} "
            f"(agreement {self.token_agreement:.1%}); logits max abs err {self.max_abs_err:.3g} "
            f"(relative {self.max_rel_err:.3g})"
        )


def reference_model(checkpoint: str | Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    path = Path(checkpoint)
    where = (
        dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name)
        if path.suffix == ".gguf"
        else dict(pretrained_model_name_or_path=checkpoint)
    )  # transformers dequantizes a GGUF file itself
    m = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype, attn_implementation="eager")
    return m.eval()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation (no stop tokens) and its teacher-forced logits [new_tokens, V]."""
    seq = list(prompt)
    for _ in range(new_tokens):
        logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    full = model(torch.tensor([seq])).logits[0].float()  # [len, V]
    n = len(prompt)
    return seq[n:], full[n - 1 : n - 1 + new_tokens]


@torch.no_grad()
def verify_artifact(
    artifact: str | Path,
    checkpoint: str | Path,
    prompts: list[list[int]] | None = None,
    new_tokens: int = 8,
    engine=None,
) -> VerifyReport:
    import dsc

    engine = engine or dsc.load(artifact, device="cpu")
    prompts = prompts or sample_prompts(engine.vocab_size, batch=min(3, engine.max_batch))
    ref = reference_model(checkpoint, engine.dtype)
    ref_tokens, ref_logits = zip(*(reference_greedy(ref, p, new_tokens) for p in prompts))
    got = engine.generate(prompts, max_new_tokens=new_tokens, stop_tokens=[]).tokens
    # teacher-forced: feed the reference tokens, compare every step's logits
    errs, scale = [], 0.0
    logits = engine.prefill(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    for step in range(new_tokens):
        want = torch.stack([r[step] for r in ref_logits])
        errs.append(float((logits.cpu() - want).abs().max()))
        scale = max(scale, float(want.abs().max()))
        tok = torch.tensor([r[step] for r in ref_tokens])
        if step < new_tokens - 1:
            logits = engine.decode(tok.to(engine.device), (lens + step).to(engine.device))
    return VerifyReport(
        list(prompts), [list(t) for t in ref_tokens], got, max(errs), max(errs) / max(scale, 1e-12), errs
    )
