"""`dsc serve`: an engine, its driver thread and the app, under uvicorn.

SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish for up to
`shutdown_timeout` seconds (uvicorn's graceful shutdown; past it their handlers are cancelled,
which aborts them in the engine), shuts the engine down and exits 0.
"""
from __future__ import annotations

import ipaddress
import signal
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import uvicorn

from dsc.serve.app import create_app
from dsc.serve.driver import EngineDriver


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    max_queue: int = 1024
    shutdown_timeout: float = 30.0


def build(engine, opts: ServeOptions, sampling_params_cls=None) -> uvicorn.Server:
    """A uvicorn server over `engine`, its driver thread started; `.driver` is the driver."""
    driver = EngineDriver(engine, sampling_params_cls)
    app = create_app(driver, served_model_name=opts.served_model_name, api_key=opts.api_key,
                     max_queue=opts.max_queue)
    config = uvicorn.Config(app, host=opts.host, port=opts.port, lifespan="off", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=opts.shutdown_timeout)
    server = uvicorn.Server(config)
    server.driver = driver
    driver.start()
    return server


def run(server: uvicorn.Server) -> None:
    """Serve until SIGTERM/SIGINT or server.should_exit; then stop the engine thread."""
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it caught once it has shut down, with the handlers it
        # found installed: these make that a normal return (exit 0) instead of death by signal
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        server.driver.stop()


def announce(opts: ServeOptions, model_name: str, echo: Callable[[str], None]) -> None:
    """The start-up lines: where it listens, and what the API key (or its absence) means."""
    echo(f"dsc serve: {opts.served_model_name or model_name} on http://{_url_host(opts.host)}:{opts.port}/v1")
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
