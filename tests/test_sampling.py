"""runtime/sampling.py: batched per-request sampling (sample_batch) and logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsc.runtime.sampling import gumbel_noise, logprobs, sample_batch


def _batch(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0, max_top_k=None):
    """sample_batch with per-row parameters given as scalars or lists, flags derived as the host does."""
    n = logits.shape[0]
    col = lambda v, dt: torch.as_tensor(v if isinstance(v, (list, torch.Tensor)) else [v] * n, dtype=dt)  # noqa: E731
    t, k, p = col(temperature, torch.float32), col(top_k, torch.int64), col(top_p, torch.float32)
    return sample_batch(
        logits,
        t,
        k,
        p,
        col(seed, torch.int64),
        col(step, torch.int64),
        any_sampled=bool((t > 0).any()),
        any_top_k=bool((k > 0).any()),
        any_top_p=bool((p < 1).any()),
        max_top_k=max_top_k,
    )


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of counts against probs (cells with p > 0)."""
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def _draws(row_logits, n=20000, **kw):
    """n tokens for one row of logits, one per seed (and a step that varies too)."""
    logits = row_logits.expand(n, -1).contiguous()
    seeds = torch.arange(n) * 7919 + 3
    return _batch(logits, seed=seeds, step=torch.arange(n) % 5, **kw)


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_distribution_is_softmax_over_temperature(temperature):
    tokens = _draws(LOGITS, temperature=temperature)
    counts = torch.bincount(tokens, minlength=7).double()
    probs = (LOGITS[0].double() / temperature).softmax(-1)
    assert _chi_square_p(counts, probs) > 1e-3
    # the test has the power to see a wrong temperature
    wrong = (LOGITS[0].double() / (temperature * 1.3)).softmax(-1)
    assert _chi_square_p(counts, wrong) < 1e-6


@pytest.mark.parametrize("k,max_top_k", [(1, None), (3, None), (3, 3), (3, 8), (6, None)])
def test_top_k_keeps_the_k_largest_with_renormalised_mass(k, max_top_k):
    tokens = _draws(LOGITS, top_k=k, max_top_k=max_top_k)
    counts = torch.bincount(tokens, minlength=7).double()
    assert counts[k:].sum() == 0
    assert (counts[:k] > 0).all()
    if k > 1:
        assert _chi_square_p(counts[:k], LOGITS[0, :k].double().softmax(-1)) > 1e-3


@pytest.mark.parametrize("top_p,kept", [(0.5, 1), (0.7, 2), (0.9, 4), (0.99, 6)])
def test_top_p_keeps_the_nucleus(top_p, kept):
    probs = LOGITS[0].double().softmax(-1)
    # kept: the smallest head of the ranking whose mass reaches top_p
    assert probs[:kept].sum() >= top_p > probs[: kept - 1].sum()
    tokens = _draws(LOGITS, top_p=top_p)
    counts = torch.bincount(tokens, minlength=7).double()
    assert counts[kept:].sum() == 0
    if kept > 1:
        assert _chi_square_p(counts[:kept], probs[:kept] / probs[:kept].sum()) > 1e-3


def test_top_k_then_top_p():
    # top-k 3 renormalises to about [.63, .23, .14]; top-p .8 then keeps the first two
    tokens = _draws(LOGITS, top_k=3, top_p=0.8)
    counts = torch.bincount(tokens, minlength=7).double()
    assert counts[2:].sum() == 0 and counts[1] > 0


def test_unsorted_vocabulary_and_permutation_of_ids():
    # the same distribution over shuffled token ids: filtering follows the values, not the index
    perm = torch.tensor([4, 0, 6, 2, 5, 1, 3])
    logits = torch.empty_like(LOGITS)
    logits[0, perm] = LOGITS[0]
    counts = torch.bincount(_draws(logits, top_k=3, top_p=0.95), minlength=7).double()
    assert counts[perm[3:]].sum() == 0 and (counts[perm[:3]] > 0).all()


def test_greedy_rows_are_exact_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(9, 1023)
    temperature = [0.0, 1.0, 0.0, 0.8, 0.0, 2.0, 0.0, 0.0, 1.0]
    tokens = _batch(
        logits,
        temperature=temperature,
        top_k=[0, 5, 3, 0, 0, 0, 1, 0, 0],
        top_p=[1.0, 0.9, 0.5, 1.0, 0.2, 1.0, 1.0, 1.0, 0.5],
        seed=list(range(9)),
    )
    greedy = logits.argmax(-1)
    for r, t in enumerate(temperature):
        if t == 0:
            assert tokens[r] == greedy[r]
    assert torch.equal(_batch(logits, temperature=0.0), greedy)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, 1.0, 1.5]),
            st.integers(0, 40),
            st.sampled_from([1.0, 0.3, 0.9]),
            st.integers(0, 2**63 - 1),
            st.integers(0, 2**40),
        ),
        min_size=2,
        max_size=6,
    ),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_a_rows_token_depends_on_its_own_parameters_only(rows, data_seed):
    gen = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(rows), 301, generator=gen)
    temperature, top_k, top_p, seed, step = (list(c) for c in zip(*rows))
    together = _batch(logits, temperature, top_k, top_p, seed, step)
    for r in range(len(rows)):
        alone = _batch(logits[r : r + 1], temperature[r], top_k[r], top_p[r], seed[r], step[r])
        assert together[r] == alone[0]


def test_same_seed_and_step_same_token_and_different_ones_differ():
    logits = torch.zeros(1, 50000)  # uniform: the noise alone picks the token
    one = lambda seed, step: int(_batch(logits, seed=seed, step=step)[0])  # noqa: E731
    assert one(12345, 7) == one(12345, 7)
    by_seed = {one(s, 7) for s in range(40)}
    by_step = {one(12345, s) for s in range(40)}
    assert len(by_seed) > 35 and len(by_step) > 35
    assert one(2**63 - 1, 0) != one(2**31 - 1, 0)  # the seed's high bits count
    assert one(0, 2**40) != one(0, 0)


def test_noise_is_gumbel_and_uncorrelated_across_neighbours():
    g = gumbel_noise(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1]), 200000)
    assert torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772) < 0.01 and abs(float(g.std()) - 1.2825) < 0.01
    # neighbouring seeds, steps and token ids
    corr = torch.corrcoef(torch.stack([g[0], g[1], g[2], g[0].roll(1)]))
    assert corr[0, 1:].abs().max() < 0.01


def test_consecutive_steps_draw_independent_tokens():
    n = 100000
    tokens = _batch(torch.zeros(n, 8), seed=12345, step=torch.arange(n))  # uniform over 8 tokens
    pairs = torch.bincount(tokens[:-1] * 8 + tokens[1:], minlength=64).double()
    assert _chi_square_p(pairs, torch.full((64,), 1 / 64, dtype=torch.float64)) > 1e-3


def test_logprobs():
    torch.manual_seed(1)
    logits = torch.randn(4, 97)
    tokens = torch.tensor([3, 50, 96, 0])
    chosen, ids, lps = logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(chosen.double(), ref[torch.arange(4), tokens], atol=1e-5)
    assert torch.equal(ids, ref.topk(5, -1).indices)
    assert torch.allclose(lps.double(), ref.topk(5, -1).values, atol=1e-5)
    assert (lps[:, :-1] >= lps[:, 1:]).all()
    chosen0, ids0, lps0 = logprobs(logits, tokens, 0)
    assert ids0.shape == (4, 0) and lps0.shape == (4, 0) and torch.equal(chosen0, chosen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager_and_the_cpu():
    dev, n, v = "cuda", 64, 32003
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(n, v, device=dev, generator=gen) * 3
    temperature = torch.full((n,), 0.8, device=dev)
    temperature[::2] = 0
    top_k = torch.zeros(n, dtype=torch.int64, device=dev)
    top_k[1::4] = 50
    top_p = torch.ones(n, device=dev)
    top_p[3::4] = 0.9
    seed, step = torch.arange(n, device=dev) * 1000003, torch.arange(n, device=dev)
    args = (logits, temperature, top_k, top_p, seed, step)
    flags = dict(any_sampled=True, any_top_k=True, any_top_p=True)
    eager = sample_batch(*args, **flags)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sample_batch(*args, **flags)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_batch(*args, **flags)
    graph.replay()
    assert torch.equal(out, eager)
    step += 1  # the next step, in place: the graph reads the new values
    graph.replay()
    assert torch.equal(out, sample_batch(*args, **flags))
    assert torch.equal(out.cpu(), sample_batch(*(a.cpu() for a in args), **flags))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(temperature=-1), "temperature: Input should be greater than or equal to 0, got -1"),
        (dict(temperature=float("nan")), "temperature: Input should be a finite number"),
        (dict(top_p=0), "top_p: Input should be greater than 0, got 0"),
        (dict(max_tokens=True), "max_tokens: Input should be a valid integer, got True"),
        (dict(n=129), "n: Input should be less than or equal to 128, got 129"),
        (dict(seed=2**63), "seed: Input should be less than"),
        (dict(stop=["ok", ""]), "stop: expected a non-empty string or a list of them"),
        (dict(stop_token_ids=[3, -1]), "stop_token_ids: expected a list of token ids >= 0"),
        (dict(logprobs=21), "logprobs: Input should be less than or equal to 20, got 21"),
        (dict(ignore_eos="yes"), "ignore_eos: Input should be a valid boolean, got 'yes'"),
        (dict(temprature=0.5), "temprature: Extra inputs are not permitted"),
    ],
)
def test_sampling_params_are_checked_on_construction(fields, message):
    """SamplingParams rejects a value out of its range when it is made (one line naming the
    field), before any engine sees it; assigning one later is refused too."""
    from dsc.errors import UserError
    from dsc.runtime.llm import SamplingParams

    with pytest.raises(UserError) as e:
        SamplingParams(**fields)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    p = SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2), temperature=1)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [1, 2] and p.temperature == 1.0
    with pytest.raises(Exception, match="top_k"):
        p.top_k = -2
