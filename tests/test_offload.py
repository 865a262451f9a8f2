"""Weight offload (runtime/offload.py): layers beyond a device budget streamed through a ring of
layer buffers, from host memory or from the rank file. The CPU stands in for the GPU: the
"device" holds the resident weights and the buffers; tokens must equal the resident engine's."""

from __future__ import annotations

import pytest
import torch
from arrivals import run_arrivals, workload
from typer.testing import CliRunner

from dsc.cli import app
from dsc.errors import UserError
from dsc.runtime.engine import load
from dsc.runtime.llm import LLMEngine
from dsc.runtime.offload import gib, layer_of, plan_offload

LAYERS = {"llama-tiny": {"num_hidden_layers": 6}, "gpt2-tiny": {"n_layer": 6}}


def _art(compile_artifact, shape: str, **options):
    return compile_artifact(shape, ckpt_kwargs=LAYERS[shape], dtype="fp32", **options)


def _budget(art, resident_layers: int) -> float:
    """GiB that keep the weights outside the layers, `resident_layers` layers and the buffers."""
    from dsc.runtime.artifact import open_artifact
    from dsc.runtime.offload import data_start

    a = open_artifact(art, ranks=[], verify=False)
    h = a.rank_header(0)
    every = plan_offload(h, data_start(a.rank_file(0)), None)
    layer = every.streamed[0].nbytes
    return (every.device_bytes + resident_layers * layer + 1024) / 2**30


def _serve(engine: LLMEngine, reqs) -> list[list[int]]:
    done = run_arrivals(engine, reqs)
    return [done[str(i)] for i in range(len(reqs))]


@pytest.fixture(scope="module")
def resident_tokens(compile_artifact):
    cache = {}

    def get(shape, budget_tokens):
        key = (shape, budget_tokens)
        if key not in cache:
            eng = LLMEngine(
                _art(compile_artifact, shape), device="cpu", max_num_seqs=4, max_num_batched_tokens=budget_tokens
            )
            cache[key] = _serve(eng, workload(512, 8, 90, 16, seed=7))
        return cache[key]

    return get


@pytest.mark.parametrize(
    "shape, where, resident, budget_tokens",
    [
        ("llama-tiny", "cpu", 0, 64),
        ("llama-tiny", "disk", 1, 64),
        ("gpt2-tiny", "cpu", 2, 7),
        ("gpt2-tiny", "disk", 0, 7),
    ],
)
def test_streamed_layers_give_the_resident_tokens(
    shape, where, resident, budget_tokens, compile_artifact, resident_tokens
):
    """Continuous batching (arrivals, chunked prompts at budgets 7 and 64) with every layer, or
    all but `resident`, streamed: the same tokens as with every weight on the device."""
    art = _art(compile_artifact, shape)
    gpu_memory = _budget(art, resident) if resident else None
    eng = LLMEngine(
        art, device="cpu", max_num_seqs=4, max_num_batched_tokens=budget_tokens, offload=where, gpu_memory=gpu_memory
    )
    inner = eng.engine
    assert inner.offload["resident_layers"] == resident and inner.offload["streamed_layers"] == 6 - resident
    assert _serve(eng, workload(512, 8, 90, 16, seed=7)) == resident_tokens(shape, budget_tokens)
    ring = inner.ring
    # the "device" held the resident weights and three layer buffers, never the streamed layers
    assert len(ring.slots) == 3 and not set(inner.weights) & ring.names
    device = sum(t.nbytes for t in inner.weights.values()) + sum(b.nbytes for b in ring.slots)
    assert device == inner.offload["device_bytes"] < sum(t.nbytes for t in load(art, device="cpu").weights.values())
    # every streamed layer moved at every step (all the same size here), and no more often
    size = ring.layers[0].nbytes
    assert all(u.nbytes == size for u in ring.layers) and ring.bytes_moved == ring.loads * size
    steps = eng.core.executor_steps if hasattr(eng.core, "executor_steps") else None
    assert ring.loads >= len(ring.layers) and (steps is None or ring.loads <= (steps + 1) * len(ring.layers))
    assert not any(ring.busy), "a layer buffer was never given back"
    assert eng.stats()["offload_bytes_total"] == ring.bytes_moved
    from dsc.serve.metrics import Metrics

    scraped = [
        ln for ln in Metrics(eng.stats).render().decode().splitlines() if ln.startswith("dsc_offload_bytes_total ")
    ]
    assert [float(ln.split()[1]) for ln in scraped] == [ring.bytes_moved]


def test_a_quantized_artifact_streams_its_int8_weights(compile_artifact):
    art = _art(compile_artifact, "llama-tiny", int8=True)
    prompts = [[1, 2, 3, 4, 5], [9] * 30, [7]]
    want = load(art, device="cpu").generate(prompts, max_new_tokens=10, stop_tokens=[]).tokens
    eng = load(art, device="cpu", offload="disk")
    assert any(t.dtype == "I8" for u in eng.ring.layers for t in u.tensors)
    assert eng.generate(prompts, max_new_tokens=10, stop_tokens=[]).tokens == want


def test_the_static_programs_stream_too(compile_artifact):
    art = _art(compile_artifact, "gpt2-tiny")
    prompts = [[5, 6, 7, 8], [1, 2]]
    want = load(art, device="cpu").generate_static(prompts, max_new_tokens=8, stop_tokens=[]).tokens
    assert (
        load(art, device="cpu", offload="cpu").generate_static(prompts, max_new_tokens=8, stop_tokens=[]).tokens == want
    )


def test_each_weight_is_fetched_before_its_first_use_and_its_layer_released_after_its_last(compile_artifact):
    eng = load(_art(compile_artifact, "llama-tiny"), device="cpu", offload="cpu")
    nodes = list(eng.programs["ragged"].graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    fetches = [n for n in nodes if n.op == "call_function" and n.target is eng.ring.fetch_node]
    releases = {n.args[1]: at[n] for n in nodes if n.op == "call_function" and n.target is eng.ring.release_node}
    assert len(fetches) == len(eng.ring.names) and sorted(releases) == list(range(6))
    assert not [n for n in nodes if n.op == "get_attr" and n.target in eng.ring.names]
    for f in fetches:
        layer = f.args[1]
        assert all(at[u] > at[f] for u in f.users)
        assert all(at[u] < releases[layer] for u in f.users), f"{f}: used after layer {layer} is released"
    # layers are given back in order, each before the next-but-two is fetched (three buffers)
    first = {}
    for f in fetches:
        first.setdefault(f.args[1], at[f])
    assert all(releases[i] < first[i + 3] for i in range(3))


def test_placement_keeps_layers_in_order_while_the_budget_lasts():
    def header(n_layers: int, layer: int = 1000, other: int = 3000) -> dict:
        h, off = {}, 0
        for name, n in [("lm_head.weight", other)] + [(f"model.layers.{i}.w", layer) for i in range(n_layers)]:
            h[name] = {"dtype": "U8", "shape": [n], "data_offsets": [off, off + n]}
            off += n
        return h

    h = header(12)
    assert layer_of("model.layers.10.mlp.up_proj.weight") == "model.layers.10"
    assert layer_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3" and layer_of("lm_head.weight") is None
    p = plan_offload(h, 0, None)
    assert [u.name for u in p.streamed] == [f"model.layers.{i}" for i in range(12)]  # numeric order, not 1, 10, 11, 2
    assert p.resident == ("lm_head.weight",) and p.slots == 3 and p.slot_bytes == 1024
    assert p.streamed_bytes == p.summary()["bytes_per_step"] == 12000
    q = plan_offload(h, 0, 3000 + 3 * 1024 + 4 * 1000)
    assert q.summary()["resident_layers"] == 4 and [u.name for u in q.streamed][0] == "model.layers.4"
    assert plan_offload(h, 0, 10**9).streamed == ()  # everything fits: nothing streamed
    with pytest.raises(UserError, match=r"--gpu-memory: .* give at least"):
        plan_offload(h, 0, 3000 + 2 * 1024)
    with pytest.raises(UserError, match=r"--gpu-memory: .* 3 numbered layers, no more than the 3 layer buffers"):
        plan_offload(header(3), 0, 3000 + 2000)
    assert plan_offload(header(3), 0, None).streamed == ()  # stream every layer: none to stream past the buffers
    with pytest.raises(UserError, match="--offload: expected one of cpu, disk"):
        plan_offload(h, 0, None, where="nvme")
    assert gib(2**30) == "1 GiB" and gib(int(1.2345 * 2**30), up=True) == "1.24 GiB"


@pytest.mark.parametrize(
    "args, field",
    [
        (["--offload", "gpu"], "--offload"),
        (["--gpu-memory", "4"], "--gpu-memory"),
        (["--offload", "cpu", "--gpu-memory", "0"], "--gpu-memory"),
        (["--offload", "cpu", "--gpu-memory", "nan"], "--gpu-memory"),
        (["--offload", "cpu", "--gpu-memory", "1e-7"], "--gpu-memory"),
    ],
)
def test_bad_offload_flags_are_one_line_naming_the_flag(args, field, compile_artifact):
    art = str(_art(compile_artifact, "llama-tiny"))
    for cmd in (
        ["generate", art, "--token-ids", "1,2,3", "--device", "cpu", "--max-new-tokens", "2"],
        ["inspect", art],
    ):
        res = CliRunner().invoke(app, cmd + args)
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        err = res.output.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {field}"), res.output


def test_generate_and_inspect_say_where_the_weights_live(compile_artifact):
    art = str(_art(compile_artifact, "gpt2-tiny"))
    runner = CliRunner()
    plain = runner.invoke(
        app, ["generate", art, "--token-ids", "1,2,3", "--device", "cpu", "--json", "--max-new-tokens", "5"]
    )
    streamed = runner.invoke(
        app,
        [
            "generate",
            art,
            "--token-ids",
            "1,2,3",
            "--device",
            "cpu",
            "--json",
            "--max-new-tokens",
            "5",
            "--offload",
            "disk",
            "--gpu-memory",
            str(_budget(art, 2)),
        ],
    )
    assert plain.exit_code == streamed.exit_code == 0, streamed.output
    assert plain.output == streamed.output
    shown = runner.invoke(app, ["inspect", art, "--offload", "cpu", "--gpu-memory", str(_budget(art, 2))])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())  # as rich wraps it
    assert "rank 0: weights:" in text and "(2 of 6 layers" in text
    assert "4 layers" in text and "streamed from pinned host memory" in text


def test_the_weights_do_not_fit_message_points_at_offload():
    from pathlib import Path

    from dsc.runtime.engine import weights_do_not_fit

    msg = weights_do_not_fit(Path("rank0.safetensors"), 2**34, 2**33, torch.device("cuda", 0))
    assert "--offload cpu --gpu-memory" in msg
