"""`dsc bench-serve` takes the vocabulary and the max length from the server's /v1/models, so its
defaults run against a model of any size; given values the server cannot take are one line."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_fake import FakeEngine, FakeSamplingParams  # noqa: E402

from dsc.serve.bench import BenchConfig, Lengths, fit  # noqa: E402
from dsc.serve.server import ServeOptions, build  # noqa: E402


@contextlib.contextmanager
def serving(engine):
    server = build(engine, ServeOptions(port=0), FakeSamplingParams)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [server.sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.should_exit = True
        thread.join(30)
        server.driver.stop(30)


def _bench(*args):
    from typer.testing import CliRunner

    from dsc.cli import app

    return CliRunner().invoke(app, ["bench-serve", *args])


def test_defaults_fit_a_small_model_from_its_models_card(tmp_path):
    """A model of 64 token ids and 48 positions: the defaults (once a vocabulary of 1000 and 128 +
    128 tokens, refused by such a server every time) draw ids below 64 and 24 + 24 tokens."""
    engine = FakeEngine(vocab_size=64, max_model_len=48)
    with serving(engine) as url:
        card = openai.OpenAI(base_url=url + "/v1", api_key="-").models.list().data[0]
        assert (card.model_extra["vocab_size"], card.model_extra["max_model_len"]) == (64, 48)
        r = _bench(url, "--rate", "inf", "--num-requests", "6", "--json", str(tmp_path / "b.json"))
        assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "b.json").read_text())
    row = res["results"][0]
    assert (row["completed"], row["failed"]) == (6, 0), row["errors"]
    assert (res["config"]["vocab"], res["config"]["prompt_len"], res["config"]["output_len"]) == (64, "24", "24")
    assert engine.prompt_tokens_total == 6 * 24 and engine.generation_tokens_total == 6 * 24


@pytest.mark.parametrize(
    "args, names",
    [
        (["--vocab", "100"], ["--vocab 100", "vocabulary of 64"]),
        (["--prompt-len", "40", "--output-len", "9:20"], ["--prompt-len 40", "--output-len 9:20", "max_model_len 48"]),
        (["--prompt-len", "48"], ["--prompt-len 48", "at most 47"]),
        (["--model", "other"], ["--model", "fake-model"]),
        (["--vocab", "5"], ["--vocab", "> 10"]),
    ],
)
def test_what_the_server_cannot_take_is_one_line_before_any_request(args, names):
    engine = FakeEngine(vocab_size=64, max_model_len=48)
    with serving(engine) as url:
        r = _bench(url, "--rate", "inf", "--num-requests", "3", *args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and all(n in lines[0] for n in names), r.output
    assert engine.prompt_tokens_total == 0


def test_fit_without_a_reported_vocabulary_or_length():
    cfg = BenchConfig("x", [1.0])
    got = fit(cfg, None, None, "x")
    assert (got.vocab, got.prompt_len.spec, got.output_len.spec) == (1000, "128", "128")
    got = fit(cfg, 50_000, 4096, "x")
    assert (got.vocab, got.prompt_len.spec, got.output_len.spec) == (50_000, "128", "128")
    got = fit(BenchConfig("x", [1.0], prompt_len=Lengths.parse("4:200", "p"), vocab=300), 512, 256, "x")
    assert (got.vocab, got.prompt_len.spec, got.output_len.spec) == (300, "4:200", "56")
