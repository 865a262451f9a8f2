"""The pass table (compiler/pipeline.py's PASSES) and its contracts (compiler/contracts.py).

The table's order keeps every row's `after`; `run_passes(check=True)` checks each pass's required
contracts before it, its guaranteed ones after it, and that it changed no program outside its
row, and names the pass and the contract when one fails; each pass returns its rewrite counts.
The suite's compiles (conftest.py's `compile_artifact`) all run with the checks on.
"""

from __future__ import annotations

import dataclasses

import pytest

from dsc.compiler import contracts as C
from dsc.compiler import pipeline as P
from dsc.errors import PassError


def _trace(make_checkpoint, shape: str, **options):
    from dsc.compiler.architectures import architecture_for
    from dsc.compiler.options import make_options
    from dsc.compiler.source import open_checkpoint
    from dsc.compiler.trace import trace

    ckpt = open_checkpoint(str(make_checkpoint(shape)))
    return trace(ckpt, architecture_for(ckpt.config, "config.json"), make_options(**options))


def _spec(name: str) -> P.PassSpec:
    return next(s for s in P.PASSES if s.name == name)


def test_the_table_keeps_every_row_after_its_prerequisites():
    assert P.check_order() == []
    assert [s.name for s in P.PASSES][-1] == "plan_kernels"


def test_a_row_placed_before_its_prerequisite_is_named():
    rows = list(P.PASSES)
    i, j = [s.name for s in rows].index("fuse_projections"), [s.name for s in rows].index("shard_tensor_parallel")
    rows[i], rows[j] = rows[j], rows[i]
    assert "fuse_projections must run after shard_tensor_parallel, which is not before it" in P.check_order(tuple(rows))
    typo = dataclasses.replace(_spec("plan_kernels"), after=("decode_linear",))
    assert "plan_kernels: no pass 'decode_linear'" in P.check_order((*P.PASSES[:-1], typo))


@pytest.mark.parametrize(
    "options, only",
    [
        ({"fuse": False}, {"fuse_projections", "fuse_add_norm", "fuse_rotary", "fuse_activation"}),
        ({"int8": True}, set()),
    ],
)
def test_the_options_enable_the_rows_their_docs_name(options, only):
    from dsc.compiler.options import make_options

    names = {n for n, _ in P.pipeline(make_options(**options))}
    assert not names & only
    assert ("quantize_int8" in names) == bool(options.get("int8"))
    assert {n for n, _ in P.pipeline(make_options())} >= {"canonicalize", "plan_kernels", *only}


def test_each_pass_returns_its_rewrite_counts(make_checkpoint):
    model = _trace(make_checkpoint, "llama-tiny", dtype="bf16")
    results: list[P.PassResult] = []
    model = P.run_passes(model, check=True, results=results)
    assert [r.name for r in results] == [n for n, _ in P.pipeline(model.options)]
    for r in results:  # the counts are the model's counters, by pass
        assert r.rewrites == {k.split(".", 1)[1]: v for k, v in model.counters.items() if k.startswith(r.name + ".")}
    by = {r.name: r.rewrites for r in results}
    layers = model.config["num_hidden_layers"]
    assert by["bind_kv_cache"]["attention"] == 2 * layers  # prefill's and decode's
    assert by["shard_tensor_parallel"] == {} and by["plan_kernels"] == {}


def test_a_required_contract_that_does_not_hold_stops_the_pass(make_checkpoint):
    """GPT-2's Conv1D traces as addmm against the weight: before canonicalize, `linear` fails."""
    model = _trace(make_checkpoint, "gpt2-tiny")
    with pytest.raises(PassError) as e:
        P.run_pass(_spec("bind_kv_cache"), model, check=True)
    msg = str(e.value)
    assert msg.startswith("pass 'bind_kv_cache': required contract 'linear'") and "aten.addmm" in msg
    model, _ = P.run_pass(_spec("canonicalize"), model, check=True)
    P.run_pass(_spec("bind_kv_cache"), model, check=True)


def test_a_guarantee_a_pass_breaks_is_named(make_checkpoint):
    model = _trace(make_checkpoint, "llama-tiny")
    for name in ("canonicalize", "bind_kv_cache"):
        model, _ = P.run_pass(_spec(name), model, check=True)

    def forget_the_cache(m):
        m.kv_cache = m.kv_pool = None
        return m

    broken = P.PassSpec("forgetful", forget_the_cache, "a test", guarantees=(C.ATTENTION,))
    with pytest.raises(PassError, match="^pass 'forgetful': guaranteed contract 'attention_bound' .* no KV cache"):
        P.run_pass(broken, model, check=True)
    P.run_pass(broken, model, check=False)  # without the checks it runs


def test_a_pass_that_changes_a_program_outside_its_row_is_named(make_checkpoint):
    model = _trace(make_checkpoint, "llama-tiny")
    decode_only = dataclasses.replace(_spec("canonicalize"), programs=("decode",))
    with pytest.raises(PassError, match=r"^pass 'canonicalize' changed the program\(s\) \['prefill', 'ragged'\]"):
        P.run_pass(decode_only, model, check=True)
