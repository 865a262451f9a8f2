"""The offline API (vLLM's shape) and the request engine `dsc serve` drives.

    llm = dsc.LLM("build/x")
    outs = llm.generate(["Hello", [1, 2, 3]], dsc.SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text, .token_ids, .logprobs, .finish_reason
    llm.chat([{"role": "user", "content": "Hi"}])          # the tokenizer's chat template

`LLMEngine` holds the requests: add_request / abort_request / step, each step one scheduler
step (runtime/scheduler.py) returning the requests that advanced, with their outputs so far.
Text is detokenized incrementally (runtime/detokenize.py), stop strings end a sequence there;
with `detokenize=False` (the engine process of `dsc serve`, whose API process detokenizes) the
outputs carry token ids only, and the caller ends a sequence its stop string ended with
`finish_sequence`.
Defaults a SamplingParams leaves unset come from the artifact's generation_config.json (as the
checkpoint shipped it), else OpenAI's: temperature 1, top_p 1, no top-k, 16 tokens.
"""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence as Seq

from dsc.errors import UserError
from dsc.runtime.scheduler import STOP, Scheduler, SeqParams, Sequence, broadcast_step, follow


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[Any]
    stops: list[str]
    stop_reasons: list[str | int | None] = field(default_factory=list)


class LLMEngine:
    def __init__(self, artifact: str | Path | None = None, *, device=None, kv_cache_memory: float | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 verify: bool = True, cuda_graphs: bool = True, require_signature: str | Path | None = None,
                 prefill_buckets: bool | None = None, engine=None, detokenize: bool = True):
        if engine is None:
            from dsc.runtime.engine import load

            if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
                raise UserError(f"--max-num-seqs: expected an integer >= 1, got {max_num_seqs!r}")
            engine = load(artifact, device=device, verify=verify, cuda_graphs=cuda_graphs,
                          require_signature=require_signature, static=False, kv_cache_memory=kv_cache_memory,
                          max_num_seqs=max_num_seqs, prefill_buckets=prefill_buckets)
        self.engine = engine
        self.scheduler = Scheduler(engine, max_num_batched_tokens, max_num_seqs, enable_prefix_caching)
        self.tokenizer = engine.artifact.tokenizer()
        self.model_name = Path(engine.artifact.path).name
        self.max_model_len = engine.max_seq
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = list(engine.eos_token_ids)
        self.generation_defaults = self._generation_config()
        self.detokenize = detokenize
        self._requests: dict[str, _Request] = {}

    # -- artifact facts ---------------------------------------------------------------------------
    def _tokenizer_json(self, name: str) -> dict:
        art = self.engine.artifact
        if f"tokenizer/{name}" not in art.manifest["files"]:
            return {}
        try:
            d = json.loads((Path(art.path) / "tokenizer" / name).read_text())
        except (OSError, ValueError):
            raise UserError(f"{Path(art.path) / 'tokenizer' / name}: not valid JSON") from None
        return d if isinstance(d, dict) else {}

    def _generation_config(self) -> dict:
        g = self._tokenizer_json("generation_config.json")
        out = {}
        for key, ok in (("temperature", _is_num), ("top_p", _is_num), ("top_k", _is_int)):
            if ok(g.get(key)):
                out[key] = g[key]
        if g.get("do_sample") is False:  # transformers' greedy default
            out["temperature"] = 0.0
        return out

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The tokenizer's chat template (tokenizer_config.json) over `messages`, with the
        assistant's turn opened. Rendered in jinja2's sandbox: the artifact is untrusted data."""
        cfg = self._tokenizer_json("tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if not isinstance(template, str):
            raise UserError(f"{self.model_name}: the artifact's tokenizer has no chat template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in messages):
            raise UserError("messages: expected a list of {\"role\": str, \"content\": str}")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception

        def token(name):
            t = cfg.get(name)
            return t.get("content") if isinstance(t, dict) else t if isinstance(t, str) else ""

        try:
            return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                    bos_token=token("bos_token"), eos_token=token("eos_token"))
        except TemplateError as e:
            raise UserError(f"chat template: {e}") from None

    # -- requests ---------------------------------------------------------------------------------
    def _resolve(self, p: SamplingParams) -> SamplingParams:
        if not isinstance(p, SamplingParams):
            raise UserError(f"sampling_params: expected dsc.SamplingParams, got {type(p).__name__}")
        d = self.generation_defaults
        temperature = p.temperature if p.temperature is not None else d.get("temperature", 1.0)
        top_p = p.top_p if p.top_p is not None else d.get("top_p", 1.0)
        top_k = p.top_k if p.top_k is not None else d.get("top_k", 0)
        if not _is_int(p.n) or not 1 <= p.n <= 128:
            raise UserError(f"n: expected an integer from 1 to 128, got {p.n!r}")
        if p.max_tokens is not None and (not _is_int(p.max_tokens) or p.max_tokens < 1):
            raise UserError(f"max_tokens: expected an integer >= 1, got {p.max_tokens!r}")
        if not _is_num(temperature) or temperature < 0:
            raise UserError(f"temperature: expected a number >= 0, got {temperature!r}")
        if not _is_num(top_p) or not 0 < top_p <= 1:
            raise UserError(f"top_p: expected a number in (0, 1], got {top_p!r}")
        if not _is_int(top_k) or top_k < -1:
            raise UserError(f"top_k: expected an integer >= 0 (0 or -1: off), got {top_k!r}")
        if p.seed is not None and (not _is_int(p.seed) or not 0 <= p.seed < 2**63):
            raise UserError(f"seed: expected an integer in [0, 2^63), got {p.seed!r}")
        stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise UserError("stop: expected a non-empty string or a list of them")
        ids = list(p.stop_token_ids or [])
        if not all(_is_int(t) and 0 <= t < self.vocab_size for t in ids):
            raise UserError(f"stop_token_ids: expected token ids in 0..{self.vocab_size - 1}")
        if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= 20):
            raise UserError(f"logprobs: expected an integer from 0 to 20, got {p.logprobs!r}")
        from dataclasses import replace

        return replace(p, temperature=float(temperature), top_p=float(top_p), top_k=max(int(top_k), 0), stop=stop,
                       stop_token_ids=ids)

    def encode(self, prompt: str | Seq[int], where: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError(f"{where}: the artifact has no tokenizer; give token ids")
            ids = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise UserError(f"{where}: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        else:
            raise UserError(f"{where}: expected text or a list of token ids")
        if not ids:
            raise UserError(f"{where}: empty")
        return ids

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None) -> None:
        if request_id in self._requests:
            raise UserError(f"request_id: {request_id!r} is already running")
        p = self._resolve(params or SamplingParams())
        ids = self.encode(prompt)
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(ids)
        self.scheduler.check_fits(len(ids), max(max_tokens, 1))
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        base_seed = p.seed if p.seed is not None else secrets.randbits(62)
        seqs, detoks = [], []
        for i in range(p.n):
            sp = SeqParams(max_tokens=max(max_tokens, 1), temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                           seed=(base_seed + i) % 2**63, stop_token_ids=stop_ids, logprobs=p.logprobs)
            seqs.append(Sequence(request_id, ids, sp, index=i))
            detoks.append(self._detokenizer(ids, p))
        req = _Request(request_id, prompt if isinstance(prompt, str) else None, ids, p, seqs, detoks, p.stop,
                       [None] * p.n)
        for s in seqs:
            self.scheduler.add(s)
        self._requests[request_id] = req

    def _detokenizer(self, ids: list[int], p: SamplingParams):
        if self.tokenizer is None or not self.detokenize:
            return None
        from dsc.runtime.detokenize import Detokenizer

        return Detokenizer(self.tokenizer, ids, stop=p.stop, include_stop=p.include_stop_str_in_output,
                           skip_special_tokens=p.skip_special_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its KV blocks; returns its final output (None if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for s in req.seqs:
            self.scheduler.finish(s, "abort")
        return self._output(req)

    def finish_sequence(self, request_id: str, index: int, reason: str = "stop") -> bool:
        """End one sequence of a request now (a stop string the caller found in its text) and free
        its KV blocks. True when that ended the request (its last sequence), or it was unknown."""
        req = self._requests.get(request_id)
        if req is None:
            return True
        if 0 <= index < len(req.seqs):
            self.scheduler.finish(req.seqs[index], reason)
        if all(s.finished for s in req.seqs):
            del self._requests[request_id]
            return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        advanced = self.scheduler.step()
        touched: dict[str, _Request] = {}
        for seq in advanced:
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            d = req.detoks[seq.index]
            if d is not None and seq.new_tokens:
                d.add(seq.output_ids[-seq.new_tokens:])
                if d.stopped and not seq.finished:
                    self.scheduler.finish(seq, "stop")
                    req.stop_reasons[seq.index] = d.stop_reason
                elif d.stopped:
                    seq.finish_reason = "stop"
                    req.stop_reasons[seq.index] = d.stop_reason
            if seq.finish_reason == "stop" and req.stop_reasons[seq.index] is None and seq.output_ids:
                req.stop_reasons[seq.index] = seq.output_ids[-1]
            touched[req.request_id] = req
        outs = []
        for rid, req in touched.items():
            out = self._output(req)
            if out.finished:
                del self._requests[rid]
            outs.append(out)
        return outs

    def _output(self, req: _Request) -> RequestOutput:
        comps = []
        for seq, d, reason in zip(req.seqs, req.detoks, req.stop_reasons):
            text = d.text if d is not None else ""
            comps.append(CompletionOutput(seq.index, text, list(seq.output_ids),
                                          list(seq.logprobs) if req.params.logprobs is not None else None,
                                          seq.finish_reason, reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, comps, all(s.finished for s in req.seqs))

    def stats(self) -> dict:
        return self.scheduler.stats()

    # -- tensor parallelism -----------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks > 0: run the steps rank 0 broadcasts until rank 0 calls `release_followers`."""
        follow(self.engine)

    def release_followers(self) -> None:
        """Rank 0: let the other ranks' `follow` return."""
        if self.engine.world > 1:
            broadcast_step(STOP)

    def shutdown(self) -> None:
        self.release_followers()


class LLM:
    """Offline generation over the continuous-batching engine."""

    def __init__(self, model: str | Path, **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self._ids = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _prompts(self, prompts) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and all(_is_int(t) for t in prompts)):
            return [prompts]
        if isinstance(prompts, dict):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise UserError("prompts: expected text, token ids, or a non-empty list of them")
        return [p["prompt_token_ids"] if isinstance(p, dict) and "prompt_token_ids" in p
                else p["prompt"] if isinstance(p, dict) and "prompt" in p else p for p in prompts]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 callback=None) -> list[RequestOutput]:
        """One output per prompt, in order. Under tensor parallelism every rank calls this; rank
        0 schedules and returns the outputs, the others run its steps and return []."""
        eng = self.engine
        if eng.engine.rank != 0:
            eng.follow()
            return []
        try:
            prompts = self._prompts(prompts)
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
            if len(params) != len(prompts):
                raise UserError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
            ids = []
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = f"{self._ids}"
                self._ids += 1
                try:
                    eng.add_request(rid, p, sp)
                except UserError as e:
                    for r in ids:
                        eng.abort_request(r)
                    raise UserError(f"prompt {i}: {e}") from None
                ids.append(rid)
            final: dict[str, RequestOutput] = {}
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if callback:
                        callback(out)
                    if out.finished:
                        final[out.request_id] = out
            return [final[r] for r in ids]
        finally:
            eng.release_followers()

    def chat(self, messages, sampling_params: SamplingParams | None = None, callback=None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.engine.engine.rank != 0:
            self.engine.follow()
            return []
        return self.generate([self.engine.apply_chat_template(c) for c in convs], sampling_params, callback)

