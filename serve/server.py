"""`dsc serve`: the API process (uvicorn, the app, tokenization and detokenization) over an
engine in its own process (serve/client.py, serve/engine_process.py).

SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish for up to
`shutdown_timeout` seconds; past it the app ends the ones still open itself (a 503 error; a
stream's error event, then `data: [DONE]`) and aborts them in the engine, so uvicorn has no
handler left to cancel. Then the engine shuts down and the process exits 0. The engine process
runs in a session of its own, so a terminal's Ctrl-C reaches the API process only. When the
engine process dies while serving, the requests in flight fail (500), new ones get 503, and the
server shuts down and exits 1.

HTTP/1.1 is uvicorn's h11 protocol with one change: a request h11 cannot parse (a malformed
request line or header, `Content-Length: abc`) gets the OpenAI JSON error shape, not plain text.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsc.errors import UserError
from dsc.serve.app import create_app
from dsc.serve.driver import EngineDriver
from dsc.serve.protocol import error_body

KEEP_ALIVE_S = 65
# uvicorn's own graceful-shutdown timeout is this much longer than --shutdown-timeout: the app
# ends its requests first, so uvicorn never cancels a handler mid-response
_SHUTDOWN_GRACE_S = 2.0


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, whose answer to a request it cannot parse is a JSON error body."""

    def send_400_response(self, msg: str) -> None:
        import json

        import h11

        body = json.dumps(error_body(f"malformed HTTP request: {msg}", code="bad_http_request")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: close, as uvicorn would
            pass
        self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown starts (Server.begin_shutdown)."""

    def __init__(self, config: uvicorn.Config, app_server, shutdown_timeout: float):
        super().__init__(config)
        self.app_server, self.shutdown_timeout = app_server, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        self.app_server.begin_shutdown(self.shutdown_timeout)
        await super().shutdown(sockets)


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 1024
    shutdown_timeout: float = 30.0


def serve_artifact(artifact, opts: ServeOptions, echo: Callable[[str], None], **engine_kwargs) -> None:
    """`dsc serve`: start the engine process (its ranks, for a tp > 1 artifact) and serve HTTP
    here until SIGTERM. Under a launcher that started the ranks (WORLD_SIZE set), each rank
    loads its engine in-process instead: rank 0 serves, the other ranks step with it."""
    if "WORLD_SIZE" in os.environ:
        serve_in_process(artifact, opts, echo, **engine_kwargs)
        return
    from dsc.serve.client import EngineClient

    sock = listen(opts.host, opts.port)  # a taken port fails before the model loads
    client = EngineClient.launch(artifact, engine_kwargs)
    try:
        server = build_server(client, opts, sock)
        client.on_death = lambda: setattr(server, "should_exit", True)
        announce(server, opts, echo)
        world = f", {client.engine.world} ranks" if client.engine.world > 1 else ""
        stages = ", ".join(f"{k} {v:.1f}" for k, v in client.engine.load_times.items() if k != "total")
        echo(
            f"engine process {client.engine.pid}: loaded in {client.engine.load_s:.1f} s{world}"
            + (f" ({stages})" if stages else "")
        )
        if client.engine.offload:
            from dsc.runtime.offload import offload_line

            echo(f"engine process {client.engine.pid}: " + offload_line(client.engine.offload))
        run(server)
    finally:
        client.close()
    if client.failure:
        print(f"error: {client.failure}", file=sys.stderr, flush=True)
        sys.exit(1)


def serve_in_process(artifact, opts: ServeOptions, echo: Callable[[str], None], **engine_kwargs) -> None:
    """One rank of the artifact's LLMEngine in this process, driven by a thread; rank 0 serves
    HTTP until SIGTERM, the other ranks step with it until released."""
    from dsc.runtime.llm import LLMEngine, SamplingParams

    rank = int(os.environ.get("RANK", "0"))
    sock = listen(opts.host, opts.port) if rank == 0 else None
    engine = LLMEngine(artifact, **engine_kwargs)
    if rank != 0:
        for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop (after draining)
            signal.signal(sig, signal.SIG_IGN)
        engine.follow()
    else:
        server = build(engine, opts, SamplingParams, sock)
        announce(server, opts, echo)
        run(server)  # ends with engine.shutdown(), which releases the other ranks
    if engine.engine.world > 1:
        sys.stdout.flush()
        from dsc.runtime.distributed import shutdown_process_group

        shutdown_process_group()


def build(engine, opts: ServeOptions, sampling_params_cls, sock: socket.socket | None = None) -> uvicorn.Server:
    """A uvicorn server over `engine`, in this process: build_server over an EngineDriver."""
    return build_server(EngineDriver(engine, sampling_params_cls), opts, sock)


def build_server(driver, opts: ServeOptions, sock: socket.socket | None = None) -> uvicorn.Server:
    """A uvicorn server over `driver` (an EngineDriver, or the EngineClient of an engine
    process) on `sock` (default: listen(opts.host, opts.port)); the driver started; `.driver`
    is it, `.port` the port (the one port 0 picked)."""
    sock = sock or listen(opts.host, opts.port)
    app = create_app(driver, served_model_name=opts.served_model_name, api_key=opts.api_key, max_queue=opts.max_queue)
    # keep idle connections longer than clients do (httpx: 5 s, aiohttp: 15 s) and than load
    # balancers' idle timeouts (60 s): the side that closes first must be the client, or a request
    # sent on a connection the server is closing fails with a connection error
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=opts.shutdown_timeout + _SHUTDOWN_GRACE_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=JsonErrorH11Protocol,
    )
    server = _Server(config, app.state.server, opts.shutdown_timeout)
    server.driver, server.sock, server.port = driver, sock, sock.getsockname()[1]
    driver.start()
    return server


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a UserError naming the flag (before a model loads)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port: must be in [0, 65535], got {port}")
    try:
        family, type_, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        # proto from getaddrinfo (IPPROTO_TCP, not 0): asyncio sets TCP_NODELAY on the accepted
        # connections only when it sees it, and without it every response waits ~40 ms for an ACK
        sock = socket.socket(family, type_, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections queue from now on, before uvicorn starts accepting
    except OSError as e:
        raise UserError(f"--host/--port: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run(server: uvicorn.Server) -> None:
    """Serve until SIGTERM/SIGINT or server.should_exit; then stop the engine thread."""
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it caught once it has shut down, with the handlers it
        # found installed: these make that a normal return (exit 0) instead of death by signal
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[server.sock])
    finally:
        server.driver.stop()


def announce(server: uvicorn.Server, opts: ServeOptions, echo: Callable[[str], None]) -> None:
    """The start-up lines: where it listens, and what the API key (or its absence) means."""
    name = opts.served_model_name or server.driver.engine.model_name
    echo(f"dsc serve: {name} on http://{_url_host(opts.host)}:{server.port}/v1")
    if opts.api_key:
        echo("requests need 'Authorization: Bearer <key>' (--api-key / DSC_API_KEY)")
    elif _is_loopback(opts.host):
        echo(f"no --api-key: listening on {opts.host} only (pass --host to listen elsewhere)")
    else:
        echo(f"warning: no --api-key, and listening on {opts.host}: anyone who can reach it can use it")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
