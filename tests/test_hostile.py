"""The server and the loader under hostile input: one bad request never hurts the others, a
template cannot freeze the server, every error is a clean 4xx (or one line), against a live
server with the `openai` client and raw HTTP.

Numbered as the problems they keep fixed: (1) a value past the model's bounds (top_k 1e30)
must not reach a step; (2) a chat template cannot block the event loop; (3) invalid Unicode;
(4) no type coercion; (5) --max-queue counts what truly waits; (6) shutdown past its timeout
ends streams with an error event and [DONE]; (7) HTTP edges; (8) artifact JSON, hard links and
`dsc inspect`'s cost.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from artifact_edits import copy_artifact, read_json, rehash, write_json  # noqa: E402
from serve_fake import FakeEngine, greedy_text  # noqa: E402
from test_serve import MODEL, _spawn_fake, serving  # noqa: E402

from dsc.errors import UserError  # noqa: E402

SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE_TEMPLATE = (
    "{% for m in messages %}{% if m.content == 'spin' %}" + SPIN + "{% endif %}"
    "{% if m.content == 'div' %}{{ 1 / 0 }}{% endif %}"
    "{% if m.content == 'range' %}{{ range(10**9) | list }}{% endif %}"
    "{% if m.content == 'recurse' %}{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}<assistant>"
)


@pytest.fixture(scope="module")
def fake():
    with serving(FakeEngine(step_delay_s=0.001, chat_template=HOSTILE_TEMPLATE)) as s:
        yield s


@pytest.fixture(scope="module")
def real(compile_artifact):
    from dsc.runtime.llm import LLMEngine, SamplingParams

    engine = LLMEngine(
        compile_artifact("llama-tiny", dtype="fp32"), device="cpu", max_num_seqs=32, max_num_batched_tokens=128
    )
    with serving(engine, SamplingParams) as s:
        yield s


def _error(status_body) -> dict:
    status, _, body = status_body
    return status, json.loads(body)["error"]


# -- (1) bounds: a bad value never reaches a step -----------------------------------------------------------
def test_4_streams_finish_while_a_top_k_1e30_request_gets_400(real):
    name = real.engine.model_name

    async def stream(client, i):
        ids, finish = [], None
        async for chunk in await client.completions.create(
            model=name,
            prompt=[5 + i, 6, 7],
            max_tokens=24,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 0 if i % 2 else 5},
        ):
            for c in chunk.choices:
                ids += c.model_extra["token_ids"]
                finish = c.finish_reason or finish
        return len(ids), finish

    async def run():
        async with real.aclient() as client:
            tasks = [asyncio.create_task(stream(client, i)) for i in range(4)]
            await asyncio.sleep(0.2)
            bad = [
                await asyncio.to_thread(
                    real.raw, "POST", "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 4, **kw}
                )
                for kw in (
                    {"top_k": 1e30},
                    {"top_k": 2**63},
                    {"top_k": real.engine.vocab_size + 1},
                    {"seed": 2**64},
                    {"n": 129},
                    {"logprobs": 21},
                    {"min_tokens": 5, "max_tokens": 4},
                    {"min_tokens": -1},
                    {"max_tokens": real.engine.max_model_len + 1},
                )
            ]
            return await asyncio.gather(*tasks), bad

    streams, bad = asyncio.run(run())
    assert streams == [(24, "length")] * 4
    for (status, _, body), field in zip(
        bad, ("top_k", "top_k", "top_k", "seed", "n", "logprobs", "min_tokens", "min_tokens", "max_tokens")
    ):
        err = json.loads(body)["error"]
        assert status == 400 and err["param"] == field, (field, status, body)


def test_the_engine_bounds_every_field_itself(real):
    from dsc.runtime.llm import SamplingParams

    eng = real.engine
    for kw, field in (
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": eng.vocab_size + 1}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"n": True}, "n"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": 1.0}, "max_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"logprobs": 10**9}, "logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ):
        with pytest.raises(UserError, match=f"^{field}:"):
            eng._resolve(SamplingParams(**kw))
    assert eng._resolve(SamplingParams(top_k=eng.vocab_size, min_tokens=16)).min_tokens == 16
    assert eng._resolve(SamplingParams(max_tokens=10**12)).max_tokens == eng.max_model_len


@pytest.mark.parametrize(
    "bad, field", [({"top_k": 10**30}, "top_k"), ({"top_p": 7}, "top_p"), ({"temperature": -1}, "temperature")]
)
def test_generation_config_defaults_are_bounded_at_load(compile_artifact, tmp_path, bad, field):
    from dsc.runtime.llm import LLMEngine

    art = copy_artifact(compile_artifact("llama-tiny", dtype="fp32"), tmp_path / "a")
    write_json(art / "tokenizer" / "generation_config.json", {"do_sample": True, **bad})
    rehash(art)
    with pytest.raises(UserError, match=f"generation_config.json: field {field}:"):
        LLMEngine(art, device="cpu")


# -- (2) templates cannot freeze the server --------------------------------------------------------------------
def test_health_answers_within_100ms_while_a_hostile_template_is_refused(fake):
    result = {}

    def hostile():
        result["r"] = fake.raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "spin"}]})

    t = threading.Thread(target=hostile)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert fake.raw("GET", "/health")[0] == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    t.join()
    status, err = _error(result["r"])
    assert status == 400 and "time budget" in err["message"] and "chat_template.jinja" in err["message"]
    assert err["param"] == "messages" and worst < 0.1, worst


@pytest.mark.parametrize(
    "content, why", [("div", "ZeroDivisionError"), ("range", "Range too big"), ("recurse", "nested too deeply")]
)
def test_template_errors_are_400_naming_the_template(fake, content, why):
    status, err = _error(fake.raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}))
    assert status == 400 and why in err["message"] and "chat template" in err["message"]


def test_a_stream_in_flight_keeps_streaming_through_a_hostile_render():
    with serving(FakeEngine(step_delay_s=0.01, chat_template=HOSTILE_TEMPLATE)) as s:
        gaps, last = [], None
        stream = s.client.completions.create(model=MODEL, prompt="long", max_tokens=120, stream=True)
        next(iter(stream))
        bad = threading.Thread(
            target=s.raw, args=("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "spin"}]})
        )
        bad.start()
        for _ in stream:
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
        bad.join()
        assert len(gaps) >= 100 and max(gaps) < 0.25, max(gaps)


def test_chat_template_kwargs_and_tools_reach_the_template(fake):
    msgs = [{"role": "user", "content": "hi"}]
    r = fake.client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    prompt = fake.engine.apply_chat_template(msgs, chat_template_kwargs={"enable_thinking": False})
    assert prompt.endswith("<nothink><assistant>") and r.choices[0].message.content == greedy_text(prompt, 4)
    for body, field in (
        ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ):
        status, err = _error(fake.raw("POST", "/v1/chat/completions", {"messages": msgs, **body}))
        assert status == 400 and err["param"] == field, (body, err)


# -- (3) invalid Unicode ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": "x\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\ud800"]}, "prompt"),
        ("/v1/completions", {"prompt": "ok", "stop": ["\ud83d"]}, "stop"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"k\ud800": 1}},
            "chat_template_kwargs",
        ),
    ],
)
def test_lone_surrogates_are_400_on_every_route(real, path, body, field):
    status, err = _error(real.raw("POST", path, body))
    assert status == 400 and err["param"] == field and "surrogate" in err["message"]


def test_lone_surrogates_in_the_offline_api_are_one_line(real):
    with pytest.raises(UserError, match="prompt: invalid Unicode"):
        real.engine.encode("\ud800")


# -- (4) strict types ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": "8"},
        {"max_tokens": True},
        {"max_tokens": 8.0},
        {"stream": "yes"},
        {"stream": 1},
        {"n": "2"},
        {"temperature": "1"},
        {"seed": 1.5},
        {"top_k": False},
        {"logprobs": "2"},
        {"ignore_eos": "true"},
        {"prompt": ["x", 5]},
    ],
    ids=lambda d: json.dumps(d),
)
def test_wrong_types_are_refused_not_coerced(fake, bad):
    field = next(iter(bad))
    status, err = _error(fake.raw("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, **bad}))
    assert status == 400 and err["param"] == field, err


def test_an_integer_is_a_valid_number(fake):
    r = fake.client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=1, top_p=1)
    assert len(r.choices[0].text) == 3


# -- (5) admission ---------------------------------------------------------------------------------------------------
def test_max_queue_accepts_a_whole_burst_while_slots_are_free():
    with serving(FakeEngine(max_num_seqs=256, step_delay_s=0.005), max_queue=4) as s:

        async def burst():
            async with s.aclient() as client:
                return await asyncio.gather(
                    *(client.completions.create(model=MODEL, prompt=f"b{i}", max_tokens=8) for i in range(50)),
                    return_exceptions=True,
                )

        outs = asyncio.run(burst())
        assert [o.choices[0].text for o in outs] == [greedy_text(f"b{i}", 8) for i in range(50)]


def test_max_queue_rejects_only_past_the_truly_waiting():
    with serving(FakeEngine(max_num_seqs=2, step_delay_s=0.01), max_queue=4) as s:
        running = [
            s.client.completions.create(model=MODEL, prompt=f"r{i}", max_tokens=250, stream=True) for i in range(2)
        ]
        for r in running:
            next(iter(r))
        results = []
        waiting = [
            threading.Thread(
                target=lambda i=i: results.append(
                    s.client.completions.create(model=MODEL, prompt=f"w{i}", max_tokens=2)
                )
            )
            for i in range(4)
        ]
        for t in waiting:
            t.start()
        while s.metrics()["dsc_num_requests_waiting"] < 4:
            time.sleep(0.01)
        status, headers, body = s.raw("POST", "/v1/completions", {"prompt": "one too many", "max_tokens": 2})
        assert status == 429 and json.loads(body)["error"]["code"] == "queue_full"
        for r in running:
            r.close()
        for t in waiting:
            t.join(30)
        assert sorted(o.choices[0].text for o in results) == sorted(greedy_text(f"w{i}", 2) for i in range(4))


# -- (6) shutdown --------------------------------------------------------------------------------------------------
def test_streams_cut_by_the_shutdown_timeout_end_with_an_error_and_done():
    proc, port = _spawn_fake(step_delay=0.05, shutdown_timeout=0.5)
    try:
        import http.client

        streams = []
        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request(
                "POST",
                "/v1/completions",
                json.dumps({"prompt": "long", "max_tokens": 200, "stream": True}),
                {"Content-Type": "application/json"},
            )
            r = conn.getresponse()
            assert r.status == 200
            streams.append(r)
        proc.send_signal(signal.SIGTERM)
        for r in streams:
            events = [e for e in r.read().decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]", events[-3:]
            err = json.loads(events[-2].removeprefix("data: "))["error"]
            assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "engine shut down: True" in out
        assert "Traceback" not in err and "CancelledError" not in err, err
    finally:
        proc.kill()


# -- (7) HTTP edges ---------------------------------------------------------------------------------------------------
def _chunked(port: int, chunks) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=iter(chunks),
            encode_chunked=True,
            headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        )
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before the last chunk
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_a_chunked_body_over_the_limit_is_413(fake):
    status, body = _chunked(fake.port, [b"[" * (1 << 20)] * 9)
    assert status == 413 and body["error"]["code"] == "body_too_large"
    status, body = _chunked(fake.port, [b'{"prompt": "hi", ', b'"max_tokens": 3}'])
    assert status == 200 and body["choices"][0]["text"] == greedy_text("hi", 3)


def _raw_socket(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n{}",
    ],
    ids=["request-line", "content-length", "header", "two-lengths"],
)
def test_malformed_requests_get_the_json_error_shape(fake, request_bytes):
    head, _, body = _raw_socket(fake.port, request_bytes).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["code"] == "bad_http_request" and err["type"] == "invalid_request_error"
    assert fake.raw("GET", "/health")[0] == 200


# -- (8) artifacts ---------------------------------------------------------------------------------------------
def _dsc(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsc", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "file, edit",
    [
        ("plan.json", lambda t: t.replace('"format_version": 2', '"format_version": 2' + "0" * 5000, 1)),
        ("manifest.json", lambda t: t.replace('"tp": 1', '"tp": 1' + "0" * 5000, 1)),
        ("manifest.json", lambda t: t[:-1].rstrip().rstrip("}") + ', "int8_report": {"logits": {"sqnr_db": 1e400}}}'),
        ("manifest.json", lambda t: t[:-1].rstrip().rstrip("}") + ', "x": NaN}'),
        ("plan.json", lambda t: t.replace('"tp": 1', '"tp": -Infinity', 1)),
    ],
    ids=["huge-int-plan", "huge-int-manifest", "float-overflow", "nan", "infinity"],
)
def test_artifact_json_parse_errors_are_one_line(compile_artifact, tmp_path, file, edit):
    art = copy_artifact(compile_artifact("llama-tiny", dtype="fp32"), tmp_path / "a")
    (art / file).write_text(edit((art / file).read_text()))
    if file != "manifest.json":
        rehash(art)
    r = _dsc("inspect", str(art))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not valid JSON" in r.stderr, r.stderr


def test_inspect_survives_an_overflowing_int8_report(compile_artifact, tmp_path):
    art = copy_artifact(compile_artifact("llama-tiny", dtype="fp32"), tmp_path / "a")
    m = read_json(art / "manifest.json")
    m["int8_report"] = {
        "mode": "w8a16",
        "symmetric": True,
        "logits": {"sqnr_db": 10**250, "kl_div": 1e300, "top1_agreement": 10**200, "positions": 3},
        "weight_sqnr_db": {"worst": [["x", 10**299]]},
        "memory": {"int8_bytes": 10**299, "scale_bytes": 1, "bytes_16bit": 1},
    }
    write_json(art / "manifest.json", m)
    r = _dsc("inspect", str(art))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_a_hard_link_to_a_file_outside_is_refused(compile_artifact, tmp_path):
    from dsc.runtime.artifact import open_artifact

    art = copy_artifact(compile_artifact("llama-tiny", dtype="fp32"), tmp_path / "a")
    outside = tmp_path / "secret.json"
    outside.write_text('{"model": {}}')
    (art / "tokenizer" / "tokenizer_config.json").unlink()
    os.link(outside, art / "tokenizer" / "tokenizer_config.json")
    rehash(art)
    with pytest.raises(UserError, match="tokenizer_config.json' has 2 hard links"):
        open_artifact(art, ranks=[0])


def test_memory_planning_is_linear_in_the_plan():
    """plan_memory (what `dsc inspect` spends its time on) over chains of 4k and 16k nodes."""
    from dsc.runtime.memory_plan import plan_memory

    def chain(n):
        nodes = [{"kind": "input", "name": "x", "shape": [8, 64], "dtype": "float32"}]
        for i in range(n):
            nodes.append(
                {
                    "kind": "call",
                    "name": f"n{i}",
                    "op": "aten.relu.default",
                    "shape": [8, 64],
                    "dtype": "float32",
                    "args": [{"node": nodes[-1]["name"]}],
                    "kwargs": {},
                }
            )
        return nodes + [{"kind": "output", "name": "out", "args": [{"node": nodes[-1]["name"]}]}]

    def cost(n):
        nodes = chain(n)
        best = float("inf")
        gc.collect()
        gc.disable()  # a collection of the whole test process's heap is no cost of the planner's
        try:
            for _ in range(3):
                t0 = time.perf_counter()
                plan_memory(nodes, {})
                best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
        return best

    small, large = cost(4000), cost(16000)
    assert large / small < 8, (small, large)  # 4x the nodes: linear ~4x, quadratic ~16x
