"""`dsc serve` with the engine in its own process: the API process's client (serve/client.py)
and the engine's loop (serve/engine_process.py) over their ZeroMQ sockets, and the process's
life: a killed engine, SIGTERM under load, a load that fails.

The loop's tests run it over the fake engine (tests/serve_fake.py) in a thread, through the same
sockets an engine process uses; the process tests start `dsc serve` on a tiny compiled Llama.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_fake import FakeEngine, FakeSamplingParams, greedy_text  # noqa: E402
from test_serve import ENGINE_ENV, MODEL, running, serving_process  # noqa: E402

from dsc.serve.server import ServeOptions, build_server  # noqa: E402


@contextlib.contextmanager
def serving_loop(engine, **opts):
    """The app over EngineLoop(engine) in a thread, through an engine process's two sockets."""
    import zmq

    from dsc.serve.client import EngineClient, bind_sockets
    from dsc.serve.engine_process import EngineLoop

    with tempfile.TemporaryDirectory(prefix="dsc-test-") as workdir:
        ctx, requests, outputs, addresses = bind_sockets(workdir)
        engine_ctx = zmq.Context()
        inbox, outbox = engine_ctx.socket(zmq.PULL), engine_ctx.socket(zmq.PUSH)
        inbox.connect(addresses["requests"])
        outbox.connect(addresses["outputs"])
        loop = threading.Thread(target=EngineLoop(engine, FakeSamplingParams, inbox, outbox).run, daemon=True)
        loop.start()
        client = EngineClient(ctx, requests, outputs, engine, engine.stats())
        try:
            with running(build_server(client, ServeOptions(port=0, **opts))) as live:
                yield live
        finally:
            loop.join(10)
            engine_ctx.destroy(linger=1000)


@pytest.fixture(scope="module")
def fake():
    with serving_loop(FakeEngine(step_delay_s=0.001, detokenize=False)) as s:
        yield s


def test_texts_stops_and_n_cross_the_sockets(fake):
    r = fake.client.completions.create(model=MODEL, prompt="hello there", max_tokens=7, n=2)
    assert [c.text for c in r.choices] == [greedy_text("hello there", 7, i) for i in range(2)]
    assert r.usage.completion_tokens == 14 and r.usage.prompt_tokens == 11


def test_a_stop_string_in_one_choice_ends_that_sequence_in_the_engine():
    """The API process finds the stop string, ends choice 0 there and tells the engine, which
    ends that sequence while choice 1 runs on to its length."""
    # greedy choice 1 is choice 0 shifted by a letter: within 25 letters, choice 0's letters
    # 6..8 do not occur in choice 1
    texts = [greedy_text("stop here", 25, i) for i in range(2)]
    stop = texts[0][6:9]
    assert stop not in texts[1]
    engine = FakeEngine(step_delay_s=0.005, detokenize=False)
    with serving_loop(engine) as s:
        for stream in (False, True):
            r = s.client.completions.create(
                model=MODEL, prompt="stop here", max_tokens=25, n=2, stop=[stop], stream=stream
            )
            got, finish = {0: "", 1: ""}, {}
            for c in [ch for chunk in r for ch in chunk.choices] if stream else r.choices:
                got[c.index] += c.text
                finish[c.index] = c.finish_reason or finish.get(c.index)
            assert got == {0: texts[0][:6], 1: texts[1]} and finish == {0: "stop", 1: "length"}
        m = s.wait_idle()
    assert [index for _, index in engine.finished_early] == [0, 0]
    assert m["dsc_kv_blocks_used"] == 0 and m["dsc_generation_tokens_total"] < 2 * 2 * 25


def test_a_failing_step_in_the_engine_fails_its_requests_and_it_keeps_serving(fake):
    with pytest.raises(openai.InternalServerError, match="planted failure"):
        fake.client.completions.create(model=MODEL, prompt="BOOM", max_tokens=3)
    with pytest.raises(openai.APIError, match="the engine failed on this request"):
        list(fake.client.completions.create(model=MODEL, prompt="BOOM", max_tokens=3, stream=True))
    assert fake.client.completions.create(model=MODEL, prompt="fine", max_tokens=3).choices[0].text == greedy_text(
        "fine", 3
    )
    with pytest.raises(openai.BadRequestError) as e:  # refused by add_request, across the sockets
        fake.client.completions.create(model=MODEL, prompt="x" * 256, max_tokens=3)
    assert e.value.body["param"] == "prompt"
    for field in ("max_tokens", "top_k"):  # past what msgpack carries: refused before it is sent
        status, _, data = fake.raw("POST", "/v1/completions", {"prompt": "x", field: 10**30})
        assert status == 400 and json.loads(data)["error"]["param"] == field
    status, _, data = fake.raw("POST", "/v1/completions", {"prompt": "x", "stop_token_ids": [10**30]})
    assert status == 400 and json.loads(data)["error"]["param"] == "stop_token_ids"


def test_a_client_that_disconnects_frees_its_kv_blocks_in_the_engine(fake):
    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "p" * 100, "max_tokens": 150, "stream": True}),
        {"Content-Type": "application/json"},
    )
    assert conn.getresponse().read(6) == b"data: "
    while fake.metrics()["dsc_kv_blocks_used"] == 0:
        time.sleep(0.01)
    conn.sock.shutdown(2)
    conn.close()
    m = fake.wait_idle(timeout=3)
    assert m["dsc_kv_blocks_used"] == 0 and m["dsc_num_requests_running"] == 0


def test_a_full_queue_is_429_across_the_sockets():
    with serving_loop(FakeEngine(max_num_seqs=1, step_delay_s=0.01, detokenize=False), max_queue=1) as s:
        running_ = s.client.completions.create(model=MODEL, prompt="a", max_tokens=200, stream=True)
        next(iter(running_))
        waiting = threading.Thread(target=lambda: s.client.completions.create(model=MODEL, prompt="b", max_tokens=2))
        waiting.start()
        while s.metrics()["dsc_num_requests_waiting"] < 1:
            time.sleep(0.01)
        status, headers, _ = s.raw("POST", "/v1/completions", {"prompt": "c", "max_tokens": 2})
        assert status == 429 and int(headers["retry-after"]) >= 1
        running_.close()
        waiting.join(30)


# -- the engine process ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(compile_artifact):
    return compile_artifact("llama-tiny", dtype="fp32")


def test_a_killed_engine_process_fails_the_requests_in_flight_and_new_ones_get_503(tiny):
    with serving_process(tiny) as s:
        died = threading.Event()
        s.server.driver.on_death = died.set
        body = {"prompt": [5] * 20, "max_tokens": 400, "ignore_eos": True}
        stream = s.client.completions.create(
            model=s.engine.model_name,
            prompt=body["prompt"],
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        whole: list = []
        waiting = threading.Thread(target=lambda: whole.append(s.raw("POST", "/v1/completions", body)))
        waiting.start()
        while s.metrics()["dsc_num_requests_running"] < 2:
            time.sleep(0.01)
        os.kill(s.engine.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine process has gone"):
            list(stream)
        waiting.join(30)
        status, _, data = whole[0]
        assert status == 500 and "killed by SIGKILL" in json.loads(data)["error"]["message"]
        assert died.wait(10)
        status, _, data = s.raw("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and json.loads(data)["error"]["code"] == "engine_unavailable"
        assert s.raw("GET", "/health")[0] == 503


def test_serve_artifact_exits_1_when_its_engine_process_dies(tiny):
    """What `dsc serve` runs: the stream in flight ends with an error event, the server shuts
    down, and it exits 1 with one line saying why."""
    from dsc.serve.server import serve_artifact

    lines, exit_code = [], []

    def serve():
        try:
            serve_artifact(tiny, ServeOptions(port=0), lines.append, device="cpu")
        except SystemExit as e:
            exit_code.append(e.code)

    with mock.patch.dict(os.environ, ENGINE_ENV):
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        while len(lines) < 3 and thread.is_alive():
            time.sleep(0.05)
    port, pid = (
        int(re.search(pattern, text).group(1))
        for pattern, text in ((r":(\d+)/v1", lines[0]), (r"engine process (\d+)", lines[2]))
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model=tiny.name, prompt=[5] * 20, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine process has gone"):
        list(stream)
    thread.join(30)
    assert exit_code == [1]


def _dsc_serve(artifact, *args) -> tuple[subprocess.Popen, int, int]:
    """`dsc serve` on a free port: the process, its port and its engine process's pid."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsc", "serve", str(artifact), "--port", "0", "--device", "cpu", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **ENGINE_ENV},
    )
    lines = [proc.stdout.readline() for _ in range(3)]
    port, pid = re.search(r":(\d+)/v1", lines[0]), re.search(r"engine process (\d+)", lines[2])
    if not (port and pid):
        proc.kill()
        pytest.fail("".join(lines) + proc.stderr.read())
    return proc, int(port.group(1)), int(pid.group(1))


def test_dsc_serve_sigterm_under_load_drains_the_engine_and_exits_0(tiny):
    proc, port, engine_pid = _dsc_serve(tiny, "--shutdown-timeout", "60")
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        started = asyncio.Event()
        kw = dict(
            model=tiny.name, max_tokens=40, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}
        )

        async def streamed(i):
            ids, finish = [], None
            async for chunk in await client.completions.create(prompt=[7 + i] * 9, stream=True, **kw):
                started.set()
                ids += chunk.choices[0].model_extra["token_ids"]
                finish = chunk.choices[0].finish_reason or finish
            return finish, len(ids)

        async def whole(i):
            r = await client.completions.create(prompt=[70 + i] * 9, **kw)
            return r.choices[0].finish_reason, r.usage.completion_tokens

        async def load():
            tasks = [asyncio.create_task(streamed(i)) for i in range(8)] + [
                asyncio.create_task(whole(i)) for i in range(8)
            ]
            await started.wait()
            await asyncio.sleep(0.1)  # every request is in by now
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        results = asyncio.run(load())
        assert results == [("length", 40)] * 16
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        with pytest.raises(ProcessLookupError):  # the engine process has exited (and been reaped) too
            os.kill(engine_pid, 0)
    finally:
        proc.kill()


def test_an_artifact_that_fails_to_load_in_the_engine_process_is_its_one_line_error(tiny, tmp_path):
    from artifact_edits import copy_artifact

    from dsc.errors import UserError
    from dsc.serve.client import EngineClient

    art = copy_artifact(tiny, tmp_path / "art")
    with open(art / "rank0.safetensors", "r+b") as f:  # a rank file only the engine process reads
        f.seek(-8, 2)
        f.write(b"garbage!")
    with pytest.raises(UserError) as e:
        EngineClient.launch(art, {"device": "cpu"}, env=ENGINE_ENV)
    assert str(e.value) == f"{art / 'rank0.safetensors'}: checksum mismatch (file changed or corrupt since compile)"


def test_the_api_process_renders_the_artifacts_chat_template_without_its_weights(tiny, tmp_path):
    from artifact_edits import copy_artifact, read_json, rehash, write_json

    from dsc.errors import UserError
    from dsc.runtime.artifact import open_artifact
    from dsc.serve.client import EngineFacts

    art = copy_artifact(tiny, tmp_path / "art")
    cfg_path = art / "tokenizer" / "tokenizer_config.json"
    cfg = read_json(cfg_path)
    cfg["chat_template"] = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    write_json(cfg_path, cfg)
    rehash(art)
    opened = open_artifact(art, ranks=[])
    facts = EngineFacts(
        opened,
        opened.tokenizer(),
        dict(model_name="art", max_model_len=512, vocab_size=512, eos_token_ids=[], block_size=16, world=1, pid=0),
    )
    assert (
        facts.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        == "<system>be brief<user>hi<assistant>"
    )
    with pytest.raises(UserError, match="messages"):
        facts.apply_chat_template([{"content": "no role"}])
