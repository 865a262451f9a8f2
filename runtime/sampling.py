"""Token selection from logits, on the device, with no host synchronisation."""

from __future__ import annotations

import math

import torch

from dsc.errors import UserError
from dsc.runtime.checks import is_int


def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int, seed: int | None = None) -> None:
    """Sampling parameters as a user gives them (CLI flag or Python argument): one UserError
    line naming the parameter when one is out of range."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise UserError(f"generate: temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not is_int(top_k) or top_k < 0:
        raise UserError(f"generate: top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise UserError(f"generate: top_p must be in (0, 1], got {top_p!r}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise UserError(f"generate: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**63):
        raise UserError(f"generate: seed must be an integer in [0, 2^63), got {seed!r}")


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits: [B, V] -> tokens [B] int64. temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    any_top_k, any_top_p = 0 < top_k < logits.shape[-1], top_p < 1.0
    if any_top_k or any_top_p:
        rows = logits.shape[0]
        logits = _filter_top_k_top_p(
            logits,
            torch.full((rows,), top_k, device=logits.device),
            torch.full((rows,), top_p, device=logits.device),
            any_top_k,
            any_top_p,
            max_top_k=top_k,
        )
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# Counter-based noise for per-request sampling. Every value lives in the low 32 bits of an int64
# and every multiplier is below 2**31, so no product reaches 2**63: no int64 overflow anywhere.
_MASK32 = 0xFFFFFFFF
_MIX_MULS = (0x7FEB352D, 0x4C2B2AE3, 0x2C1B3C6D)  # odd, < 2**31


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xorshift-multiply rounds), elementwise on int64."""
    x = x ^ (x >> 16)
    for m in _MIX_MULS:
        x = (x * m) & _MASK32
        x = x ^ (x >> 15)
    return x


def _row_keys(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """seed [N], step [N] int64 (>= 0) -> [N, 1] 32-bit keys, each a hash of both in full."""
    key = _mix32(seed & _MASK32)
    for lane in (seed >> 32, step & _MASK32, step >> 32):
        key = _mix32(key ^ lane)
    return key.unsqueeze(-1)


def _token_bits(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] int64 of 23 random bits; entry (r, t) depends only on (seed[r], step[r], t).
    The row keys [N] and token hashes [V] are fully mixed; the [N, V] stage, where the cost is,
    combines them with one multiply-xorshift-multiply round."""
    tokens = _mix32(torch.arange(vocab, device=seed.device, dtype=torch.int64) ^ 0x5BD1E995)  # [V]
    x = (_row_keys(seed, step) ^ tokens).mul_(_MIX_MULS[0]).bitwise_and_(_MASK32)  # [N, V]
    x = x.bitwise_xor_(x >> 15).mul_(_MIX_MULS[1]).bitwise_and_(_MASK32)
    return x.bitwise_right_shift_(9)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 Gumbel(0, 1) noise; entry (r, t) depends only on (seed[r], step[r], t)."""
    return _neg_gumbel(seed, step, vocab).neg_()


def _neg_gumbel(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """log(-log(u)), u uniform in (0, 1): minus the Gumbel noise, in place as far as it goes.
    u = (bits + 0.5) / 2**23 is exactly representable in float32 at both ends, so -log(u) > 0
    and every value is finite."""
    u = _token_bits(seed, step, vocab).float().add_(0.5).mul_(1.0 / (1 << 23))
    return u.log_().neg_().log_()


def _filter_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    any_top_k: bool,
    any_top_p: bool,
    max_top_k: int | None,
) -> torch.Tensor:
    """logits [N, V] (already divided by temperature) with the tokens outside each row's top-k,
    then outside its top-p nucleus, set to -inf (`sample`'s semantics, per row)."""
    V = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).unsqueeze(-1)  # [N, 1], V = off
    if not any_top_p:
        # only top-k: the k-th value is the threshold; topk over the largest k asked suffices
        width = V if max_top_k is None else max(1, min(max_top_k, V))
        top = torch.topk(logits, width, dim=-1).values  # [N, width], descending
        kth = top.gather(-1, (k.clamp(max=width) - 1))
        kth = torch.where(k >= V, torch.full_like(kth, float("-inf")), kth)
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [N, V]
    if any_top_k:
        kth = sorted_logits.gather(-1, k - 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # drop a token when the tokens ranked above it already hold top_p of the mass (rows with
    # top_p = 1 keep everything, whatever the rounding of the cumulative sum)
    drop = (probs.cumsum(-1) - probs >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_batch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    *,
    any_sampled: bool,
    any_top_k: bool,
    any_top_p: bool,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """One token per row, each row with its own parameters, on the device with no host sync.

    logits [N, V]; temperature [N] f32 (0 = greedy: argmax of the raw logits); top_k [N] int64
    (0 = off); top_p [N] f32 (1 = off); seed [N], step [N] int64 in [0, 2**63) -> tokens [N] int64.
    A sampled row takes argmax(filtered logits / temperature + Gumbel noise), the noise a hash of
    (seed, step, token id): a request's tokens depend on its own seed and step alone, whatever
    else shares the batch. The flags come from the host, which knows every row's parameters, and
    only skip work: any_sampled (some temperature > 0), any_top_k, any_top_p, and max_top_k (the
    largest top_k, when known: a top-k without top-p then takes torch.topk of that width
    instead of a full sort). Shapes never depend on the data.
    """
    greedy = logits.argmax(dim=-1)  # [N]
    if not any_sampled:
        return greedy
    sampled_rows = temperature > 0
    temp = torch.where(sampled_rows, temperature, torch.ones_like(temperature)).unsqueeze(-1)  # [N, 1]
    scaled = logits.float() / temp
    if any_top_k or any_top_p:
        scaled = _filter_top_k_top_p(scaled, top_k, top_p, any_top_k, any_top_p, max_top_k)
    noisy = scaled.sub_(_neg_gumbel(seed, step, logits.shape[-1]))  # [N, V]
    return torch.where(sampled_rows, noisy.argmax(dim=-1), greedy)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V], tokens [N] -> (chosen [N] f32, top_ids [N, n] int64, top_logprobs [N, n] f32):
    log_softmax of the raw logits (before temperature and filtering) at the chosen token and at
    the n most likely tokens (n may be 0)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    top_logprobs, top_ids = torch.topk(lp, n, dim=-1)
    return chosen, top_ids, top_logprobs
