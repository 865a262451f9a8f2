"""The engine process of `dsc serve`: it loads the LLMEngine, schedules and steps it, and talks
to the API process (serve/client.py) over two ZeroMQ sockets, one msgpack array per message.

    python -m dsc.serve.engine_process CONFIG_JSON                       tp 1
    torchrun --nproc-per-node N -m dsc.serve.engine_process CONFIG_JSON  tp N: rank 0 talks to
                                                                         the API, the others follow it

    API -> engine   ["add", rid, prompt_ids, fields]   fields: SamplingParams keywords
                    ["abort", rid]                     the client went away
                    ["finish", rid, index]             a stop string ended choice `index`
                    ["stop"]                           abort what is left, shut down, exit 0
    engine -> API   ["ready", facts] | ["error", message]            once, after the load
                    ["step", accepted, errors, outputs, stats]       per turn of the loop
                    (an encoder's engine, runtime/embed.py: outputs [[rid, true, {"embedding":
                    float32 bytes, little-endian}], ...], each request ending in the step that ran it)
                    ["bye", stats]                                   the answer to "stop"

    accepted: [rid, ...]; errors: [[rid, is_user_error, message], ...] (refused by add_request,
    or failed with a step); outputs: [[rid, finished, [[index, new_token_ids, new_logprobs | None,
    finish_reason, stop_reason], ...]], ...], the tokens each choice gained since the last frame.

A turn takes every message waiting, runs one step when there is work and sends one frame, so a
step's outputs for every request cross in one message. The engine does not detokenize: text and
stop strings are the API process's. The messages are plain values (msgpack), never pickles: a
request's fields come from a client.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import msgpack
import zmq

from dsc.errors import UserError

log = logging.getLogger("dsc.serve.engine")

IDLE_POLL_MS = 1000  # how often an idle engine checks that the API process is still there


def pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(frame: bytes):
    # logprobs maps are keyed by token id (int); everything else is str-keyed
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


class EngineLoop:
    """Serves `engine` (LLMEngine's request interface) to the messages on `inbox`, answering on
    `outbox`, until "stop" or until `api_alive()` says the API process has gone."""

    def __init__(self, engine, sampling_params_cls, inbox: zmq.Socket, outbox: zmq.Socket, api_alive=lambda: True):
        self.engine, self.sampling_params_cls = engine, sampling_params_cls
        self.inbox, self.outbox, self.api_alive = inbox, outbox, api_alive
        self.sent: dict[str, list] = {}  # live request -> per choice: tokens sent so far, None once ended
        self._checked = time.monotonic()

    def run(self) -> None:
        while True:
            msgs = self._receive(block=not self.engine.has_unfinished_requests())
            if msgs is None:
                log.warning("the API process has gone; the engine shuts down")
                self._abort_all()
                return
            accepted, errors, outputs = [], [], []
            for msg in msgs:
                if msg[0] == "stop":
                    self._abort_all()
                    self.outbox.send(pack(["bye", self.engine.stats()]))
                    return
                self._handle(msg, accepted, errors)
            if self.engine.has_unfinished_requests():
                self._step(errors, outputs)
            self.outbox.send(pack(["step", accepted, errors, outputs, self.engine.stats()]))

    # -- messages ---------------------------------------------------------------------------------
    def _receive(self, block: bool) -> list | None:
        """Every message waiting (at least one when `block`); None once the API process has gone."""
        msgs = []
        while block and not self.inbox.poll(IDLE_POLL_MS):
            if not self.api_alive():
                return None
        now = time.monotonic()
        if now - self._checked > IDLE_POLL_MS / 1000:  # a busy engine checks too, once a second
            self._checked = now
            if not self.api_alive():
                return None
        while True:
            try:
                msgs.append(unpack(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return msgs

    def _handle(self, msg: list, accepted: list, errors: list) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "abort":
            if self.sent.pop(rid, None) is not None:
                self.engine.abort_request(rid)
        elif kind == "finish":
            if rid in self.sent and self.engine.finish_sequence(rid, msg[2]):
                del self.sent[rid]
        elif kind == "add":
            self._add(rid, msg[2], msg[3], accepted, errors)
        else:
            log.error("unknown message %r from the API process", kind)

    def _add(self, rid: str, prompt_ids: list, fields: dict, accepted: list, errors: list) -> None:
        try:
            params = self.sampling_params_cls(**fields)
            self.engine.add_request(rid, prompt_ids, params)
        except UserError as e:
            errors.append([rid, True, str(e)])
            return
        except Exception as e:  # a bug in one request's path: that request fails, the engine stays
            log.exception("add_request %s failed", rid)
            errors.append([rid, False, f"{type(e).__name__}: {e}"])
            return
        self.sent[rid] = [0] * params.n
        accepted.append(rid)

    # -- steps ------------------------------------------------------------------------------------
    def _step(self, errors: list, outputs: list) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # the requests in flight fail (500); the engine keeps serving
            log.exception("engine step failed; failing %d requests", len(self.sent))
            for rid in list(self.sent):
                self._abort_quietly(rid)
                errors.append([rid, False, f"{type(e).__name__}: {e}"])
            self.sent.clear()
            return
        for out in outs:
            sent = self.sent.get(out.request_id)
            if sent is None:
                continue
            if hasattr(out.outputs, "embedding"):  # an embedding: finished in the step that ran it
                from array import array

                del self.sent[out.request_id]
                outputs.append([out.request_id, True, {"embedding": array("f", out.outputs.embedding).tobytes()}])
                continue
            choices = []
            for c in out.outputs:
                k = sent[c.index]
                if k is None:  # its end was sent
                    continue
                if len(c.token_ids) > k or c.finish_reason is not None:
                    new_lps = c.logprobs[k:] if c.logprobs is not None else None
                    choices.append([c.index, c.token_ids[k:], new_lps, c.finish_reason, c.stop_reason])
                sent[c.index] = len(c.token_ids) if c.finish_reason is None else None
            if out.finished:
                del self.sent[out.request_id]
            outputs.append([out.request_id, out.finished, choices])

    def _abort_quietly(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:
            log.exception("abort_request %s failed", rid)

    def _abort_all(self) -> None:
        for rid in list(self.sent):
            self._abort_quietly(rid)
        self.sent.clear()


def _process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _leave_a_core_to_the_api() -> None:
    """torch's intra-op threads take every core by default, and OpenMP's threads spin between
    ops: beside the API process (HTTP, tokenizing, detokenizing) that starves both on the CPU.
    Unless OMP_NUM_THREADS says otherwise, the engine leaves one core to the API process."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))


def main(argv: list[str]) -> int:
    """One rank of the engine. The config (JSON, from the API process) names the artifact, the
    LLMEngine keywords, the two socket addresses and the API process's pid."""
    logging.basicConfig(level=logging.INFO, format="dsc engine: %(message)s")
    cfg = json.loads(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    ctx = zmq.Context()
    outbox = inbox = None
    if rank == 0:
        outbox = ctx.socket(zmq.PUSH)
        outbox.setsockopt(zmq.LINGER, 2000)  # the last frame ("bye", "error") reaches the API
        outbox.connect(cfg["outputs"])
    from dsc.runtime.llm import LLMEngine, SamplingParams, artifact_kind

    _leave_a_core_to_the_api()
    t0 = time.perf_counter()
    try:
        if artifact_kind(cfg["artifact"]) == "encoder":
            from dsc.runtime.embed import EmbeddingEngine, EmbeddingParams

            engine, params_cls = EmbeddingEngine(cfg["artifact"], **cfg["engine"]), EmbeddingParams
        else:
            engine, params_cls = LLMEngine(cfg["artifact"], detokenize=False, **cfg["engine"]), SamplingParams
    except UserError as e:
        if outbox is not None:
            outbox.send(pack(["error", str(e)]))
        else:
            print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr, flush=True)
        ctx.destroy(linger=2000)
        return 2
    world = engine.engine.world
    if rank != 0:
        engine.follow()
    else:
        inbox = ctx.socket(zmq.PULL)
        inbox.connect(cfg["requests"])
        encoder = getattr(engine, "kind", "decoder") == "encoder"
        facts = dict(
            model_name=engine.model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            eos_token_ids=engine.eos_token_ids,
            world=world,
            block_size=0 if encoder else engine.scheduler.block_size,
            kind="encoder" if encoder else "decoder",
            hidden_size=engine.hidden_size if encoder else None,
            pid=os.getpid(),
            load_s=round(time.perf_counter() - t0, 3),
            stats=engine.stats(),
            load_times={k: round(v, 2) for k, v in getattr(engine, "load_times", {}).items()},
            offload=engine.engine.offload,
        )
        outbox.send(pack(["ready", facts]))
        api_pid = cfg["api_pid"]
        try:
            EngineLoop(engine, params_cls, inbox, outbox, lambda: _process_alive(api_pid)).run()
        finally:
            engine.shutdown()  # releases the other ranks
    if world > 1:
        from dsc.runtime.distributed import shutdown_process_group

        shutdown_process_group()
    ctx.destroy(linger=2000)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
