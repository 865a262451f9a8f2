"""One thread drives the engine; the asyncio side talks to it through an inbox.

The engine is not thread-safe, so every call into it (add, abort, step, stats) happens on the
engine thread. A request's outputs go to its sink, a callable the engine thread calls with
ACCEPTED once add_request took it, then each RequestOutput, or an exception (a UserError from
add_request, or the error of a failed step). The asyncio side makes the sink with
`loop.call_soon_threadsafe` into a per-request asyncio.Queue (see app.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from dsc.errors import UserError

log = logging.getLogger("dsc.serve")

ACCEPTED = "accepted"  # the first item a sink gets when its request was added

Sink = Callable[[Any], None]


class EngineDriver:
    """Runs `engine.step()` on a dedicated thread while there is work; sleeps on the inbox
    when there is none. `sampling_params_cls` builds the engine's SamplingParams from the
    endpoint's keywords (dsc.runtime.llm.SamplingParams for the real engine). `stats` is the engine's stats() after
    the latest step or inbox batch,
    read by the asyncio side without touching the engine."""

    def __init__(self, engine, sampling_params_cls):
        self.engine = engine
        self.sampling_params_cls = sampling_params_cls
        self.stats: dict = engine.stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._thread = threading.Thread(target=self._run, name="dsc-engine", daemon=True)
        self._stopped = threading.Event()

    # -- called from any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, request_id: str, prompt, params_fields: dict, sink: Sink) -> None:
        self._inbox.put(("add", request_id, prompt, params_fields, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, shut the engine down, end the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            try:
                msgs = [self._inbox.get(block=not busy)]
            except queue.Empty:
                msgs = []
            while True:
                try:
                    msgs.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for msg in msgs:
                if msg[0] == "stop":
                    self._shutdown()
                    return
                self._handle(msg)
            if self.engine.has_unfinished_requests():
                self._step()
            self.stats = self.engine.stats()

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "abort":
            if self._sinks.pop(msg[1], None) is not None:
                self.engine.abort_request(msg[1])
            return
        _, rid, prompt, fields, sink = msg
        try:
            self.engine.add_request(rid, prompt, self.sampling_params_cls(**fields))
        except UserError as e:
            self._deliver(sink, e)
            return
        except Exception as e:  # a bug in one request's path: that request fails, the server stays
            log.exception("add_request %s failed", rid)
            self._deliver(sink, e)
            return
        if self._deliver(sink, ACCEPTED):
            self._sinks[rid] = sink
        else:
            self.engine.abort_request(rid)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # the requests in flight fail (500); the server keeps serving
            log.exception("engine step failed; aborting %d requests", len(self._sinks))
            for rid, sink in list(self._sinks.items()):
                self._abort_quietly(rid)
                self._deliver(sink, e)
            self._sinks.clear()
            return
        self.stats = self.engine.stats()  # before the outputs: what a client saw, /metrics has seen
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            if not self._deliver(sink, out) and not out.finished:
                del self._sinks[out.request_id]
                self.engine.abort_request(out.request_id)

    @staticmethod
    def _deliver(sink: Sink, item) -> bool:
        """sink(item); False when the sink raised, i.e. its event loop has closed (the server
        stopped past its shutdown timeout): nobody is left to read that request's outputs."""
        try:
            sink(item)
            return True
        except RuntimeError:
            log.debug("a request's reader has gone; dropping its output", exc_info=True)
            return False

    def _abort_quietly(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:
            log.exception("abort_request %s failed after a failed step", rid)

    def _shutdown(self) -> None:
        for rid, sink in list(self._sinks.items()):
            self._abort_quietly(rid)
            self._deliver(sink, RuntimeError("the server is shutting down"))
        self._sinks.clear()
        self.stats = self.engine.stats()
        self.engine.shutdown()
