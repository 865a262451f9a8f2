"""`dsc serve`: a live server on a free localhost port, driven by the official `openai` client
(and by raw HTTP for what a client library would never send).

Most tests run the HTTP layer over a fake engine of the LLMEngine interface (tests/serve_fake.py:
deterministic tokens, a scheduler with a KV block pool), which makes queueing, disconnects and
failures exact and fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_fake import FakeEngine, FakeSamplingParams, greedy_text  # noqa: E402

from dsc.serve.server import ServeOptions, build, build_server  # noqa: E402

MODEL = "fake-model"
# the engine process's torch threads: one core for it, one for this process (the API and the
# clients) on a 2-core runner; OpenMP threads that outnumber the free cores spin and starve both
ENGINE_ENV = {"OMP_NUM_THREADS": "1"}


class Live:
    """A server running in a thread, with clients pointed at it."""

    def __init__(self, server, engine, api_key=None):
        self.server, self.engine, self.port = server, engine, server.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0)

    def aclient(self):
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def raw(self, method: str, path: str, body=None, headers=None, timeout: float = 30) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        _, _, body = self.raw("GET", "/metrics")
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", body.decode(), re.M)}

    def wait_idle(self, timeout: float = 10) -> dict[str, float]:
        """/metrics once nothing runs or waits and no KV block is in use (or the last read)."""
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["dsc_num_requests_running"] == 0
                and m["dsc_num_requests_waiting"] == 0
                and m["dsc_kv_blocks_used"] == 0
            )
            if idle or time.monotonic() > end:
                return m
            time.sleep(0.05)


@contextlib.contextmanager
def serving(engine, sampling_params_cls=FakeSamplingParams, **opts):
    """The app over `engine` in this process (EngineDriver's thread)."""
    with running(build(engine, ServeOptions(port=0, **opts), sampling_params_cls), opts.get("api_key")) as live:
        yield live


@contextlib.contextmanager
def serving_process(artifact, **engine_kwargs):
    """The app over an engine process loading `artifact` on the CPU, as `dsc serve` runs it."""
    from dsc.serve.client import EngineClient

    client = EngineClient.launch(artifact, dict(device="cpu", **engine_kwargs), env=ENGINE_ENV)
    with running(build_server(client, ServeOptions(port=0))) as live:
        yield live


@contextlib.contextmanager
def running(server, api_key=None):
    thread = threading.Thread(target=server.run, kwargs={"sockets": [server.sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield Live(server, server.driver.engine, api_key)
    finally:
        server.should_exit = True
        thread.join(30)
        server.driver.stop(30)


@pytest.fixture(scope="module")
def live():
    with serving(FakeEngine(step_delay_s=0.001)) as s:
        yield s


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- completions and chat ---------------------------------------------------------------------------
def test_completion_text_usage_and_finish(live):
    r = live.client.completions.create(model=MODEL, prompt="hello there", max_tokens=7)
    assert r.object == "text_completion" and r.model == MODEL
    assert [c.text for c in r.choices] == [greedy_text("hello there", 7)]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 7, 18)


def test_chat_applies_the_template(live):
    r = live.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=5,
    )
    prompt = live.engine.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy_text(prompt, 5)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 5


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_equals_unstreamed_with_usage(live, chat):
    kw = dict(model=MODEL, max_tokens=12, n=2)
    call = (
        (lambda **k: live.client.chat.completions.create(messages=_chat("stream me"), **kw, **k))
        if chat
        else (lambda **k: live.client.completions.create(prompt="stream me", **kw, **k))
    )
    whole = call()
    texts, finish, usage, chunks = {0: "", 1: ""}, {}, None, 0
    for chunk in call(stream=True, stream_options={"include_usage": True}):
        chunks += 1
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    expect = {c.index: (c.message.content if chat else c.text) for c in whole.choices}
    assert texts == expect and texts[0] != texts[1]
    assert finish == {0: "length", 1: "length"} and chunks >= 12
    assert usage.completion_tokens == 24 == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(live):
    chunks = list(live.client.completions.create(model=MODEL, prompt="abc", max_tokens=3, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(live, stream):
    full = greedy_text("stop here", 16)
    stop = full[6:8]
    r = live.client.completions.create(
        model=MODEL, prompt="stop here", max_tokens=16, stop=[stop, "never"], stream=stream
    )
    if stream:
        chunks = list(r)
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == full[: full.index(stop)] and finish == "stop"


def test_completion_logprobs(live):
    r = live.client.completions.create(model=MODEL, prompt="lp", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs == [-0.25] * 4
    assert all(len(top) == 2 and top[tok] == -0.25 for top, tok in zip(lp.top_logprobs, lp.tokens))
    assert lp.text_offset == [0, 1, 2, 3]


def test_chat_logprobs(live):
    r = live.client.chat.completions.create(
        model=MODEL, messages=_chat("lp"), max_tokens=3, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)
    plain = live.client.chat.completions.create(model=MODEL, messages=_chat("lp"), max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_seeded_sampling_is_reproducible(live):
    def sample(seed):
        return (
            live.client.completions.create(model=MODEL, prompt="seed", max_tokens=16, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert sample(7) == sample(7) != sample(8)


def test_token_id_prompts(live):
    by_text = live.client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    by_ids = live.client.completions.create(model=MODEL, prompt=[104, 105], max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    several = live.client.completions.create(model=MODEL, prompt=[[104, 105], [120]], max_tokens=3, n=2)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == greedy_text("hi", 3) and several.choices[2].text == greedy_text("x", 3)
    assert several.usage.prompt_tokens == 3 and several.usage.completion_tokens == 12


def test_models_and_health(live):
    assert [m.id for m in live.client.models.list().data] == [MODEL]
    assert live.raw("GET", "/health")[0] == 200


def test_64_concurrent_streaming_clients_each_get_what_they_get_alone(live):
    prompts = [f"client {i} " + "x" * (i % 7) for i in range(64)]
    alone = [live.client.completions.create(model=MODEL, prompt=p, max_tokens=20).choices[0].text for p in prompts]

    async def one(client, p):
        text = ""
        async for chunk in await client.completions.create(model=MODEL, prompt=p, max_tokens=20, stream=True):
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def all_at_once():
        async with live.aclient() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == alone
    assert live.wait_idle()["dsc_kv_blocks_used"] == 0


# -- errors -------------------------------------------------------------------------------------------
BAD_BODIES = [
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "prompt": 12}, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "frequency_penaltyy": 1}, "frequency_penaltyy"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
]


@pytest.mark.parametrize("body, param", BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_completion_bodies_are_400_naming_the_field(live, body, param):
    status, _, data = live.raw("POST", "/v1/completions", body)
    err = json.loads(data)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param
    assert param in err["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x", "mood": "ok"}]}, "mood"),
        ({"model": MODEL, "messages": _chat("x"), "top_logprobs": 2}, "top_logprobs"),
        ({"model": MODEL, "messages": _chat("x"), "temperature": 3}, "temperature"),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_field(live, body, param):
    status, _, data = live.raw("POST", "/v1/chat/completions", body)
    assert status == 400 and json.loads(data)["error"]["param"] == param


def test_malformed_json_is_400(live):
    status, _, data = live.raw("POST", "/v1/completions", b'{"model": "fake-model", "prompt": ')
    err = json.loads(data)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and "JSON" in err["message"]


def test_openai_client_sees_the_errors(live):
    with pytest.raises(openai.NotFoundError) as e:
        live.client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model=MODEL, prompt="x" * 256, max_tokens=10)
    assert "max_seq" in e.value.body["message"] and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_unknown_route_and_method_are_openai_errors(live):
    status, _, data = live.raw("GET", "/v1/nothing")
    assert status == 404 and json.loads(data)["error"]["code"] == "not_found"
    assert live.raw("GET", "/v1/completions")[0] == 405


def test_a_body_over_the_limit_is_413(live):
    status, _, data = live.raw("POST", "/v1/completions", b"[" * (9 << 20))
    assert status == 413 and json.loads(data)["error"]["code"] == "body_too_large"


def test_api_key_and_served_model_name():
    with serving(FakeEngine(), api_key="s3cret", served_model_name="alias") as s:
        assert [m.id for m in s.client.models.list().data] == ["alias"]
        assert s.client.completions.create(model="alias", prompt="x", max_tokens=2).model == "alias"
        with pytest.raises(openai.NotFoundError):
            s.client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, _, data = s.raw("POST", "/v1/completions", {"prompt": "x"}, headers)
            assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
        assert s.raw("GET", "/health")[0] == 200  # probes need no key
        bench = ("bench-serve", s.url, "--rate", "inf", "--num-requests", "2", "--output-len", "2", "--vocab", "100")
        assert _dsc(*bench, DSC_API_KEY="s3cret").returncode == 0
        r = _dsc(*bench, DSC_API_KEY="wrong")
        assert r.returncode == 2 and "cannot list the server's models" in r.stderr


def test_a_full_queue_is_429_with_retry_after():
    with serving(FakeEngine(max_num_seqs=1, step_delay_s=0.01), max_queue=1) as s:
        running = s.client.completions.create(model=MODEL, prompt="a", max_tokens=200, stream=True)
        next(iter(running))  # it holds the one running slot
        waiting = threading.Thread(target=lambda: s.client.completions.create(model=MODEL, prompt="b", max_tokens=2))
        waiting.start()
        while s.metrics()["dsc_num_requests_waiting"] < 1:
            time.sleep(0.01)
        status, headers, data = s.raw("POST", "/v1/completions", {"prompt": "c", "max_tokens": 2})
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert json.loads(data)["error"]["code"] == "queue_full"
        running.close()
        waiting.join(30)
        assert s.client.completions.create(model=MODEL, prompt="c", max_tokens=2).choices[0].text
        assert s.metrics()['dsc_requests_total{code="429",endpoint="/v1/completions"}'] == 1


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "waiting"])
def test_a_client_that_disconnects_frees_its_kv_blocks(stream):
    with serving(FakeEngine(step_delay_s=0.01)) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "p" * 100, "max_tokens": 150, "stream": stream}),
            {"Content-Type": "application/json"},
        )
        if stream:
            r = conn.getresponse()
            assert r.status == 200 and r.read(6) == b"data: "
        while s.metrics()["dsc_kv_blocks_used"] == 0:
            time.sleep(0.01)
        assert s.metrics()["dsc_kv_blocks_used"] > 0
        conn.sock.shutdown(2)
        conn.close()
        m = s.wait_idle(timeout=3)
        assert m["dsc_kv_blocks_used"] == 0 and m["dsc_num_requests_running"] == 0
        assert m["dsc_generation_tokens_total"] < 150  # aborted, not run to the end


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(live):
    with pytest.raises(openai.InternalServerError):
        live.client.completions.create(model=MODEL, prompt="BOOM", max_tokens=3)
    with pytest.raises(openai.APIError, match="the engine failed on this request"):  # the stream's error event
        list(live.client.completions.create(model=MODEL, prompt="BOOM", max_tokens=3, stream=True))
    assert live.client.completions.create(model=MODEL, prompt="fine", max_tokens=3).choices[0].text == greedy_text(
        "fine", 3
    )


def test_chat_without_a_template_is_400():
    with serving(FakeEngine(chat_template=False)) as s:
        with pytest.raises(openai.BadRequestError) as e:
            s.client.chat.completions.create(model=MODEL, messages=_chat("x"))
        assert "chat template" in e.value.body["message"] and e.value.body["param"] == "messages"


def _garbage(rng: random.Random, i: int) -> tuple[str, str, bytes]:
    kind = i % 8
    if kind == 0:
        return "POST", "/v1/completions", rng.randbytes(rng.randrange(1, 2000))
    if kind == 1:
        depth = rng.choice([100, 5000, 100000])
        return "POST", "/v1/chat/completions", b"[" * depth + b"]" * depth
    if kind == 2:
        return "POST", "/v1/completions", b'{"prompt": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3001
    if kind == 3:
        junk = rng.choice([None, True, -1, 1e308, "x", [], {}, [[]], [-5], "\u0000"])
        field = rng.choice(["prompt", "max_tokens", "temperature", "n", "stop", "logprobs", "seed", "stream"])
        return "POST", "/v1/completions", json.dumps({"prompt": "ok", "max_tokens": 2, field: junk}).encode()
    if kind == 4:
        junk = rng.choice([None, 5, "user", [{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": 7}]])
        return "POST", "/v1/chat/completions", json.dumps({"messages": junk}).encode()
    if kind == 5:
        return (
            rng.choice(["GET", "PUT", "DELETE", "PATCH"]),
            rng.choice(["/v1/completions", "/", "/v1", "/x" * 50]),
            b"",
        )
    if kind == 6:
        return "POST", "/v1/completions", json.dumps({"prompt": [rng.randrange(-5, 10**12)] * 3}).encode()
    return "POST", "/v1/completions", json.dumps([1, 2, 3] if rng.random() < 0.5 else "prompt").encode()


def test_metrics_count_requests_and_tokens():
    with serving(FakeEngine()) as s:
        r = s.client.completions.create(model=MODEL, prompt="count me", max_tokens=6, n=2)
        list(s.client.completions.create(model=MODEL, prompt="and me", max_tokens=3, stream=True))
        s.raw("POST", "/v1/completions", {"prompt": "x", "n": -1})
        m = s.metrics()
        assert m['dsc_requests_total{code="200",endpoint="/v1/completions"}'] == 2
        assert m['dsc_requests_total{code="400",endpoint="/v1/completions"}'] == 1
        assert m["dsc_prompt_tokens_total"] == r.usage.prompt_tokens + 6
        assert m["dsc_generation_tokens_total"] == 12 + 3
        assert m["dsc_time_to_first_token_seconds_count"] == 2 and m["dsc_e2e_request_latency_seconds_count"] == 2
        assert m["dsc_inter_token_latency_seconds_count"] == 5 + 2
        assert m["dsc_kv_blocks_total"] == 512


# -- the process: SIGTERM, the CLI ----------------------------------------------------------------------
def _spawn_fake(step_delay: float, shutdown_timeout: float) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "serve_fake.py"), "0", str(step_delay), str(shutdown_timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("port "), line + proc.stderr.read()
    return proc, int(line.split()[1])


def test_sigterm_under_load_finishes_every_accepted_request_and_exits_0():
    proc, port = _spawn_fake(step_delay=0.02, shutdown_timeout=30)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        started = asyncio.Event()

        async def streamed(i):
            text = ""
            async for chunk in await client.completions.create(model=MODEL, prompt=f"s{i}", max_tokens=40, stream=True):
                started.set()
                text += chunk.choices[0].text
            return text

        async def whole(i):
            return (await client.completions.create(model=MODEL, prompt=f"w{i}", max_tokens=40)).choices[0].text

        async def load():
            tasks = [asyncio.create_task(streamed(i)) for i in range(8)] + [
                asyncio.create_task(whole(i)) for i in range(8)
            ]
            await started.wait()
            await asyncio.sleep(0.1)  # every request is in by now: they share each step
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        texts = asyncio.run(load())
        assert texts == [greedy_text(f"s{i}", 40) for i in range(8)] + [greedy_text(f"w{i}", 40) for i in range(8)]
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "engine shut down: True" in out
    finally:
        proc.kill()


def test_sigterm_past_the_shutdown_timeout_aborts_and_exits_0():
    proc, port = _spawn_fake(step_delay=0.05, shutdown_timeout=0.5)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "long", "max_tokens": 200, "stream": True}),
            {"Content-Type": "application/json"},
        )
        assert conn.getresponse().read(6) == b"data: "
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and time.monotonic() - t0 < 5, err
        assert "engine shut down: True" in out
    finally:
        proc.kill()


def _dsc(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsc", *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def test_serve_without_the_extra_names_it(tmp_path):
    code = (
        "import sys; sys.modules['fastapi'] = None; from dsc.cli import main; sys.argv = ['dsc'] + sys.argv[1:]; main()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "serve", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and r.stderr.strip() == "error: fastapi is not installed: pip install 'dsc[serve]'"


def test_serve_bad_flags_are_one_line(tmp_path):
    r = _dsc("serve", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    r = _dsc("serve", str(tmp_path), "--max-queue", "-1")
    assert r.returncode == 2 and "--max-queue" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_return_token_ids_and_chat_default_length(live):
    r = live.client.completions.create(model=MODEL, prompt="ids", max_tokens=4, extra_body={"return_token_ids": True})
    assert [chr(t) for t in r.choices[0].model_extra["token_ids"]] == list(r.choices[0].text)
    chat = live.client.chat.completions.create(model=MODEL, messages=_chat("long"))  # no max_tokens: fill the context
    prompt = live.engine.apply_chat_template(_chat("long"))
    assert chat.usage.completion_tokens == live.engine.max_model_len - len(prompt)
    assert chat.choices[0].finish_reason == "length"


# -- over the real engine in its own process: a tiny compiled Llama, fp32 on the CPU -------------------------
@pytest.fixture(scope="module")
def real(compile_artifact):
    with serving_process(
        compile_artifact("llama-tiny", dtype="fp32"), max_num_seqs=32, max_num_batched_tokens=128
    ) as s:
        yield s


def _ids(live, prompt, max_tokens, **kw):
    r = live.client.completions.create(
        model=live.engine.model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **kw,
    )
    return [c.model_extra["token_ids"] for c in r.choices], r


def test_greedy_outputs_equal_transformers_generate(real, make_checkpoint):
    import torch

    from dsc.compiler.verify import reference_greedy, reference_model

    ref = reference_model(make_checkpoint("llama-tiny"), torch.float32)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 6, 33, 90)]
    with torch.no_grad():
        expect = [reference_greedy(ref, p, 10)[0] for p in prompts]
    got, r = _ids(real, prompts, 10)
    assert got == expect
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 40
    text = real.client.completions.create(
        model=real.engine.model_name,
        prompt="Hello world",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = real.engine.tokenizer.encode("Hello world").ids
    with torch.no_grad():
        assert text.choices[0].model_extra["token_ids"] == reference_greedy(ref, ids, 6)[0]
    # the engine's text holds back a trailing incomplete UTF-8 sequence, which a whole decode shows as U+FFFD
    assert real.engine.tokenizer.decode(reference_greedy(ref, ids, 6)[0]).startswith(text.choices[0].text)


def test_real_64_concurrent_streaming_clients_each_get_what_they_get_alone(real):
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))] for _ in range(64)]
    alone = [_ids(real, p, 6)[0][0] for p in prompts]

    async def one(client, p):
        ids = []
        async for chunk in await client.completions.create(
            model=real.engine.model_name,
            prompt=p,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        ):
            ids += chunk.choices[0].model_extra["token_ids"] if chunk.choices else []
        return ids

    async def all_at_once():
        async with real.aclient() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == alone
    assert real.wait_idle()["dsc_kv_blocks_used"] == 0


def test_real_logprobs_of_greedy_tokens_are_the_top_ones(real):
    ids, r = _ids(real, [3, 4, 5, 6], 6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 == len(lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == real.engine.tokenizer.decode(ids[0])  # per-token strings, in order
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and chosen >= max(top.values()) - 1e-5  # greedy: the chosen token is the top one


def test_real_seeded_sampling_and_stop_strings(real):
    name = real.engine.model_name

    def sample(seed):
        return (
            real.client.completions.create(
                model=name, prompt="Hello", max_tokens=12, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    assert sample(3) == sample(3)
    full = (
        real.client.completions.create(
            model=name, prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    streamed = "".join(
        c.choices[0].text
        for c in real.client.completions.create(
            model=name,
            prompt="Hello",
            max_tokens=12,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert streamed == full[: full.index(stop)]


def test_real_stop_strings_in_the_api_process_match_the_in_process_engine(real, compile_artifact):
    """The API process detokenizes and applies stop strings: the same texts, finish reasons and
    token counts as LLMEngine's own detokenizer in one process, streamed or not."""
    from dsc.runtime.llm import LLM, SamplingParams

    llm = LLM(compile_artifact("llama-tiny", dtype="fp32"), device="cpu", max_num_batched_tokens=128)
    name, tok = real.engine.model_name, real.engine.tokenizer
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = dict(n=2, max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)  # choice 1 never stops
    full, both = llm.generate(["Hello"] * 2, [SamplingParams(**greedy), SamplingParams(**sampled)])
    text, both = full.outputs[0].text.rstrip("\ufffd"), both.outputs
    stops = [[text[5:7]], ["never", text[10:13]], [text[2]]]
    stop = next(both[0].text[k : k + 3] for k in range(2, 12) if both[0].text[k : k + 3] not in both[1].text)
    refs = llm.generate(
        ["Hello"] * 4, [SamplingParams(stop=s, **greedy) for s in stops] + [SamplingParams(stop=[stop], **sampled)]
    )
    for s, ref in zip(stops, refs):
        ref = ref.outputs[0]
        kw = dict(model=name, prompt="Hello", max_tokens=24, temperature=0, stop=s, extra_body={"ignore_eos": True})
        r = real.client.completions.create(**kw)
        assert ref.finish_reason == "stop" and (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert "".join(c.choices[0].text for c in real.client.completions.create(stream=True, **kw)) == ref.text
    # n = 2: a stop string of choice 0 that choice 1 never shows ends choice 0 only
    ref = refs[-1].outputs
    r = real.client.completions.create(
        model=name,
        prompt="Hello",
        max_tokens=20,
        n=2,
        temperature=1.0,
        seed=11,
        stop=[stop],
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    c0, c1 = sorted(r.choices, key=lambda c: c.index)
    assert (c0.text, c0.finish_reason, c0.model_extra["token_ids"]) == (ref[0].text, "stop", ref[0].token_ids)
    assert c1.finish_reason == "length" and c1.model_extra["token_ids"] == ref[1].token_ids == both[1].token_ids
    assert c1.text == tok.decode(ref[1].token_ids)  # a choice that ends by length shows its whole text
    assert real.wait_idle()["dsc_kv_blocks_used"] == 0


def test_real_disconnect_frees_the_kv_blocks(real):
    conn = http.client.HTTPConnection("127.0.0.1", real.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": [5] * 50, "max_tokens": 400, "stream": True, "ignore_eos": True}),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    assert r.status == 200 and r.read(6) == b"data: "
    used = real.metrics()["dsc_kv_blocks_used"]
    assert used >= -(-51 // real.engine.block_size)
    conn.sock.shutdown(2)
    conn.close()
    m = real.wait_idle(timeout=5)
    assert m["dsc_kv_blocks_used"] == 0 and m["dsc_num_requests_running"] == 0


def test_real_errors_name_the_limit(real):
    with pytest.raises(openai.BadRequestError) as e:
        real.client.completions.create(model=real.engine.model_name, prompt=[5] * (real.engine.max_model_len + 1))
    assert "max_seq" in e.value.body["message"] and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        real.client.completions.create(model=real.engine.model_name, prompt=[10**6])
    assert "vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the random checkpoint's tokenizer has no chat template
        real.client.chat.completions.create(model=real.engine.model_name, messages=_chat("hi"))
    assert "chat template" in e.value.body["message"]


# -- the load generator -----------------------------------------------------------------------------------
def test_bench_lengths_and_arrivals():
    from dsc.errors import UserError
    from dsc.serve.bench import Lengths, arrivals

    rng = random.Random(0)
    assert {Lengths.parse("5:7", "--x").draw(rng) for _ in range(200)} == {5, 6, 7}
    assert {Lengths.parse("128,2048", "--x").draw(rng) for _ in range(50)} == {128, 2048}
    for bad in ("0", "9:3", "a", "1:2:3", ""):
        with pytest.raises(UserError, match="--x"):
            Lengths.parse(bad, "--x")
    times = arrivals(50.0, 4000, seed=0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times == sorted(times) and abs(sum(gaps) / len(gaps) - 1 / 50) < 0.002
    assert abs(sum(g > 1 / 50 for g in gaps) / len(gaps) - math.exp(-1)) < 0.03  # exponential: P(gap > mean) = 1/e
    assert arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]


def test_bench_serve_reports_every_rate(tmp_path):
    with serving(FakeEngine(step_delay_s=0.002, max_num_seqs=8)) as s:
        r = _dsc(
            "bench-serve",
            s.url,
            "--rate",
            "30",
            "--rate",
            "inf",
            "--num-requests",
            "24",
            "--prompt-len",
            "4:40",
            "--output-len",
            "5,9",
            "--vocab",
            "120",
            "--json",
            str(tmp_path / "b.json"),
            "--png",
            str(tmp_path / "b.png"),
        )
        assert r.returncode == 0, r.stderr
        m = s.metrics()
    res = json.loads((tmp_path / "b.json").read_text())
    assert [row["rate"] for row in res["results"]] == [30.0, "inf"] and res["model"] == MODEL
    for row in res["results"]:
        assert row["completed"] == 24 and row["failed"] == 0 and row["output_tokens_per_s"] > 0
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p90"] <= row[key]["p99"]
        assert row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]
    assert m['dsc_requests_total{code="200",endpoint="/v1/completions"}'] == 48
    # every request generated exactly its output length (ignore_eos), counted once by the server
    assert m["dsc_generation_tokens_total"] == 2 * sum(n for _, n in _workload(24, "4:40", "5,9", 120))
    assert "TTFT p50/p90/p99 ms" in r.stdout and "30.0" in r.stdout
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "matplotlib is not installed" in r.stderr


def _workload(n, prompt_len, output_len, vocab):
    from dsc.serve.bench import BenchConfig, Lengths, workload

    return workload(BenchConfig("x", [1.0], n, Lengths.parse(prompt_len, "p"), Lengths.parse(output_len, "o"), vocab))


def test_bench_serve_bad_input_is_one_line():
    r = _dsc("bench-serve", "http://127.0.0.1:9", "--rate", "fast")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --rate")
    r = _dsc("bench-serve", "http://127.0.0.1:9", "--num-requests", "1")  # nothing listens on port 9
    assert r.returncode == 2 and "cannot list the server's models" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_tp2_serve_starts_its_ranks_answers_like_tp1_and_drains_on_sigterm(compile_artifact, make_checkpoint):
    """`dsc serve` on a tp=2 artifact starts 2 gloo ranks under torchrun; rank 0 serves HTTP.
    SIGTERM to `dsc serve`: rank 0 finishes the stream in flight, releases rank 1, all exit 0."""
    import torch

    from dsc.compiler.verify import reference_greedy, reference_model

    art = compile_artifact("llama-tiny", dtype="fp32", tp=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsc", "serve", str(art), "--port", "0", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        port = int(re.search(r":(\d+)/v1", line).group(1)) if "/v1" in line else pytest.fail(line + proc.stderr.read())
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        prompt = [7, 99, 301, 45, 12]
        r = client.completions.create(
            model=art.name,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        with torch.no_grad():
            expect = reference_greedy(reference_model(make_checkpoint("llama-tiny"), torch.float32), prompt, 8)[0]
        assert r.choices[0].model_extra["token_ids"] == expect
        stream = client.completions.create(
            model=art.name,
            prompt=prompt,
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ids = list(next(iter(stream)).choices[0].model_extra["token_ids"])
        proc.send_signal(signal.SIGTERM)
        for chunk in stream:
            ids += chunk.choices[0].model_extra["token_ids"]
        assert len(ids) == 60 and ids[:8] == expect
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()


def test_a_thousand_garbage_requests_leave_it_serving_and_the_pool_empty(real):
    rng = random.Random(0)
    before = _ids(real, [9, 8, 7], 5)[0]
    conn = http.client.HTTPConnection("127.0.0.1", real.port, timeout=30)
    statuses = {}
    for i in range(1000):
        method, path, body = _garbage(rng, i)
        conn.request(method, path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        payload = r.read()
        statuses[r.status] = statuses.get(r.status, 0) + 1
        assert r.status < 500, (method, path, body[:200], payload[:300])
        if r.status >= 400:
            assert "message" in json.loads(payload)["error"]
        if r.getheader("connection") == "close":
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", real.port, timeout=30)
    conn.close()
    assert sum(statuses.values()) == 1000 and statuses.get(400, 0) > 500
    assert real.wait_idle()["dsc_kv_blocks_used"] == 0
    assert _ids(real, [9, 8, 7], 5)[0] == before


def test_bench_serve_against_the_real_server_and_offline(real, compile_artifact, tmp_path):
    art = compile_artifact("llama-tiny", dtype="fp32")
    r = _dsc(
        "bench-serve",
        real.url,
        "--rate",
        "inf",
        "--num-requests",
        "12",
        "--prompt-len",
        "3:50",
        "--output-len",
        "4:9",
        "--vocab",
        "500",
        "--offline",
        str(art),
        "--device",
        "cpu",
        "--json",
        str(tmp_path / "b.json"),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "b.json").read_text())
    http, offline = res["results"]
    assert http["completed"] == offline["completed"] == 12 and offline["rate"] == "offline"
    # the same requests, each generating exactly its output length, both ways
    assert http["output_tokens_per_s"] * http["duration_s"] == pytest.approx(
        offline["output_tokens_per_s"] * offline["duration_s"]
    )
    assert res["http_over_offline"] == pytest.approx(http["output_tokens_per_s"] / offline["output_tokens_per_s"])
    assert "saturated HTTP throughput / offline dsc.LLM" in r.stdout
