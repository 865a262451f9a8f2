"""A fake of dsc.runtime.llm.LLMEngine's interface for the HTTP layer's tests: deterministic
tokens, a scheduler with max_num_seqs and a KV block pool, stop strings, n, seeds, logprobs,
and a planted failure. No model: what it tests is the server, not the numerics.

Tokens are characters (id = code point, vocab 128). Greedy token j of choice i of a prompt p is
the letter 97 + (sum(p) + 3 j + i) % 26; with a temperature, letters from a Random seeded by
the request's seed. A prompt holding BOOM makes the step that runs it raise.

    python tests/serve_fake.py PORT [STEP_DELAY_S [SHUTDOWN_TIMEOUT_S]]   # a server over it (signal tests)
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, field, replace

from dsc.errors import UserError

BLOCK = 16


@dataclass
class FakeSamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list | None = None
    stop_token_ids: list | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool = False


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: object = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list
    finished: bool


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True):
        return type("Encoding", (), {"ids": [ord(c) % 128 for c in text]})()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class _Seq:
    def __init__(self, rid, prompt, ids, params):
        self.rid, self.prompt, self.ids, self.params = rid, prompt, ids, params
        self.outs = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self.rng = random.Random(params.seed)

    def blocks(self) -> int:
        return sum(math.ceil((len(self.ids) + len(o.token_ids) + 1) / BLOCK) for o in self.outs)

    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outs)

    def output(self) -> RequestOutput:
        return RequestOutput(self.rid, self.prompt, self.ids, [_copy(o) for o in self.outs], self.finished())


def _copy(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        o.index,
        o.text,
        list(o.token_ids),
        None if o.logprobs is None else list(o.logprobs),
        o.finish_reason,
        o.stop_reason,
    )


class FakeEngine:
    def __init__(
        self,
        max_num_seqs: int = 256,
        kv_blocks: int = 512,
        max_model_len: int = 256,
        step_delay_s: float = 0.0,
        chat_template: bool | str = True,
        vocab_size: int = 128,
        detokenize: bool = True,
    ):
        """chat_template: True (a fixed format), False (none), or a jinja template's source, rendered
        by the runtime's sandboxed renderer (runtime/chat_template.py)."""
        self.tokenizer = CharTokenizer()
        self.model_name = "fake-model"
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.max_num_seqs, self.kv_blocks, self.step_delay_s = max_num_seqs, kv_blocks, step_delay_s
        self.chat_template = chat_template
        self.detokenize = detokenize  # False: stop strings are the caller's (LLMEngine's detokenize)
        self.chat_templates = None
        if isinstance(chat_template, str):
            from dsc.runtime.chat_template import ChatTemplates

            self.chat_templates = ChatTemplates(
                {"default": chat_template}, {"bos_token": "<s>"}, "fake/chat_template.jinja"
            )
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.is_shut_down = False
        self.finished_early: list = []  # finish_sequence's (request id, index)

    def apply_chat_template(
        self, messages: list, tools=None, documents=None, add_generation_prompt=True, chat_template_kwargs=None
    ) -> str:
        if self.chat_templates is not None:
            return self.chat_templates.render(
                messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                kwargs=chat_template_kwargs,
            )
        if not self.chat_template:
            raise UserError("chat: the artifact's tokenizer has no chat template")
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def add_request(self, request_id: str, prompt, params) -> None:
        ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise UserError("prompt: empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise UserError(f"prompt: a token id is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(ids) + 1 > self.max_model_len:
            raise UserError(f"prompt: {len(ids)} tokens; the artifact's max_seq is {self.max_model_len}")
        room = self.max_model_len - len(ids)
        params = replace(params, max_tokens=min(params.max_tokens or room, room))
        self.waiting.append(_Seq(request_id, prompt if isinstance(prompt, str) else None, ids, params))

    def abort_request(self, request_id: str) -> None:
        self.waiting = [s for s in self.waiting if s.rid != request_id]
        self.running = [s for s in self.running if s.rid != request_id]

    def finish_sequence(self, request_id: str, index: int, reason: str = "stop") -> bool:
        self.finished_early.append((request_id, index))
        for seq in self.waiting + self.running:
            if seq.rid == request_id:
                o = seq.outs[index]
                o.finish_reason = o.finish_reason or reason
                if not seq.finished():
                    return False
                self.abort_request(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _used(self) -> int:
        return sum(s.blocks() for s in self.running)

    def step(self) -> list:
        while (
            self.waiting
            and len(self.running) < self.max_num_seqs
            and self._used() + self.waiting[0].blocks() <= self.kv_blocks
        ):
            seq = self.waiting.pop(0)
            self.prompt_tokens_total += len(seq.ids)
            self.running.append(seq)
        if any("BOOM" in "".join(map(chr, s.ids)) for s in self.running):  # text or its ids (an engine process's)
            raise RuntimeError("planted failure")
        time.sleep(self.step_delay_s)
        outs = []
        for seq in self.running:
            for o in seq.outs:
                if o.finish_reason is None:
                    self._next_token(seq, o)
            outs.append(seq.output())
        self.running = [s for s in self.running if not s.finished()]
        return outs

    def _next_token(self, seq: _Seq, o: CompletionOutput) -> None:
        p = seq.params
        j = len(o.token_ids)
        if p.temperature:
            tok = 97 + seq.rng.randrange(26)
        else:
            tok = 97 + (sum(seq.ids) + 3 * j + o.index) % 26
        o.token_ids.append(tok)
        self.generation_tokens_total += 1
        if o.logprobs is not None:
            alts = [97 + (tok - 97 + k) % 26 for k in range(1, p.logprobs + 1)]
            o.logprobs.append({tok: -0.25, **{a: -1.0 - k for k, a in enumerate(alts)}})
        o.text += chr(tok)
        stops = [p.stop] if isinstance(p.stop, str) else (p.stop or [])
        for s in stops if self.detokenize else []:
            at = o.text.find(s)
            if at >= 0:
                o.text = o.text[: at + (len(s) if p.include_stop_str_in_output else 0)]
                o.finish_reason, o.stop_reason = "stop", s
                return
        if p.stop_token_ids and tok in p.stop_token_ids:
            o.finish_reason, o.stop_reason = "stop", tok
        elif len(o.token_ids) >= p.max_tokens:
            o.finish_reason = "length"

    def stats(self) -> dict:
        return dict(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=self.kv_blocks,
            kv_blocks_used=self._used(),
            prefix_cache_hit_tokens=0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    def shutdown(self) -> None:
        self.is_shut_down = True


def greedy_text(prompt: str, max_tokens: int, index: int = 0) -> str:
    """What the fake generates greedily for a text prompt (no stop)."""
    s = sum(ord(c) % 128 for c in prompt)
    return "".join(chr(97 + (s + 3 * j + index) % 26) for j in range(max_tokens))


if __name__ == "__main__":
    from dsc.serve.server import ServeOptions, build, run

    opts = ServeOptions(port=int(sys.argv[1]), shutdown_timeout=float(sys.argv[3]) if len(sys.argv) > 3 else 30)
    engine = FakeEngine(step_delay_s=float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
    server = build(engine, opts, FakeSamplingParams)
    print(f"port {server.port}", flush=True)
    run(server)
    print(f"engine shut down: {engine.is_shut_down}", flush=True)
