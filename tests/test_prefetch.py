"""DSC_L2_PREFETCH (kernels/prefetch.py): the setting, where the runtime inserts the prefetch,
that it changes no value, the launch it makes, and its sm_90 build (the interpreter cannot
run its inline PTX)."""
from __future__ import annotations

import pytest
import torch

import dsc
from dsc.errors import UserError
from dsc.kernels import prefetch
from dsc.runtime.engine import Engine, insert_l2_prefetch
from dsc.runtime.plan import ATTENTION_OPS, op_name


@pytest.mark.parametrize("value, want", [(None, (0, False)), ("off", (0, False)), ("0", (0, False)),
                                         ("16", (16 << 20, False)), ("16:last", (16 << 20, True)),
                                         ("0.001", (1040, False))])
def test_setting_parses(value, want, monkeypatch):
    if value is None:
        monkeypatch.delenv("DSC_L2_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("DSC_L2_PREFETCH", value)
    assert prefetch.l2_prefetch_setting() == want


@pytest.mark.parametrize("value", ["lots", "-4", "2048", "16:first", "16:last:x", "nan"])
def test_bad_setting_is_one_clear_error(value, monkeypatch, compile_artifact):
    monkeypatch.setenv("DSC_L2_PREFETCH", value)
    with pytest.raises(ValueError, match="DSC_L2_PREFETCH must be off, MB"):
        prefetch.l2_prefetch_setting()
    with pytest.raises(UserError, match="DSC_L2_PREFETCH"):  # the CLI prints it as one line
        dsc.load(compile_artifact("llama-tiny", dtype="fp32"), device="cpu")


def _decode_logits(engine):
    ids = torch.tensor([[3], [7]])
    return engine.run("decode", ids, torch.tensor([[5], [2]]), torch.tensor([5, 2]), torch.tensor([0, 0]))


@pytest.mark.parametrize("shape, tp", [("llama-tiny", 1), ("llama-tiny", 2), ("gpt2-tiny", 1)])
def test_inserted_after_each_attention_for_the_mlp_input_weight_and_changes_nothing(shape, tp, compile_artifact,
                                                                                     monkeypatch):
    """After every attention node, a prefetch of the layer's MLP input projection (Llama's fused
    gate/up, GPT-2's c_fc), and the decode step's logits are the same bits (on CPU the launch is
    a no-op: this checks the graph surgery, not the cache). tp=2 builds rank 0's graph only."""
    monkeypatch.setenv("DSC_L2_PREFETCH", "16")
    art = compile_artifact(shape, dtype="fp32", tp=tp)
    engine = dsc.load(art, device="cpu", rank=0) if tp == 1 else None
    if engine is None:  # a tp=2 artifact: build rank 0's decode program without a process group
        from dsc.runtime.artifact import open_artifact
        from dsc.runtime.plan import build_graph
        import torch.fx as fx
        from safetensors.torch import load_file

        a = open_artifact(art, ranks=[0], verify=False)
        graph, targets = build_graph(a.plan["programs"]["decode"]["nodes"], torch.device("cpu"))
        weights = load_file(a.rank_file(0))
        kv = a.plan["kv_cache"]
        attrs = {t: weights[t] if t in weights else torch.zeros(kv["shape"]) for t in targets}
        gm = fx.GraphModule(attrs, graph)
    else:
        assert engine.l2_prefetch == "off"  # CPU: not inserted by the engine
        gm = engine.programs["decode"]
        before = _decode_logits(engine)
    layers = sum(op_name(n.target) in ATTENTION_OPS for n in gm.graph.nodes if n.op == "call_function")
    assert layers >= 2
    n = insert_l2_prefetch(gm, 1 << 20, False)
    assert n == layers
    nodes = list(gm.graph.nodes)
    want = "mlp.c_fc.weight" if shape.startswith("gpt2") else "mlp.gate_up_proj.weight"
    inserted = [i for i, node in enumerate(nodes) if node.op == "call_function" and node.target is prefetch.l2_prefetch]
    for layer, i in enumerate(inserted):  # right after the layer's attention, its own MLP weight
        w, nbytes, last = nodes[i].args
        assert op_name(nodes[i - 2].target) in ATTENTION_OPS and nodes[i - 1] is w and w.op == "get_attr"
        assert w.target.endswith(want) and f".{layer}.mlp." in w.target and (nbytes, last) == (1 << 20, False), w.target
    if engine is not None:
        assert torch.equal(_decode_logits(engine), before)


def test_engine_inserts_it_where_supported_and_each_decode_step_launches_it(compile_artifact, monkeypatch):
    """The engine's own path (the CPU stands in for a Hopper GPU: support and the launcher are
    faked): load reports the setting, every decode step launches one prefetch per layer on
    that layer's gate/up weight, the prefill program has none, and the logits are unchanged."""
    art = compile_artifact("llama-tiny", dtype="fp32")
    monkeypatch.delenv("DSC_L2_PREFETCH", raising=False)
    want = _decode_logits(dsc.load(art, device="cpu"))
    launches = []

    class Fake:
        def __getitem__(self, grid):
            return lambda w, nbytes, **kw: launches.append((w.numel(), nbytes, kw["EVICT_LAST"]))

    monkeypatch.setattr(prefetch, "jit", lambda fn: Fake())
    monkeypatch.setattr(prefetch, "l2_prefetch_supported", lambda device: True)
    monkeypatch.setenv("DSC_L2_PREFETCH", "0.001:last")
    # the CPU's memory-mapped weights sit 8 bytes into a 16-byte line; a GPU's are allocations
    load = Engine._load_weights
    monkeypatch.setattr(Engine, "_load_weights", lambda self: {k: v.clone() for k, v in load(self).items()})
    engine = dsc.load(art, device="cpu")
    layers = engine.plan["kv_cache"]["layers"]
    assert engine.l2_prefetch == f"{1040 / (1 << 20):g} MB x {layers} evict_last"
    assert not any(n.target is prefetch.l2_prefetch for n in engine.programs["prefill"].graph.nodes)
    got = _decode_logits(engine)
    assert torch.equal(got, want)
    gate_up = [engine.weights[k].numel() * 4 for k in sorted(engine.weights) if k.endswith("mlp.gate_up_proj.weight")]
    assert len(gate_up) == layers and launches == [(b, 1040, True) for b in gate_up]


def test_launch_covers_the_budget_once(monkeypatch):
    """l2_prefetch's launch: the budget clamped to the weight and rounded down to 16 bytes,
    one program per LANES chunks, PDL on; non-contiguous or misaligned weights are skipped."""
    launches = []

    class Fake:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, kw))

    monkeypatch.setattr(prefetch, "jit", lambda fn: Fake())
    monkeypatch.setattr(prefetch, "l2_prefetch_supported", lambda device: True)
    w = torch.zeros(1000, 700, dtype=torch.bfloat16)  # 1,400,000 bytes
    prefetch.l2_prefetch(w, 1 << 20)
    prefetch.l2_prefetch(w, 10 << 20, True)
    prefetch.l2_prefetch(w, 1000 + 7)
    prefetch.l2_prefetch(w.t(), 1 << 20)  # not contiguous
    prefetch.l2_prefetch(w.reshape(-1)[1:], 1 << 20)  # 2 bytes off alignment
    prefetch.l2_prefetch(w, 8)  # under 16 bytes
    assert [(g, a[1], kw["EVICT_LAST"]) for g, a, kw in launches] == [
        ((-(-(1 << 20) // (prefetch.CHUNK * prefetch.LANES)),), 1 << 20, False),
        ((-(-1_400_000 // (prefetch.CHUNK * prefetch.LANES)),), 1_400_000, True),
        ((1,), 992, False)]
    assert all(kw["PDL"] and kw["launch_pdl"] and a[0].dtype == torch.uint8 for _, a, kw in launches)
    assert prefetch.CHUNK % 16 == 0


def test_not_supported_off_cuda():
    assert not prefetch.l2_prefetch_supported(torch.device("cpu"))
    prefetch.l2_prefetch(torch.zeros(64), 256)  # returns, launches nothing


@pytest.mark.parametrize("evict_last", [False, True])
def test_sm90_build_prefetches_and_reads_nothing_before_its_wait(evict_last):
    """The sm_90 build: the bulk L2 prefetch (with the evict-last policy when asked), the
    dependents let launch first, the wait last, and no load from global memory anywhere."""
    from dsc.kernels.launch import compile_for_arch

    k = compile_for_arch(prefetch._l2_prefetch_kernel, {"W": "*u8", "nbytes": "i32"},
                         {"CHUNK": prefetch.CHUNK, "LANES": prefetch.LANES, "EVICT_LAST": evict_last, "PDL": True},
                         num_warps=1, aligned=("W",))
    assert k.asm.get("cubin")
    ptx = [line.strip() for line in k.asm["ptx"].splitlines()]
    at = {key: next(i for i, line in enumerate(ptx) if key in line)
          for key in ("griddepcontrol.launch_dependents", "cp.async.bulk.prefetch.L2.global", "griddepcontrol.wait")}
    assert at["griddepcontrol.launch_dependents"] < at["cp.async.bulk.prefetch.L2.global"] < at["griddepcontrol.wait"]
    assert ("L2::cache_hint" in ptx[at["cp.async.bulk.prefetch.L2.global"]]) == evict_last
    assert not any(line.startswith(("ld.global", "ld.volatile", "ld.relaxed", "ld.acquire")) for line in ptx)
