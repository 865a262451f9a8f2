"""Attention variants: logit soft-capping (gemma2) and ALiBi (bloom) in every dsc attention op.

Every op takes `softcap` (> 0: scores s -> softcap * tanh(s / softcap), after the scale, before
the mask) and `alibi_slopes` ([H] fp32: + slope_h * (key position - query position)) after its
window. The plain-torch references are checked against a per-head float64 loop written from
that definition, and against transformers' own formulas (bloom's `build_alibi_tensor` +
baddbmm, gemma2's eager attention); the passes carry the arguments from the traced op to the
bound and fused ones, and record nothing where they are unset. The Triton kernels run every
variant (static prefill, decode, rotary decode; paged decode, varlen, mixed) in the interpreter
at odd shapes against the references, and build for sm_90 with the variant on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
from paged_steps import Case as StepCase
from paged_steps import alibi_slopes_for, args_of, build

from dsc import kernels as _kernels  # noqa: F401  (registers the dsc ops)

dsc = torch.ops.dsc


@dataclass(frozen=True)
class Variant:
    H: int
    Hkv: int
    D: int
    window: int = 0
    softcap: float = 0.0
    alibi: bool = False


VARIANTS = {
    "softcap-gqa3-d40": Variant(6, 2, 40, softcap=1.5),
    "alibi-gqa2-d72": Variant(6, 3, 72, alibi=True),
    "both-gqa3-d40": Variant(6, 2, 40, softcap=2.0, alibi=True),
    "both-window-gqa2-d72": Variant(6, 3, 72, window=5, softcap=1.5, alibi=True),
    "alibi-window-mqa-d40": Variant(6, 1, 40, window=7, alibi=True),
    "softcap-window-mha-d72": Variant(6, 6, 72, window=4, softcap=1.0),
}


def naive(q, k, v, q_pos, k_pos, scale, window=0, softcap=0.0, slopes=None):
    """The definition, head by head in float64: q [B, H, S, D], k/v [B, Hkv, L, D], q_pos [B, S],
    k_pos [L] -> [B, S, H, D]."""
    B, H, S, D = q.shape
    G = H // k.shape[1]
    out = torch.empty(B, S, H, D, dtype=torch.float64)
    rel = (k_pos[None, None, :] - q_pos[:, :, None]).double()  # [B, S, L]
    seen = rel <= 0
    if window:
        seen &= rel > -window
    for h in range(H):
        s = torch.einsum("bsd,bld->bsl", q[:, h].double(), k[:, h // G].double()) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            s = s + float(slopes[h]) * rel
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
        out[:, :, h] = p @ v[:, h // G].double()
    return out


def _args(var: Variant):
    return dict(softcap=var.softcap, alibi_slopes=alibi_slopes_for(var.H) if var.alibi else None)


def _close(got, want, tol=2e-5):
    err = ((got.double() - want).abs().max() / want.abs().max().clamp(min=1)).item()
    assert err <= tol, f"relative max error {err:.3g}"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_causal_attention_reference(name):
    var = VARIANTS[name]
    g = torch.Generator().manual_seed(1)
    B, S = 2, 23
    q, k, v = (torch.randn(B, h, S, var.D, generator=g) for h in (var.H, var.Hkv, var.Hkv))
    scale = var.D**-0.5
    got = dsc.causal_attention(q, k, v, torch.zeros(B, dtype=torch.long), scale, var.window, **_args(var))
    pos = torch.arange(S)
    _close(got, naive(q, k, v, pos.expand(B, S), pos, scale, var.window, var.softcap, _args(var)["alibi_slopes"]))


def _static_inputs(var: Variant, S: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    B, Smax = 3, 41
    q, k, v = (torch.randn(B, h, S, var.D, generator=g) for h in (var.H, var.Hkv, var.Hkv))
    caches = [torch.randn(B + 1, var.Hkv, Smax, var.D, generator=g) for _ in range(2)]
    cache_pos = torch.tensor([0, 9, 40 - S], dtype=torch.long)  # fresh, a cached prefix, the cache's end
    return q, k, v, caches, cache_pos


def _static_want(var, q, k, v, caches, cache_pos):
    """The naive output over the caches after the reference's write, and those caches."""
    from dsc.kernels.attention import write_kv_cache_reference

    kc, vc = (c.clone() for c in caches)
    write_kv_cache_reference(k, v, kc, vc, cache_pos)
    S, Smax = q.shape[2], kc.shape[2]
    q_pos = cache_pos[:, None] + torch.arange(S)
    want = naive(
        q,
        kc[: q.shape[0]],
        vc[: q.shape[0]],
        q_pos,
        torch.arange(Smax),
        q.shape[-1] ** -0.5,
        var.window,
        var.softcap,
        _args(var)["alibi_slopes"],
    )
    return want, kc, vc


@pytest.mark.parametrize("S", [1, 7])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_attention_reference(name, S):
    """dsc.attention (decode S = 1 and a prefill chunk): output and the cache write."""
    var = VARIANTS[name]
    q, k, v, caches, cache_pos = _static_inputs(var, S, seed=2)
    want, want_k, want_v = _static_want(var, q, k, v, caches, cache_pos)
    kc, vc = caches
    got = dsc.attention(q, k, v, kc, vc, cache_pos, var.D**-0.5, var.window, **_args(var))
    _close(got, want)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("name", ["both-gqa3-d40", "both-window-gqa2-d72"])
def test_rotary_attention_reference(name):
    """dsc.rotary_attention: the rotary embedding, then the variant (its arguments after rot_pos)."""
    from dsc.kernels.rotary import rotary_reference

    var = VARIANTS[name]
    q, k, v, caches, cache_pos = _static_inputs(var, 1, seed=3)
    g = torch.Generator().manual_seed(4)
    cos, sin = (torch.rand(q.shape[0], 1, var.D, generator=g) * 2 - 1 for _ in range(2))
    qr, kr = rotary_reference(q, k, cos, sin)
    want, want_k, _ = _static_want(var, qr, kr, v, caches, cache_pos)
    kc, vc = caches
    got = dsc.rotary_attention(q, k, v, cos, sin, kc, vc, cache_pos, var.D**-0.5, var.window, None, **_args(var))
    _close(got, want)
    assert torch.equal(kc, want_k)


STEPS = {  # (cached tokens, new tokens) per sequence: prompt chunks, decode tokens, a padding sequence
    "both-window-gqa2-d72": StepCase(
        3, 2, 72, 16, ((0, 9), (21, 1), (0, 0), (12, 6)), pad_rows=2, window=5, softcap=1.5, alibi=True
    ),
    "both-gqa3-d40": StepCase(2, 3, 40, 16, ((5, 4), (0, 1), (33, 1)), pad_rows=1, softcap=2.0, alibi=True),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_paged_and_ragged_reference(name):
    """dsc.paged_attention: each sequence's rows are the naive variant over its cached and new
    tokens, padding rows zeros; dsc.ragged_attention is the same with every cache_lens 0."""
    var = VARIANTS[name]
    case = STEPS[name]
    assert (case.Hkv * case.G, case.Hkv, case.D, case.window, case.softcap, case.alibi) == (
        var.H,
        var.Hkv,
        var.D,
        var.window,
        var.softcap,
        var.alibi,
    )
    step = build(case, torch.float32, seed=5)
    step["k_pool"], step["v_pool"] = step["k_pool"].nan_to_num(), step["v_pool"].nan_to_num()
    out = dsc.paged_attention(*args_of(step))
    as_rows = lambda pool, blocks: pool[blocks].transpose(0, 1).reshape(var.Hkv, -1, var.D)  # noqa: E731
    covered = torch.zeros(out.shape[1], dtype=torch.bool)
    for i, (c, n) in enumerate(case.seqs):
        if not n:
            continue
        a = int(step["query_start"][i])
        covered[a : a + n] = True
        blocks = step["block_tables"][i, : -(-(c + n) // case.BS)].long()
        kc, vc = (as_rows(p, blocks)[None, :, : c + n] for p in (step["k_pool"], step["v_pool"]))
        want = naive(
            step["q"][:, :, a : a + n],
            kc,
            vc,
            c + torch.arange(n)[None],
            torch.arange(c + n),
            step["scale"],
            var.window,
            var.softcap,
            _args(var)["alibi_slopes"],
        )
        _close(out[:, a : a + n], want)
    assert not out[:, ~covered].any()

    fresh = build(replace(case, seqs=tuple((0, n) for _, n in case.seqs)), torch.float32, seed=6)
    fresh["k_pool"], fresh["v_pool"] = fresh["k_pool"].nan_to_num(), fresh["v_pool"].nan_to_num()
    ragged_args = [a for i, a in enumerate(args_of(fresh)) if i not in (3, 4)]  # no pools
    torch.testing.assert_close(
        dsc.ragged_attention(*ragged_args), dsc.paged_attention(*args_of(fresh)), rtol=1e-6, atol=1e-6
    )


def test_unset_variant_is_the_plain_reference():
    """softcap 0 and no slopes: the same bits as the op without the arguments (SDPA's path)."""
    var = VARIANTS["both-window-gqa2-d72"]
    q, k, v, caches, cache_pos = _static_inputs(var, 7, seed=6)
    plain = dsc.attention(q, k, v, caches[0].clone(), caches[1].clone(), cache_pos, 0.3, 5)
    unset = dsc.attention(q, k, v, caches[0].clone(), caches[1].clone(), cache_pos, 0.3, 5, 0.0, None)
    assert torch.equal(plain, unset)
    capped = dsc.attention(q, k, v, caches[0].clone(), caches[1].clone(), cache_pos, 0.3, 5, 1.0)
    assert not torch.allclose(plain, capped, atol=1e-3)  # the cap changes the result at these scores


# -- against transformers' formulas ----------------------------------------------------------------
def test_alibi_matches_bloom():
    """Bloom adds slope_h * k_pos (`build_alibi_tensor`, then baddbmm into the scaled scores);
    dsc adds slope_h * (k_pos - q_pos): a per-row constant apart, the same softmax. Bloom's
    slopes for 6 heads (not a power of two: its interleaved extra slopes) feed both."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    B, H, S, D = 2, 6, 19, 40
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    alibi = build_alibi_tensor(torch.ones(B, S, dtype=torch.long), H, torch.float32)  # [B * H, 1, S]
    slopes = alibi.view(B, H, S)[0, :, 1].contiguous()  # position 1: the slope itself
    assert torch.allclose(alibi.view(B, H, S), slopes[None, :, None] * torch.arange(S))
    scale = D**-0.5
    scores = torch.baddbmm(
        alibi, q.reshape(B * H, S, D), k.reshape(B * H, S, D).transpose(1, 2), beta=1.0, alpha=scale
    ).view(B, H, S, S)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, torch.finfo(torch.float32).min), -1)
    bloom = (probs @ v).transpose(1, 2)  # [B, S, H, D]
    got = dsc.causal_attention(q, k, v, torch.zeros(B, dtype=torch.long), scale, 0, 0.0, slopes)
    torch.testing.assert_close(got, bloom, rtol=1e-5, atol=1e-5)


def test_softcap_matches_gemma2():
    """gemma2's eager attention (scaling, soft-capping, its causal mask, grouped kv heads)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    B, H, Hkv, S, D = 2, 6, 2, 17, 72
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(B, H, S, D, generator=g), *(torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    scale, cap = 0.2, 1.5
    mask = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]
    module = SimpleNamespace(num_key_value_groups=H // Hkv, training=False)
    want, _ = eager_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scale, softcap=cap)
    got = dsc.causal_attention(q, k, v, torch.zeros(B, dtype=torch.long), scale, 0, cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- the passes and the plan -------------------------------------------------------------------------
def _graph(extra: tuple, rotary: bool, tables: bool = False) -> tuple[fx.Graph, object]:
    """One layer's attention with trailing arguments `extra` ("slopes": a get_attr of the
    slopes), node vals fake: the traced dsc.causal_attention, or (rotary) the decode program's
    dsc.rotary then dsc.attention over its cache, as fuse_rotary_attention finds them (tables:
    cos and sin are lookups table[position_ids] of [P, D] tables, as fold_position_tables makes)."""
    import operator

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    g = fx.Graph()

    def node(make, *args, shape, dtype=torch.float32):
        n = make(*args)
        with mode:
            n.meta["val"] = torch.empty(shape, dtype=dtype)
        return n

    q, k, v = (node(g.placeholder, name, shape=(2, h, 1, 40)) for name, h in (("q", 6), ("k", 2), ("v", 2)))
    pos = node(g.placeholder, "cache_pos", shape=(2,), dtype=torch.long)
    extra = tuple(node(g.get_attr, "alibi_slopes.0", shape=(6,)) if a == "slopes" else a for a in extra)
    if rotary:
        if tables:
            ids = node(g.placeholder, "position_ids", shape=(2, 1), dtype=torch.long)
            cos, sin = (
                node(
                    g.call_function,
                    torch.ops.aten.index.Tensor,
                    (node(g.get_attr, f"{name}_table", shape=(64, 40)), [ids]),
                    shape=(2, 1, 40),
                )
                for name in ("cos", "sin")
            )
        else:
            cos, sin = (node(g.placeholder, name, shape=(2, 1, 40)) for name in ("cos", "sin"))
        kc, vc = (node(g.get_attr, f"kv_cache.0.{n}", shape=(4, 2, 32, 40)) for n in "kv")
        rot = g.call_function(dsc.rotary.default, (q, k, cos, sin))
        rot.meta["val"] = (q.meta["val"], k.meta["val"])
        q, k = (g.call_function(operator.getitem, (rot, i)) for i in (0, 1))
        q.meta["val"], k.meta["val"] = rot.meta["val"]
        attn = g.call_function(dsc.attention.default, (q, k, v, kc, vc, pos, 0.25, *extra))
    else:
        attn = g.call_function(dsc.causal_attention.default, (q, k, v, pos, 0.25, *extra))
    with mode:
        attn.meta["val"] = torch.empty(2, 1, 6, 40)
    g.output(attn)
    return g, mode


def _tail(node: fx.Node, start: int) -> list:
    return [(a.target if a.op == "get_attr" else a.name) if isinstance(a, fx.Node) else a for a in node.args[start:]]


EXTRAS = [(), (5,), (0, 1.5), (5, 1.5, "slopes"), (0, 0.0, "slopes")]


@pytest.mark.parametrize("extra", EXTRAS)
def test_bind_kv_cache_carries_the_variant(extra):
    from collections import Counter

    from dsc.passes.bind_kv_cache import bind_kv_cache

    g, mode = _graph(extra, rotary=False)
    model = SimpleNamespace(
        options=SimpleNamespace(max_batch=4, max_seq=32, block_size=16),
        fake_mode=mode,
        counters=Counter(),
        graphs=lambda: [("prefill", g)],
    )
    bind_kv_cache(model)
    (attn,) = [n for n in g.nodes if n.target is dsc.attention.default]
    assert _tail(attn, 7) == [("alibi_slopes.0" if a == "slopes" else a) for a in extra]


@pytest.mark.parametrize("tables", [False, True])
@pytest.mark.parametrize("extra", EXTRAS)
def test_fuse_rotary_attention_carries_the_variant(extra, tables):
    """dsc.rotary + dsc.attention -> dsc.rotary_attention: the variant after rot_pos (None where
    cos and sin are not table lookups, else the positions); without a variant the short form stays."""
    from collections import Counter

    from dsc.passes.fuse_rotary_attention import fuse_rotary_attention

    g, _ = _graph(extra, rotary=True, tables=tables)
    model = SimpleNamespace(programs={"decode": g}, counters=Counter())
    fuse_rotary_attention(model)
    assert model.counters["fuse_rotary_attention.decode"] == 1
    assert model.counters["fuse_rotary_attention.tables"] == int(tables)
    (fused,) = [n for n in g.nodes if n.target is dsc.rotary_attention.default]
    want = [("alibi_slopes.0" if a == "slopes" else a) for a in extra]
    if tables:
        want = [(want or [0])[0], "position_ids", *want[1:]]  # window, rot_pos, softcap[, slopes]
    elif len(extra) > 1:
        want = [want[0], None, *want[1:]]
    assert _tail(fused, 9) == want
    g.lint()


@pytest.mark.parametrize(
    "kwargs, want",
    [
        ({}, ()),
        ({"sliding_window": 5}, (5,)),
        ({"softcap": 30.0}, (0, 30.0)),
        ({"sliding_window": None, "softcap": None}, ()),
        ({"alibi_slopes": "slopes"}, (0, 0.0, "slopes")),
        ({"sliding_window": 4, "softcap": 2.0, "alibi_slopes": "slopes"}, (4, 2.0, "slopes")),
    ],
)
def test_trace_records_only_what_is_set(kwargs, want):
    """compiler/trace.py's attention function records the trailing arguments up to the last one
    set (plain and sliding-window graphs keep their form)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dsc.compiler.trace import dsc_attention

    slopes = alibi_slopes_for(6)
    kwargs = {key: slopes if a == "slopes" else a for key, a in kwargs.items()}
    gm = make_fx(lambda q, k, v, pos: dsc_attention(None, q, k, v, None, scaling=0.25, dsc_cache_pos=pos, **kwargs)[0])(
        torch.randn(1, 6, 4, 40), torch.randn(1, 2, 4, 40), torch.randn(1, 2, 4, 40), torch.zeros(1, dtype=torch.long)
    )
    (attn,) = [n for n in gm.graph.nodes if n.target is dsc.causal_attention.default]
    tail = [
        torch.equal(getattr(gm, a.target), slopes) and "slopes" if isinstance(a, fx.Node) else a for a in attn.args[5:]
    ]
    assert tuple(tail) == want


def test_planner_records_the_variant():
    """The plan's kernel entry names the variant where set (and nothing where not); the sm_90
    warp-specialized prefill is not chosen for it."""
    from dsc.kernels.launch import PLANNERS

    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    q, k, kc = meta(1, 32, 64, 128), meta(1, 8, 64, 128), meta(4, 8, 512, 128)
    pos, slopes = meta(1, dtype=torch.long), meta(32, dtype=torch.float32)
    plan = PLANNERS["dsc.attention.default"]
    plain = plan(q, k, k, kc, kc, pos, 0.1, arch="sm_90")
    assert plain["name"] == "gluon.attention_prefill_ws"
    capped = plan(q, k, k, kc, kc, pos, 0.1, 0, 50.0, arch="sm_90")
    assert capped["name"] == "triton.attention_prefill" and capped["config"]["softcap"] == 50.0
    alibi = plan(q[:, :, :1], k[:, :, :1], k[:, :, :1], kc, kc, pos, 0.1, 0, 0.0, slopes, arch="sm_90")
    assert alibi["name"] == "triton.attention_decode" and alibi["config"]["alibi"] is True
    assert "softcap" not in alibi["config"] and "alibi" not in plain["config"]


def test_plan_accepts_the_variant_arguments():
    """runtime/plan.py's schema check: the float softcap and the slopes node fit the op."""
    from dsc.runtime.plan import check_nodes

    nodes = [{"name": n, "kind": "input"} for n in ("q", "k", "v", "kc", "vc", "pos", "slopes")]
    args = [{"node": n} for n in ("q", "k", "v", "kc", "vc", "pos")] + [0.25, 0, 30.0, {"node": "slopes"}]
    nodes.append({"name": "attn", "kind": "call", "op": "dsc.attention.default", "args": args, "kwargs": {}})
    check_nodes(nodes)
    with pytest.raises(Exception, match="softcap"):
        check_nodes([*nodes[:-1], {**nodes[-1], "args": [*args[:8], "big", args[9]]}])


def test_inspect_names_the_variant():
    """`dsc inspect` reads each attention's variant from its kernel config (what the planner wrote)."""
    from dsc.runtime.inspect import score_variant

    node = lambda **cfg: {"kernel": {"name": "triton.attention_decode", "config": {"splits": 4, **cfg}}}  # noqa: E731
    assert score_variant(node()) == "" and score_variant({"op": "aten.mm.default"}) == ""
    assert score_variant(node(softcap=50.0)) == "softcap 50"
    assert score_variant(node(softcap=30.5, alibi=True, window=4096)) == "softcap 30.5 + ALiBi"
    assert score_variant(node(alibi=True)) == "ALiBi"
    assert score_variant(node(softcap="x", alibi="yes")) == ""  # artifact text of the wrong type: not shown


# -- the Triton kernels in the interpreter, and built for sm_90 -------------------------------------
# The cases run through the kernel tests' own harnesses (tests/test_attention_kernels.py and
# tests/test_paged_attention.py `run_case`: NaN-poisoned cache slots no query may read, the cache
# write checked bit for bit, the output against the fp32 reference), in a child process with the
# interpreter on (tests/kernel_child.py), fp32 and fp16.
def _static_cases() -> dict:
    from test_attention_kernels import SMALL_DECODE, SMALL_PREFILL, Case

    return {
        # cached prefix with a full (unmasked) tile and a partial one; new tokens with full tiles
        "prefill-both-gqa3-d40": Case(
            "prefill", 2, 6, 2, 23, 40, 61, (0, 21), config=SMALL_PREFILL, softcap=1.5, alibi=True
        ),
        "prefill-alibi-window-mqa-d72": Case(
            "prefill", 2, 6, 1, 11, 72, 40, (3, 25), config=SMALL_PREFILL, window=5, alibi=True
        ),
        # G = 1 with row tiles longer than key tiles: the cache write in its own loop
        "prefill-softcap-mha-long-tiles": Case(
            "prefill",
            2,
            3,
            3,
            45,
            40,
            80,
            (0, 21),
            softcap=1.0,
            config=dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1),
        ),
        # the config's TMA / DEFER_PV keys are ignored for the variant (the plain loops run)
        "prefill-both-variant-keys-off": Case(
            "prefill",
            2,
            6,
            2,
            13,
            40,
            37,
            (0, 19),
            softcap=2.0,
            alibi=True,
            config=dict(SMALL_PREFILL, TMA=True, DEFER_PV=True),
        ),
        "decode-both-splits": Case(
            "decode", 3, 6, 2, 1, 40, 37, (0, 20, 36), config=SMALL_DECODE, num_splits=3, softcap=1.5, alibi=True
        ),
        "decode-alibi-window-preload-d72": Case(
            "decode",
            3,
            6,
            3,
            1,
            72,
            61,
            (3, 30, 60),
            num_splits=3,
            window=20,
            config=dict(SMALL_DECODE, PRE_N=16),
            alibi=True,
        ),
        "decode-rotary-table-both": Case(
            "decode",
            3,
            6,
            2,
            1,
            40,
            37,
            (0, 20, 36),
            config=SMALL_DECODE,
            num_splits=2,
            rotary=True,
            rot_table=True,
            softcap=1.5,
            alibi=True,
        ),
        "decode-softcap-overflow": Case(
            "decode", 3, 6, 2, 1, 40, 37, (37, 50, 15), config=SMALL_DECODE, num_splits=3, softcap=1.0
        ),
    }


def _paged_cases() -> dict:
    from paged_steps import decode_case
    from test_paged_attention import SMALL_DECODE, SMALL_PREFILL

    return {
        "paged-mixed-both-gqa3-d40": StepCase(
            2,
            3,
            40,
            16,
            ((0, 7), (21, 1), (5, 20), (40, 1)),
            pad_rows=3,
            config=SMALL_PREFILL,
            decode_config=SMALL_DECODE,
            num_splits=3,
            softcap=1.5,
            alibi=True,
        ),
        "paged-varlen-alibi-window-d72": StepCase(
            3, 2, 72, 16, ((30, 12), (0, 20), (50, 1)), window=7, config=SMALL_PREFILL, path="varlen", alibi=True
        ),
        "paged-decode-both-splits": decode_case(
            ((0, 1), (20, 1), (47, 1), (0, 0)),
            Hkv=2,
            G=3,
            D=40,
            BS=16,
            decode_config=SMALL_DECODE,
            num_splits=3,
            softcap=1.0,
            alibi=True,
        ),
    }


STATIC_NAMES = [
    "prefill-both-gqa3-d40",
    "prefill-alibi-window-mqa-d72",
    "prefill-softcap-mha-long-tiles",
    "prefill-both-variant-keys-off",
    "decode-both-splits",
    "decode-alibi-window-preload-d72",
    "decode-rotary-table-both",
    "decode-softcap-overflow",
]
PAGED_NAMES = ["paged-mixed-both-gqa3-d40", "paged-varlen-alibi-window-d72", "paged-decode-both-splits"]
KERNEL_DTYPES = ("float32", "float16")


def run_interpreted(path: str) -> None:
    import json
    from pathlib import Path

    from test_attention_kernels import run_case as run_static
    from test_paged_attention import run_case as run_paged

    torch.set_num_threads(1)
    report = {}
    for cases, run in ((_static_cases(), run_static), (_paged_cases(), run_paged)):
        for name, case in cases.items():
            for dtype in KERNEL_DTYPES:
                try:
                    report[f"{name}/{dtype}"] = run(case, getattr(torch, dtype))
                except Exception as e:  # reported per case by the parent, not swallowed
                    report[f"{name}/{dtype}"] = f"raised {type(e).__name__}: {e}"
    Path(path).write_text(json.dumps(report, indent=1))


AOT_BUILDS = [
    "prefill-D128",
    "prefill-D256",
    "decode-D128",
    "decode-rotary-table-D128",
    "decode-D256",
    "paged-decode-D128",
    "varlen-D128",
]


def run_aot(path: str) -> None:
    """bf16 builds for sm_90 at the table's configs with SOFTCAP and ALIBI on (Llama-8B-like heads,
    gemma2's head_dim 256): each builds; the decode ones spill no registers."""
    import inspect
    import json
    from pathlib import Path

    from kernel_child import spill_bytes

    from dsc.kernels import attention as A
    from dsc.kernels import paged_attention as P
    from dsc.kernels.launch import compile_for_arch

    A._triton()
    P._kernels()
    on = dict(SOFTCAP=True, ALIBI=True)
    t = {n: "*bf16" for n in ("Q", "K", "V", "KC", "VC", "OUT")} | {
        "POS": "*i64",
        "qk_scale": "fp32",
        "SLOPES": "*fp32",
        "cap": "fp32",
    }
    none = {n: None for n in ("KD", "VD", "KCD", "VCD", "COS", "SIN", "sc_b", "ss_b", "RPOS", "srp_b")}

    def ints(fn, given):  # the runtime arguments not given: sizes and strides, i32
        params = inspect.signature(getattr(fn, "fn", fn)).parameters.values()
        return {p.name: "i32" for p in params if p.name not in given and "constexpr" not in str(p.annotation)}

    report = {}
    for D in (128, 256):
        pre = A.attention_config("prefill", D, "sm_90")
        consts = {
            **{n: none[n] for n in ("KD", "VD", "KCD", "VCD")},
            "G": 4,
            "HEAD_DIM": D,
            "BLOCK_D": D,
            "BLOCK_M": pre["BLOCK_M"],
            "BLOCK_N": pre["BLOCK_N"],
            "WINDOWED": False,
            **on,
        }
        types = {**t, **ints(A._prefill_kernel, {**t, **consts})}
        builds = {f"prefill-D{D}": (A._prefill_kernel, types, consts, pre)}
        dec = A.attention_config("decode", D, "sm_90")
        f32 = {"PART_O": "*fp32", "PART_LSE": "*fp32", "LOCK": "*i32"}
        consts = {
            **{n: none[n] for n in ("COS", "SIN", "sc_b", "ss_b", "RPOS", "srp_b")},
            "G": 4,
            "HEAD_DIM": D,
            "BLOCK_D": D,
            "BLOCK_H": 16,
            "BLOCK_N": dec["BLOCK_N"],
            "SPLIT": True,
            "WINDOWED": False,
            "PRE_N": dec.get("PRE_N", 0),
            "PDL": True,
            **on,
        }
        types = {**t, **f32, **ints(A._decode_kernel, {**t, **f32, **consts})}
        builds[f"decode-D{D}"] = (A._decode_kernel, types, consts, dec)
        if D == 128:
            rot = {"COS": "*bf16", "SIN": "*bf16", "sc_b": "i32", "ss_b": "i32", "RPOS": "*i64", "srp_b": "i32"}
            consts = {**{k: v for k, v in consts.items() if k not in rot}, "ROTARY": True, "ROT_TABLE": True}
            builds["decode-rotary-table-D128"] = (A._decode_kernel, {**types, **rot}, consts, dec)
            pt = (
                {n: "*bf16" for n in ("Q", "K", "V", "KP", "VP", "OUT")}
                | {n: "*i32" for n in ("SLOTS", "QSTART", "QLEN", "CLEN", "BT")}
                | {"qk_scale": "fp32", "SLOPES": "*fp32", "cap": "fp32"}
            )
            pdec = P.paged_attention_config("decode", D, "sm_90")
            consts = dict(
                G=4,
                HEAD_DIM=D,
                BLOCK_D=D,
                BLOCK_H=16,
                BLOCK_N=pdec["BLOCK_N"],
                BLOCK_S=64,
                BS=16,
                SPLIT=True,
                WINDOWED=False,
                PDL=True,
                **on,
            )
            types = {**pt, **f32, **ints(P._paged_decode_kernel, {**pt, **f32, **consts})}
            builds["paged-decode-D128"] = (P._paged_decode_kernel, types, consts, pdec)
            pvar = P.paged_attention_config("prefill", D, "sm_90")
            consts = dict(
                G=4,
                HEAD_DIM=D,
                BLOCK_D=D,
                BLOCK_M=pvar["BLOCK_M"],
                BLOCK_N=pvar["BLOCK_N"],
                BLOCK_S=64,
                BS=16,
                WINDOWED=False,
                **on,
            )
            types = {**pt, **ints(P._paged_prefill_kernel, {**pt, **consts})}
            builds["varlen-D128"] = (P._paged_prefill_kernel, types, consts, pvar)
        for name, (fn, types, consts, cfg) in builds.items():
            aligned = tuple(
                n
                for n, ty in types.items()
                if ty.startswith("*") or (n.startswith("s") and "_" in n and not n.startswith("sl_"))
            )
            try:
                k = compile_for_arch(
                    getattr(fn, "fn", fn),
                    types,
                    consts,
                    num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"],
                    aligned=aligned,
                )
                report[name] = {"built": True, "spills": spill_bytes(k)}
            except Exception as e:  # reported per build by the parent, not swallowed
                report[name] = {"built": f"{type(e).__name__}: {str(e)[-400:]}"}
    Path(path).write_text(json.dumps(report, indent=1))


def _fixtures():
    from kernel_child import child_fixtures

    return child_fixtures(__file__, "variants")


interpreted, compiled = _fixtures()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", STATIC_NAMES + PAGED_NAMES)
def test_kernel_matches_reference(interpreted, case, dtype):
    assert interpreted[f"{case}/{dtype}"] == "ok"


@pytest.mark.parametrize("build", AOT_BUILDS)
def test_variant_kernels_build_for_sm90(compiled, build):
    result = compiled[build]
    assert result["built"] is True
    if "decode" in build:
        assert result["spills"] == 0


def test_case_names_match():
    assert list(_static_cases()) == STATIC_NAMES and list(_paged_cases()) == PAGED_NAMES


if __name__ == "__main__":
    import sys

    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])
