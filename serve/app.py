"""The OpenAI-compatible HTTP API over an EngineDriver: a FastAPI app factory.

    POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
    GET /health, GET /metrics (Prometheus); an encoder artifact serves POST /v1/embeddings
    instead of the two generation endpoints (each refuses the other kind's model with a 400)

Every error is OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 for a body
that does not validate (naming the field), a value past the model's bounds, a prompt that does
not fit (naming the limit) or a chat template that fails or runs past its budget (naming the
template), 401 without the API key, 404 for an unknown model, 413 for a body over the size
limit (with a Content-Length or chunked), 429 with Retry-After when more requests wait than
--max-queue allows. A request whose client goes away is aborted in the engine at once, which
frees its KV blocks. Chat templates render in a worker off the event loop, so /health and the
streams in flight never wait for one. When shutdown's timeout passes (`Server.begin_shutdown`),
the requests still open end with a 503 error: a stream's last events are the error and
`data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsc.errors import UserError
from dsc.serve import protocol as P
from dsc.serve.driver import ACCEPTED, EngineDriver
from dsc.serve.metrics import Metrics

MAX_BODY_BYTES = 8 << 20  # 8 MiB: a 128k-token prompt as token ids is about 1 MiB of JSON
_CUT = "cut"  # queued into a request's outputs when the shutdown timeout has passed
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            P.error_body(self.message, self.type, self.param, self.code), self.status, headers=self.headers
        )


@dataclass
class _Track:
    """One engine request seen from the HTTP side: for metrics and for streaming deltas."""

    prompt_index: int
    arrival: float
    seqs: int = 1  # the engine sequences it runs (its n)
    last: float | None = None
    tokens: int = 0
    finished: bool = False
    sent: dict = field(default_factory=dict)  # choice index -> (chars sent, tokens sent)


class Server:
    """The app's state: the driver, the served name, the queue limit, the metrics."""

    def __init__(
        self,
        driver: EngineDriver,
        served_model_name: str | None = None,
        max_queue: int = 1024,
        retry_after_s: int = 1,
    ):
        self.driver = driver
        self.engine = driver.engine
        self.model_name = served_model_name or self.engine.model_name
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.in_flight = 0  # engine sequences submitted and not yet finished (asyncio thread only)
        self.created = int(time.time())
        self.metrics = Metrics(lambda: self.driver.stats)
        sched = getattr(self.engine, "scheduler", self.engine)
        self.max_num_seqs = int(getattr(sched, "max_num_seqs", 1))
        self.kind = getattr(self.engine, "kind", "decoder")  # "encoder": an embedding model
        self.open: weakref.WeakSet[_Outputs] = weakref.WeakSet()  # requests not finished
        self.closing = False

    # -- shutdown ---------------------------------------------------------------------------------
    def begin_shutdown(self, timeout_s: float) -> None:
        """Called on the event loop as shutdown starts: requests still open after timeout_s end
        with a 503 error (streams: the error event, then [DONE])."""
        self.closing = True
        asyncio.get_running_loop().call_later(max(timeout_s, 0.0), self._cut)

    def _cut(self) -> None:
        for outs in list(self.open):
            outs.queue.put_nowait((None, _CUT))

    # -- admission --------------------------------------------------------------------------------
    def check_model(self, model: str | None, kind: str = "decoder") -> None:
        """The request names the served model (or none), and the endpoint serves its kind."""
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"model: {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )
        if kind != self.kind:
            what = (
                "an embedding (encoder) model: it serves /v1/embeddings only"
                if self.kind == "encoder"
                else "a text-generation model: it serves /v1/completions and /v1/chat/completions, not /v1/embeddings"
            )
            raise ApiError(400, f"model: {self.model_name!r} is {what}", "model", "model_not_supported")

    def waiting(self) -> int:
        """Sequences waiting for a slot: the engine's waiting queue as of its latest stats, plus
        the sequences submitted since then (not yet in those stats) that the free slots cannot
        take. Free slots count only while nothing waits (else the KV pool is what holds them)."""
        s = self.driver.stats
        running, waiting = s["num_running"], s["num_waiting"]
        unseen = max(0, self.in_flight - running - waiting)
        free = max(0, self.max_num_seqs - running) if waiting == 0 else 0
        return waiting + max(0, unseen - free)

    def check_queue(self, count: int) -> None:
        if self.closing:
            raise ApiError(503, "the server is shutting down", None, "server_shutting_down", "server_error")
        if self.waiting() + count > self.max_queue:
            raise ApiError(
                429,
                f"the request queue is full ({self.max_queue} waiting, --max-queue); retry later",
                None,
                "queue_full",
                "rate_limit_error",
                {"Retry-After": str(self.retry_after_s)},
            )

    async def submit(self, prompts: list, fields: dict) -> _Outputs:
        """Add one engine request per prompt; return once the engine took them all, or raise
        ApiError(400) for the first one it refused (the others are aborted); 503 when the
        engine has stopped."""
        if not self.driver.alive():
            raise ApiError(503, "the engine is not running", None, "engine_unavailable", "server_error")
        self.check_queue(len(prompts) * fields.get("n", 1))
        outs = _Outputs(self, asyncio.Queue())
        self.open.add(outs)
        loop = asyncio.get_running_loop()
        base = uuid.uuid4().hex
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{base}-{i}"
                outs.track[rid] = _Track(i, time.perf_counter(), seqs=fields.get("n", 1))
                self.in_flight += fields.get("n", 1)
                self.driver.add(
                    rid,
                    prompt,
                    fields,
                    lambda item, rid=rid: loop.call_soon_threadsafe(outs.queue.put_nowait, (rid, item)),
                )
            await outs.wait_accepted()
        except BaseException:
            outs.abort()
            raise
        return outs

    def token_str(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"


class _Outputs:
    """The outputs of one HTTP request's engine requests, as they arrive."""

    def __init__(self, server: Server, queue: asyncio.Queue):
        self.server, self.queue = server, queue
        self.track: dict[str, _Track] = {}
        self.prompt_tokens: dict[int, int] = {}
        self._early: list = []  # outputs of a prompt that arrived before a later prompt was accepted

    async def wait_accepted(self) -> None:
        pending = set(self.track)
        while pending:
            rid, item = await self.queue.get()
            if item is _CUT:
                raise _shutdown_error()
            if isinstance(item, BaseException):
                self._finish(rid)
                raise _as_api_error(item)
            if item is ACCEPTED:
                pending.discard(rid)
            else:
                self._early.append((rid, item))

    async def __aiter__(self) -> AsyncIterator:
        """(track, RequestOutput) per output, until every request finished."""
        while not all(t.finished for t in self.track.values()):
            rid, item = self._early.pop(0) if self._early else await self.queue.get()
            if item is _CUT:
                raise _shutdown_error()
            if isinstance(item, BaseException):
                self._finish(rid)
                raise _as_api_error(item)
            t = self.track[rid]
            self._observe(t, item)
            if item.finished:
                self._finish(rid)
            yield t, item

    def _observe(self, t: _Track, out) -> None:
        m, now = self.server.metrics, time.perf_counter()
        if t.prompt_index not in self.prompt_tokens:
            self.prompt_tokens[t.prompt_index] = len(out.prompt_token_ids)
            m.prompt_tokens.inc(len(out.prompt_token_ids))
        tokens = sum(len(c.token_ids) for c in out.outputs) if isinstance(out.outputs, list) else 0
        if tokens > t.tokens:
            m.generation_tokens.inc(tokens - t.tokens)
            (m.itl.observe(now - t.last) if t.last is not None else m.ttft.observe(now - t.arrival))
            t.tokens, t.last = tokens, now
        if out.finished:
            m.e2e.observe(now - t.arrival)

    def _finish(self, rid: str) -> None:
        t = self.track[rid]
        if not t.finished:
            t.finished = True
            self.server.in_flight -= t.seqs

    def abort(self) -> None:
        """Abort every request not finished (the client went away, or the server stops)."""
        for rid, t in self.track.items():
            if not t.finished:
                self.server.driver.abort(rid)
                self._finish(rid)

    def usage(self) -> P.Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(t.tokens for t in self.track.values())
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _shutdown_error() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down and its --shutdown-timeout has passed; request aborted",
        None,
        "server_shutting_down",
        "server_error",
    )


def _as_api_error(item: BaseException) -> ApiError:
    if isinstance(item, UserError):
        msg = str(item)
        head = msg.split(":", 1)[0].strip()
        return ApiError(400, msg, head if head.isidentifier() else None)
    return ApiError(
        500, f"the engine failed on this request: {type(item).__name__}: {item}", None, None, "server_error"
    )


# -- the endpoints' bodies ------------------------------------------------------------------------
def _completion_logprobs(server: Server, c, start: int, top_n: int, offset: int) -> P.CompletionLogprobs:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lps in zip(c.token_ids[start:], c.logprobs[start:]):
        s = server.token_str(tid)
        tokens.append(s)
        token_lps.append(lps[tid])
        tops.append({server.token_str(t): lp for t, lp in _top(lps, top_n)})
        offsets.append(offset)
        offset += len(s)
    return P.CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)


def _chat_logprobs(server: Server, c, start: int, top_n: int) -> P.ChatLogprobs:
    def entry(tid, lp):
        s = server.token_str(tid)
        return dict(token=s, logprob=lp, bytes=list(s.encode()))

    return P.ChatLogprobs(
        content=[
            P.TokenLogprob(
                **entry(tid, lps[tid]), top_logprobs=[P.TopLogprob(**entry(t, lp)) for t, lp in _top(lps, top_n)]
            )
            for tid, lps in zip(c.token_ids[start:], c.logprobs[start:])
        ]
    )


def _safe_end(text: str, stops: list) -> int:
    """len(text) less its longest tail that is a proper prefix of a stop string."""
    for k in range(min(len(text), max(map(len, stops), default=1) - 1), 0, -1):
        if any(stop.startswith(text[-k:]) for stop in stops):
            return len(text) - k
    return len(text)


def _top(lps: dict, n: int) -> list:
    return sorted(lps.items(), key=lambda kv: -kv[1])[:n]


@dataclass
class _Shape:
    """What differs between the completions and the chat endpoints' bodies."""

    chat: bool
    n: int
    logprobs: int | None  # top-N asked for; None: no logprobs
    stops: list = field(default_factory=list)
    token_ids: bool = False  # return_token_ids

    def choice(self, server: Server, t: _Track, c, stream: bool):
        """The choice for output c of track t: its new text (stream) or all of it. A stream
        holds back a tail that may be the start of a stop string until it is known not to be."""
        chars, ntok = t.sent.get(c.index, (0, 0)) if stream else (0, 0)
        end = len(c.text) if c.finish_reason is not None else _safe_end(c.text, self.stops)
        t.sent[c.index] = (max(chars, end), len(c.token_ids))
        index = t.prompt_index * self.n + c.index
        text = c.text[chars:end]
        lp = None
        if self.logprobs is not None and c.logprobs is not None:
            lp = (
                _chat_logprobs(server, c, ntok, self.logprobs)
                if self.chat
                else _completion_logprobs(server, c, ntok, self.logprobs, chars)
            )
        common = dict(
            index=index,
            logprobs=lp,
            finish_reason=c.finish_reason,
            token_ids=list(c.token_ids[ntok:]) if self.token_ids else None,
        )
        if not self.chat:
            return P.CompletionChoice(text=text, **common)
        if stream:
            return P.ChatStreamChoice(delta=P.ChatResponseMessage(content=text), **common)
        return P.ChatChoice(message=P.ChatResponseMessage(role="assistant", content=text), **common)

    def body(self, rid: str, created: int, model: str, choices: list, usage=None, chunk: bool = False):
        if self.chat:
            return P.ChatCompletionResponse(
                id=rid,
                object="chat.completion.chunk" if chunk else "chat.completion",
                created=created,
                model=model,
                choices=choices,
                usage=usage,
            )
        return P.CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage)


async def _respond(
    server: Server, request: Request, req: P.SamplingRequest, prompts: list, fields: dict, shape: _Shape
):
    outs = await server.submit(prompts, fields)
    rid, created = f"{'chatcmpl' if shape.chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(server, outs, shape, rid, created, include_usage), media_type="text/event-stream"
        )
    return await _unless_disconnected(request, _collect(server, outs, shape, rid, created), outs)


async def _collect(server: Server, outs: _Outputs, shape: _Shape, rid: str, created: int):
    final = {}
    try:
        async for t, out in outs:
            if out.finished:
                final[t.prompt_index] = (t, out)
    except ApiError as e:
        outs.abort()
        return e.response()
    choices = [shape.choice(server, t, c, stream=False) for _, (t, out) in sorted(final.items()) for c in out.outputs]
    choices.sort(key=lambda ch: ch.index)
    return JSONResponse(shape.body(rid, created, server.model_name, choices, outs.usage()).model_dump())


async def _unless_disconnected(request: Request, work, outs: _Outputs, poll_s: float = 0.25):
    """Run `work`; if the client disconnects first, abort its engine requests."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                outs.abort()
                return Response(status_code=499)
    except BaseException:
        task.cancel()
        outs.abort()
        raise


async def _stream(server: Server, outs: _Outputs, shape: _Shape, rid: str, created: int, include_usage: bool):
    """Server-sent events: a chunk per engine output, then usage if asked for, then [DONE]."""

    def event(body) -> str:
        return f"data: {body.model_dump_json()}\n\n"

    try:
        if shape.chat:  # OpenAI's first chat chunk carries the role
            first = [
                P.ChatStreamChoice(index=i, delta=P.ChatResponseMessage(role="assistant", content=""))
                for i in range(len(outs.track) * shape.n)
            ]
            yield event(shape.body(rid, created, server.model_name, first, chunk=True))
        async for t, out in outs:
            choices = [
                shape.choice(server, t, c, stream=True)
                for c in out.outputs
                if c.finish_reason is not None or len(c.token_ids) > t.sent.get(c.index, (0, 0))[1]
            ]
            if choices:
                yield event(shape.body(rid, created, server.model_name, choices, chunk=True))
        if include_usage:
            yield event(shape.body(rid, created, server.model_name, [], outs.usage(), chunk=True))
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield f"data: {JSONResponse(P.error_body(e.message, e.type, e.param, e.code)).body.decode()}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        outs.abort()  # a no-op when every request finished; frees the KV blocks when the client left


def _embedding_inputs(server: Server, inputs: list) -> list[list[int]]:
    """Each input's token ids (text through the artifact's tokenizer), within the model's length
    and vocabulary: ApiError(400) naming the input otherwise."""
    from dsc.serve.client import encode

    out = []
    for i, p in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        try:
            ids = encode(server.engine, p)
        except UserError as e:
            raise ApiError(400, f"{where}: {str(e).split(': ', 1)[-1]}", "input") from None
        if len(ids) > server.engine.max_model_len:
            raise ApiError(
                400,
                f"{where}: {len(ids)} tokens; this model's maximum is {server.engine.max_model_len}",
                "input",
                "context_length_exceeded",
            )
        out.append(ids)
    return out


async def _collect_embeddings(server: Server, outs: _Outputs, encoding_format: str):
    import base64
    from array import array

    final = {}
    try:
        async for t, out in outs:
            if out.finished:
                final[t.prompt_index] = out.outputs.embedding
    except ApiError as e:
        outs.abort()
        return e.response()

    def encoded(v: list[float]):
        return v if encoding_format == "float" else base64.b64encode(array("f", v).tobytes()).decode()

    data = [P.Embedding(index=i, embedding=encoded(v)) for i, v in sorted(final.items())]
    tokens = sum(outs.prompt_tokens.values())
    body = P.EmbeddingResponse(
        data=data, model=server.model_name, usage=P.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )
    return JSONResponse(body.model_dump())


# -- the app ----------------------------------------------------------------------------------------
def create_app(
    driver: EngineDriver,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int = 1024,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    server = Server(driver, served_model_name, max_queue)
    app = FastAPI(title="dsc", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    _add_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_require_key(api_key))] if api_key else [])

    @v1.get("/models")
    async def models():
        card = P.ModelCard(
            id=server.model_name,
            created=server.created,
            max_model_len=server.engine.max_model_len,
            vocab_size=server.engine.vocab_size,
        )
        return P.ModelList(data=[card]).model_dump()

    def check_limits(req: P.SamplingRequest) -> None:
        try:
            req.check_limits(server.engine.vocab_size, server.engine.max_model_len)
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(":", 1)[0]) from None

    @v1.post("/completions")
    async def completions(req: P.CompletionRequest, request: Request):
        server.check_model(req.model)
        check_limits(req)
        fields = dict(req.sampling_fields(), max_tokens=req.max_tokens or 16, logprobs=req.logprobs)
        shape = _Shape(False, req.n, req.logprobs, fields["stop"] or [], req.return_token_ids)
        return await _respond(server, request, req, req.prompts(), fields, shape)

    @v1.post("/chat/completions")
    async def chat(req: P.ChatCompletionRequest, request: Request):
        server.check_model(req.model)
        check_limits(req)
        server.check_queue(req.n)  # before the render: a full server refuses at once
        try:  # in a worker thread: the render waits on the template's sandboxed process, not the loop
            prompt = await asyncio.to_thread(
                server.engine.apply_chat_template,
                [m.as_template_input() for m in req.messages],
                **req.template_inputs(),
            )
        except UserError as e:
            head = str(e).split(":", 1)[0]
            raise ApiError(
                400, str(e), head if head in ("tools", "documents", "chat_template_kwargs") else "messages"
            ) from None
        top = (req.top_logprobs or 0) if req.logprobs else None
        # no max_tokens: as many as the context leaves (OpenAI's chat default; the engine's None)
        fields = dict(req.sampling_fields(), max_tokens=req.requested_max_tokens(), logprobs=top)
        shape = _Shape(True, req.n, top, fields["stop"] or [], req.return_token_ids)
        return await _respond(server, request, req, [prompt], fields, shape)

    @v1.post("/embeddings")
    async def embeddings(req: P.EmbeddingRequest, request: Request):
        server.check_model(req.model, "encoder")
        if req.dimensions is not None:
            raise ApiError(
                400,
                f"dimensions: {server.model_name!r} returns {server.engine.hidden_size} dimensions "
                "and does not support shortened embeddings",
                "dimensions",
            )
        inputs = req.inputs()
        server.check_queue(len(inputs))  # before tokenizing: a full server refuses at once
        prompts = await asyncio.to_thread(_embedding_inputs, server, inputs)
        fields = {} if req.normalize is None else {"normalize": req.normalize}
        outs = await server.submit(prompts, fields)
        return await _unless_disconnected(request, _collect_embeddings(server, outs, req.encoding_format), outs)

    @app.get("/health")
    async def health():
        if not driver.alive():
            return JSONResponse({"status": "engine stopped"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(v1)
    return _Guard(app, server.metrics, max_body_bytes)


def _require_key(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None, "invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        param, message = _describe(e.errors())
        return ApiError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", None, code).response()

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception):
        return ApiError(500, f"internal error: {type(e).__name__}", None, None, "server_error").response()


def _describe(errors) -> tuple[str | None, str]:
    """pydantic's first error as (the field, one line naming it)."""
    err = errors[0] if errors else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    msg = str(err.get("msg", "invalid request body")).removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        return None, f"malformed JSON: {msg}"
    if not loc:  # a whole-body rule; its message starts with the field it names
        head = msg.split(":", 1)[0]
        return (head, msg) if head.isidentifier() else (None, msg)
    param = loc[0]
    if err.get("type") == "extra_forbidden":
        return loc[-1], f"{'.'.join(loc)}: unknown field"
    if err.get("type") == "missing":
        return param, f"{'.'.join(loc)}: required"
    return param, f"{param}: {msg} (got {_short(err.get('input'))})"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Guard:
    """ASGI wrapper: counts every HTTP response by endpoint and status (the metrics' requests),
    and answers 413 to a body over the limit: at once when its Content-Length says so, else
    (a chunked body) as soon as what has arrived passes it; such a body is read here in full
    before the app sees it."""

    def __init__(self, app: FastAPI, metrics: Metrics, max_body_bytes: int):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"

        async def counted_send(msg):
            if msg["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(msg["status"])).inc()
            await send(msg)

        too_large = ApiError(413, f"request body: over {self.max_body_bytes} bytes", None, "body_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_body_bytes:
                return await too_large.response()(scope, receive, counted_send)
            return await self.app(scope, receive, counted_send)
        body = await _read_body(receive, self.max_body_bytes)
        if body is None:
            return await too_large.response()(scope, receive, counted_send)
        await self.app(scope, _replay(body, receive), counted_send)


async def _read_body(receive, limit: int):
    """The whole body (b"" when the client left first), or None once it passes `limit` bytes."""
    chunks, seen = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b""
        chunk = msg.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """receive() that gives `body` once, then what the connection says (a disconnect)."""
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped
