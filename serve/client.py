"""The API process's side of the engine process: the driver app.py uses (add, abort, stats,
alive, stop, .engine), over ZeroMQ instead of a thread.

    client = EngineClient.launch("build/x", dict(device="cuda", max_num_seqs=256))
    client.start()                          # the receiver thread
    client.add(rid, prompt, fields, sink)   # from the event loop, as EngineDriver.add

The API process tokenizes prompts with the artifact's tokenizer (its weights stay in the engine
process) and detokenizes each choice incrementally (runtime/detokenize.py). A stop string it
finds ends the choice there ("stop") and tells the engine to end the sequence ("finish", or
"abort" once no choice of the request is left), which frees its KV blocks. A sink sees what it
sees under EngineDriver: ACCEPTED, then RequestOutputs with the text so far, or an exception (a
UserError from add_request, an EngineError for a failed step or a dead engine).

The receiver thread reads the engine's frames (serve/engine_process.py has the messages) and
watches the engine: when its process exits, or its socket disconnects, while the server is not
stopping, every request in flight fails at once, alive() turns False and `on_death` is called.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import zmq

from dsc.errors import UserError
from dsc.runtime.detokenize import Detokenizer
from dsc.serve.driver import ACCEPTED, EngineDriver, Sink
from dsc.serve.engine_process import pack, unpack

log = logging.getLogger("dsc.serve")

POLL_MS = 100  # how often the receiver thread looks at the engine process when no frame comes
STOP_TIMEOUT_S = 60.0  # how long stop() waits for the engine to shut down before killing it


class EngineError(RuntimeError):
    """The engine failed a request (a failed step), or the engine process has gone."""


class EngineFacts:
    """What the app reads of its engine (`driver.engine`), in the API process: the artifact's
    tokenizer and chat template, read from its files, and the limits the engine reported."""

    def __init__(self, artifact, tokenizer, ready: dict):
        self.artifact = artifact
        self.tokenizer = tokenizer
        self.model_name = ready["model_name"]
        self.max_model_len = ready["max_model_len"]
        self.vocab_size = ready["vocab_size"]
        self.eos_token_ids = list(ready["eos_token_ids"])
        self.block_size = ready["block_size"]
        self.kind = ready.get("kind", "decoder")  # "encoder": embeddings (runtime/embed.py)
        self.hidden_size = ready.get("hidden_size")
        self.world = ready["world"]  # tensor-parallel ranks
        self.pid = ready["pid"]  # rank 0's engine process
        self.load_s = ready.get("load_s")
        self.load_times = ready.get("load_times") or {}  # seconds by stage (runtime/engine.py)
        self.offload = ready.get("offload")  # where the weights live, with --offload (runtime/offload.py)
        from dsc.runtime.llm import LLMEngine

        # LLMEngine's template code reads only the artifact's tokenizer files and the model's name
        shim = SimpleNamespace(engine=SimpleNamespace(artifact=artifact), model_name=self.model_name)
        shim._tokenizer_json = lambda name: LLMEngine._tokenizer_json(shim, name)
        shim.chat_templates = self.chat_templates = LLMEngine._chat_templates(shim)  # probed at load
        self._template_shim = shim

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        from dsc.runtime.llm import LLMEngine

        return LLMEngine.apply_chat_template(self._template_shim, messages, **kwargs)


def encode(engine, prompt) -> list[int]:
    """A prompt's token ids: text through `engine.tokenizer`, ids checked against the vocabulary
    (the engine checks them again; here they must fit a msgpack integer)."""
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise UserError("prompt: the artifact has no tokenizer; give token ids")
        return engine.tokenizer.encode(prompt).ids
    ids = list(prompt)
    bad = [t for t in ids if not 0 <= t < engine.vocab_size]
    if bad:
        raise UserError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{engine.vocab_size - 1})")
    return ids


@dataclass
class _Choice:
    index: int
    detok: Detokenizer | None
    token_ids: list = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass
class _Request:
    sink: Sink
    prompt: str | None
    prompt_ids: list
    fields: dict
    choices: list | None = None  # made when the engine accepts the request


class EngineClient:
    """The driver over an engine in another process (or any peer speaking engine_process's
    messages on the two sockets). `proc` is the process to watch (None: the sockets only)."""

    def __init__(
        self,
        ctx: zmq.Context,
        requests: zmq.Socket,
        outputs: zmq.Socket,
        engine,
        stats: dict,
        proc: subprocess.Popen | None = None,
        workdir: str | None = None,
    ):
        self.engine = engine
        self.stats: dict = stats
        self.on_death: Callable[[], None] = lambda: None
        self.failure: str | None = None  # why the engine is gone, when it went while serving
        self._ctx, self._requests, self._outputs = ctx, requests, outputs
        self._monitor = outputs.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._proc, self._workdir = proc, workdir
        self._reqs: dict[str, _Request] = {}
        self._lock = threading.Lock()  # _reqs against a dying engine; the requests socket's sends
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dsc-engine-client", daemon=True)
        from dsc.runtime import llm

        self._llm = llm  # SamplingParams' defaults, the RequestOutput the app reads

    # -- starting the engine process --------------------------------------------------------------
    @classmethod
    def launch(cls, artifact, engine_kwargs: dict, env: dict | None = None) -> EngineClient:
        """Start the engine process (its ranks under torchrun for a tp > 1 artifact; `env` added
        to its environment), wait for it to load, and return the client. A load that fails
        raises the engine's UserError."""
        from dsc.runtime.artifact import open_artifact
        from dsc.runtime.pipeline import check_stages

        art = open_artifact(artifact, ranks=[], verify=engine_kwargs.get("verify", True))
        pp = engine_kwargs.get("pipeline_parallel_size", 1)
        check_stages(art.plan, pp, str(artifact))
        tokenizer = art.tokenizer()  # a broken tokenizer fails here, before the weights load
        workdir = tempfile.mkdtemp(prefix="dsc-serve-")
        ctx, requests, outputs, addresses = bind_sockets(workdir)
        cfg = dict(artifact=os.path.abspath(artifact), engine=engine_kwargs, api_pid=os.getpid(), **addresses)
        ranks = art.tp * pp
        proc = subprocess.Popen(
            _engine_command(ranks, json.dumps(cfg)),
            env={**_engine_env(ranks), **(env or {})},
            stdout=2,
            start_new_session=True,
        )  # stdout is the API's
        try:
            import dsc.runtime.llm  # noqa: F401  (torch: imported here while the engine process loads)

            ready = _wait_ready(outputs, proc)
            client = cls(ctx, requests, outputs, EngineFacts(art, tokenizer, ready), ready["stats"], proc, workdir)
        except BaseException:
            _kill(proc)
            ctx.destroy(linger=0)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return client

    # -- the driver interface (any thread) --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self.failure is None and not self._stopping

    def add(self, request_id: str, prompt, params_fields: dict, sink: Sink) -> None:
        try:
            ids = encode(self.engine, prompt)
            msg = _pack_add(request_id, ids, params_fields)
        except UserError as e:
            _deliver(sink, e)
            return
        req = _Request(sink, prompt if isinstance(prompt, str) else None, ids, params_fields)
        with self._lock:
            if self.failure is None:
                self._reqs[request_id] = req
                if self._send(msg):
                    return
                del self._reqs[request_id]
        _deliver(sink, EngineError(self.failure or "the engine is not running"))

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._reqs.pop(request_id, None) is not None:
                self._send(["abort", request_id])

    def stop(self, timeout: float | None = None) -> None:
        """Fail what is left, let the engine shut down (it aborts its requests and releases its
        ranks), end the thread; kill the engine when it does not exit in time."""
        if self._closed:
            return
        self._stopping = True
        with self._lock:
            self._send(["stop"])
            left, self._reqs = self._reqs, {}
        for req in left.values():
            _deliver(req.sink, RuntimeError("the server is shutting down"))
        if self._proc is not None:
            try:
                self._proc.wait(STOP_TIMEOUT_S if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                log.error("the engine process did not exit in time; killing it")
        if self._thread.is_alive():
            self._thread.join(5)
        self.close()

    def close(self) -> None:
        """Kill the engine process (its whole group: torchrun and its ranks) if it still runs,
        and free the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._proc is not None:
            _kill(self._proc)
        self._monitor.close(linger=0)
        self._ctx.destroy(linger=0)
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def _send(self, msg: list | bytes) -> bool:
        """Send (holding self._lock); False when the engine has no socket open to take it."""
        try:
            self._requests.send(msg if isinstance(msg, bytes) else pack(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    # -- the receiver thread ----------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll(POLL_MS))
            if self._outputs in events and self._drain():
                return  # "bye"
            gone = self._proc is not None and self._proc.poll() is not None
            if self._monitor in events:
                gone = gone or _disconnected(self._monitor)
            if gone:
                self._drain()
                if not self._stopping:
                    self._die()
                return

    def _drain(self) -> bool:
        """Handle every frame waiting; True when one was the engine's goodbye."""
        while True:
            try:
                msg = unpack(self._outputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                return False
            if msg[0] == "bye":
                self.stats = msg[1]
                return True
            if msg[0] == "step":
                self._frame(*msg[1:])

    def _frame(self, accepted: list, errors: list, outputs: list, stats: dict) -> None:
        self.stats = stats  # before the outputs: what a client saw, /metrics has seen
        for rid in accepted:
            req = self._reqs.get(rid)
            if req is None:  # aborted before the engine took it; its abort follows the add
                continue
            if getattr(self.engine, "kind", "decoder") == "encoder":  # no choices: one embedding
                req.choices = []
                if not _deliver(req.sink, ACCEPTED):
                    self.abort(rid)
                continue
            p = self._llm.SamplingParams(**req.fields)
            stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
            req.choices = [
                _Choice(i, self._detokenizer(req.prompt_ids, p, stop), logprobs=[] if p.logprobs is not None else None)
                for i in range(p.n)
            ]
            if not _deliver(req.sink, ACCEPTED):
                self.abort(rid)
        for rid, user_error, message in errors:
            req = self._reqs.pop(rid, None)
            if req is not None:
                _deliver(req.sink, UserError(message) if user_error else EngineError(message))
        for rid, _finished, choices in outputs:
            req = self._reqs.get(rid)
            if req is None or req.choices is None:
                continue
            if isinstance(choices, dict):  # an embedding request's one output
                from array import array

                from dsc.runtime.embed import EmbeddingOutput, EmbeddingRequestOutput

                with self._lock:
                    self._reqs.pop(rid, None)
                vec = array("f")
                vec.frombytes(choices["embedding"])
                _deliver(
                    req.sink, EmbeddingRequestOutput(rid, req.prompt, req.prompt_ids, EmbeddingOutput(vec.tolist()))
                )
                continue
            self._output(rid, req, choices)

    def _detokenizer(self, prompt_ids: list, p, stop: list) -> Detokenizer | None:
        if self.engine.tokenizer is None:
            return None
        return Detokenizer(
            self.engine.tokenizer,
            prompt_ids,
            stop=stop,
            include_stop=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens,
        )

    def _output(self, rid: str, req: _Request, choices: list) -> None:
        stopped = []  # choices a stop string ended here, which the engine still runs
        for index, new_ids, new_lps, reason, stop_reason in choices:
            c = req.choices[index]
            if c.finish_reason is not None:
                continue
            for j, tok in enumerate(new_ids):
                c.token_ids.append(tok)
                if c.logprobs is not None:
                    c.logprobs.append(new_lps[j])
                if c.detok is not None:
                    c.detok.add([tok])
                    if c.detok.stopped:
                        c.finish_reason, c.stop_reason = "stop", c.detok.stop_reason
                        break
            if c.finish_reason is None and reason is not None:
                if c.detok is not None:
                    c.detok.flush()
                c.finish_reason, c.stop_reason = reason, stop_reason
            elif c.finish_reason is not None and reason is None:
                stopped.append(index)
        finished = all(c.finish_reason is not None for c in req.choices)
        if finished:
            with self._lock:
                self._reqs.pop(rid, None)
                if stopped:
                    self._send(["abort", rid])
        elif stopped:
            with self._lock:
                for index in stopped:
                    self._send(["finish", rid, index])
        out = self._llm.RequestOutput(
            rid,
            req.prompt,
            req.prompt_ids,
            [
                self._llm.CompletionOutput(
                    c.index,
                    c.detok.text if c.detok is not None else "",
                    list(c.token_ids),
                    list(c.logprobs) if c.logprobs is not None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
                for c in req.choices
            ],
            finished,
        )
        if not _deliver(req.sink, out) and not finished:
            self.abort(rid)

    def _die(self) -> None:
        rc = self._proc.poll() if self._proc is not None else None
        if self._proc is not None and rc is None:
            try:
                rc = self._proc.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        with self._lock:
            self.failure = f"the engine process has gone ({_exit_status(rc)})"
            left, self._reqs = self._reqs, {}
        log.error("%s; failing %d requests", self.failure, len(left))
        for req in left.values():
            _deliver(req.sink, EngineError(self.failure))
        self.on_death()


def _pack_add(rid: str, ids: list, fields: dict) -> bytes:
    """The "add" message; a field msgpack cannot carry (an integer past 64 bits, a lone
    surrogate) is a UserError naming it, as the engine's own checks would be."""
    try:
        return pack(["add", rid, ids, fields])
    except (OverflowError, TypeError, ValueError):
        for name, value in fields.items():
            try:
                pack(value)
            except (OverflowError, TypeError, ValueError):
                text = repr(value)
                text = text if len(text) <= 80 else text[:77] + "..."
                raise UserError(f"{name}: out of range or not valid text (got {text})") from None
        raise


def bind_sockets(workdir: str) -> tuple[zmq.Context, zmq.Socket, zmq.Socket, dict]:
    """The API process's two sockets, bound to ipc files in `workdir`, and their addresses
    ({"requests", "outputs"}) for the engine to connect to."""
    ctx = zmq.Context()
    requests, outputs = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    requests.setsockopt(zmq.SNDHWM, 0)  # never drop or block an add: the queue limit is the app's (429)
    requests.setsockopt(zmq.LINGER, 0)
    outputs.setsockopt(zmq.RCVHWM, 0)
    addresses = {"requests": f"ipc://{workdir}/requests", "outputs": f"ipc://{workdir}/outputs"}
    requests.bind(addresses["requests"])
    outputs.bind(addresses["outputs"])
    return ctx, requests, outputs, addresses


_deliver = EngineDriver._deliver  # sink(item); False when its event loop has closed


def _disconnected(monitor: zmq.Socket) -> bool:
    from zmq.utils.monitor import recv_monitor_message

    seen = False
    while monitor.poll(0):
        seen |= recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    return seen


def _engine_command(tp: int, cfg: str) -> list[str]:
    if tp == 1:
        return [sys.executable, "-m", "dsc.serve.engine_process", cfg]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={tp}",
        "-m",
        "dsc.serve.engine_process",
        cfg,
    ]


def _engine_env(tp: int) -> dict:
    """The environment of the engine process: this one's, with dsc importable from where this
    process imported it, and one OpenMP thread per rank under tp > 1 (as `dsc generate`)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    if tp > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _wait_ready(outputs: zmq.Socket, proc: subprocess.Popen) -> dict:
    """The engine's "ready" facts; its load error as a UserError; an error if it exits first."""
    while True:
        if outputs.poll(POLL_MS):
            msg = unpack(outputs.recv())
            if msg[0] == "ready":
                return msg[1]
            if msg[0] == "error":
                raise UserError(msg[1])
        rc = proc.poll()
        if rc is not None:
            raise UserError(f"the engine process exited while loading ({_exit_status(rc)}; its output is above)")


def _exit_status(rc: int | None) -> str:
    if rc is None:
        return "its socket closed"
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the engine's process group (start_new_session made it its own:
    torchrun and its ranks are in it) and reap the process."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        log.error("engine process %d did not exit after SIGKILL", proc.pid)
