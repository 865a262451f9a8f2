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
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dsc.errors import UserError
from dsc.runtime.checks import check_token_ids, is_int
from dsc.runtime.executor import EngineCore, follow, release_followers
from dsc.runtime.scheduler import DEFAULT_BUDGET, SeqParams, Sequence

if TYPE_CHECKING:
    from dsc.runtime.embed import EmbeddingEngine


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


class SamplingParams(BaseModel):
    """How one request samples (vLLM's SamplingParams), checked on construction: a value out of
    its range is one UserError line naming the field. Unset fields take the artifact's defaults
    at `add_request`, where the bounds that depend on the model (the vocabulary, max_seq) are
    checked too."""

    model_config = ConfigDict(strict=True, extra="forbid", validate_assignment=True)

    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(16, ge=1, lt=2**63)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off; at most the vocabulary size
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # each within the vocabulary
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # at most the vocabulary size too
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int | None = Field(None, ge=0)  # no eos / stop token before this many (default: the artifact's, else 0)

    def __init__(self, **fields: Any) -> None:
        try:
            super().__init__(**fields)
        except ValidationError as e:
            raise UserError(_one_line(e)) from None

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _lists(cls, v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if not s:
                raise ValueError("expected a non-empty string or a list of them")
            _check_text(s, "stop")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("expected a list of token ids >= 0")
        return v


def _one_line(e: ValidationError) -> str:
    """The first error of a pydantic ValidationError as `field: what, got value`."""
    err = e.errors(include_url=False)[0]
    where = ".".join(str(x) for x in err["loc"]) or "sampling_params"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}, got {_short(err.get('input'))}"


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


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_text(value: Any, where: str) -> None:
    """Every string in value (nested in lists and dicts) is valid Unicode: a lone surrogate,
    which JSON's \\ud800 escapes can carry, has no UTF-8 encoding and no tokenization."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"{where}: invalid Unicode (a lone surrogate at character {e.start})") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, where)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_text(v, where)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_sampling_fields(
    *, n: Any = 1, temperature: Any = 1.0, top_p: Any = 1.0, top_k: Any = 0, vocab_size: int, where: str = ""
) -> None:
    """The bounds of n, temperature, top_p and top_k (for a request, and for the artifact's
    generation_config.json defaults, which `where` then names)."""
    if not is_int(n) or not 1 <= n <= 128:
        raise UserError(f"{where}n: expected an integer from 1 to 128, got {_short(n)}")
    if not _is_num(temperature) or temperature < 0:
        raise UserError(f"{where}temperature: expected a finite number >= 0, got {_short(temperature)}")
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise UserError(f"{where}top_p: expected a number in (0, 1], got {_short(top_p)}")
    if not is_int(top_k) or not -1 <= top_k <= vocab_size:
        raise UserError(
            f"{where}top_k: expected an integer from -1 to the vocabulary size {vocab_size} "
            f"(0 or -1: off), got {_short(top_k)}"
        )


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
    fed: list[int] = field(default_factory=list)  # per sequence: output tokens given to its detokenizer


class LLMEngine:
    def __init__(
        self,
        artifact: str | Path | None = None,
        *,
        device=None,
        kv_cache_memory: float | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = DEFAULT_BUDGET,
        enable_prefix_caching: bool = True,
        verify: bool = True,
        cuda_graphs: bool = True,
        require_signature: str | Path | None = None,
        prefill_buckets: bool | None = None,
        engine=None,
        async_scheduling: bool = True,
        detokenize: bool = True,
        trust_kernels: bool = False,
        offload: str | None = None,
        gpu_memory: float | None = None,
        pipeline_parallel_size: int = 1,
    ):
        if engine is None:
            from dsc.runtime.engine import load

            if artifact is None:
                raise TypeError("LLMEngine: give an artifact path or an engine")
            if not is_int(max_num_seqs) or max_num_seqs < 1:
                raise UserError(f"--max-num-seqs: expected an integer >= 1, got {max_num_seqs!r}")
            engine = load(
                artifact,
                device=device,
                verify=verify,
                cuda_graphs=cuda_graphs,
                require_signature=require_signature,
                static=False,
                kv_cache_memory=kv_cache_memory,
                max_num_seqs=max_num_seqs,
                prefill_buckets=prefill_buckets,
                trust_kernels=trust_kernels,
                offload=offload,
                gpu_memory=gpu_memory,
                pipeline_parallel_size=pipeline_parallel_size,
            )
        self.engine = engine
        from dsc.runtime.decode import CAPTURE_TIMES, capture_times_since

        before, t = dict(CAPTURE_TIMES), time.perf_counter()
        self.core = EngineCore.for_engine(
            engine, max_num_batched_tokens, max_num_seqs, enable_prefix_caching, async_scheduling
        )
        # seconds by load stage (checksums, weights, kv_cache, programs, kernels, graphs), the
        # scheduler's mixed-step captures included
        self.load_times = dict(getattr(engine, "load_times", {}))
        for k, v in capture_times_since(before).items():
            self.load_times[k] = self.load_times.get(k, 0.0) + v
        self.load_times["scheduler"] = time.perf_counter() - t
        self.scheduler = self.core.scheduler
        self.tokenizer = engine.artifact.tokenizer()
        self.model_name = Path(engine.artifact.path).name
        self.max_model_len = engine.max_seq
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = list(engine.eos_token_ids)
        self.generation_defaults = self._generation_config()
        self.chat_templates = self._chat_templates()
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
        """The sampling defaults of the artifact's generation_config.json, under the bounds a
        request's values have (a value out of them is refused at load: one line naming it)."""
        g = self._tokenizer_json("generation_config.json")
        out = {key: g[key] for key in ("temperature", "top_p", "top_k") if g.get(key) is not None}
        if out:
            where = f"{Path(self.engine.artifact.path) / 'tokenizer' / 'generation_config.json'}: field "
            check_sampling_fields(**out, vocab_size=self.vocab_size, where=where)
        if g.get("do_sample") is False:  # transformers' greedy default
            out["temperature"] = 0.0
        min_tokens = (self.engine.artifact.manifest.get("options") or {}).get("min_tokens")
        if is_int(min_tokens) and min_tokens > 0:
            out["min_tokens"] = min_tokens
        return out

    def _chat_templates(self):
        """The artifact's chat templates (runtime/chat_template.py), or None: tokenizer/
        chat_template.jinja and additional_chat_templates/NAME.jinja, else tokenizer_config.json's
        chat_template (a string, or a list of {name, template}), as transformers reads them."""
        from dsc.runtime.chat_template import SPECIAL_TOKENS, ChatTemplates

        art, root = self.engine.artifact, Path(self.engine.artifact.path) / "tokenizer"
        cfg = self._tokenizer_json("tokenizer_config.json")
        templates, where = {}, root / "tokenizer_config.json"
        files = sorted(
            f
            for f in art.manifest["files"]
            if f == "tokenizer/chat_template.jinja"
            or (f.startswith("tokenizer/additional_chat_templates/") and f.endswith(".jinja") and f.count("/") == 2)
        )
        for f in files:
            name = "default" if f == "tokenizer/chat_template.jinja" else f.rsplit("/", 1)[1][: -len(".jinja")]
            try:
                templates[name] = (Path(art.path) / f).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                raise UserError(f"{Path(art.path) / f}: not a readable UTF-8 text file") from None
            where = Path(art.path) / f if len(files) == 1 else root
        if not templates:
            t = cfg.get("chat_template")
            if isinstance(t, str):
                templates["default"] = t
            elif isinstance(t, list) and all(
                isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str) for e in t
            ):
                templates = {e["name"]: e["template"] for e in t}
            elif t is not None:
                raise UserError(f"{where}: field 'chat_template' must be a string or a list of {{name, template}}")
        if not templates:
            return None
        special = {**cfg, **self._tokenizer_json("special_tokens_map.json")}
        tokens = {}
        for key in SPECIAL_TOKENS:
            t = special.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            if isinstance(t, str):
                tokens[key] = t
        return ChatTemplates(templates, tokens, str(where))

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        chat_template: str | None = None,
    ) -> str:
        """The artifact's chat template over `messages`, as transformers' apply_chat_template(...,
        tokenize=False) renders it (the assistant's turn opened by default). `chat_template_kwargs`
        are the template's extra variables (enable_thinking, ...); `chat_template` names one of the
        artifact's templates. Rendered in a sandboxed worker with time, memory and size limits."""
        if self.chat_templates is None:
            raise UserError(f"{self.model_name}: the artifact's tokenizer has no chat template")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        ):
            raise UserError('messages: expected a non-empty list of {"role": str, "content": ...}')
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
                raise UserError(f"{name}: expected a list of objects")
        if chat_template_kwargs is not None and not (
            isinstance(chat_template_kwargs, dict) and all(isinstance(k, str) for k in chat_template_kwargs)
        ):
            raise UserError("chat_template_kwargs: expected an object")
        _check_text(messages, "messages")
        return self.chat_templates.render(
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            kwargs=chat_template_kwargs,
            template=chat_template,
        )

    # -- requests ---------------------------------------------------------------------------------
    def _resolve(self, p: SamplingParams) -> SamplingParams:
        """p with its unset fields taken from the defaults and the bounds that depend on the model
        checked (top_k, logprobs and stop token ids within the vocabulary, min_tokens within
        max_tokens; max_tokens kept at most max_seq): a value that passes cannot fail a step."""
        if not isinstance(p, SamplingParams):
            raise UserError(f"sampling_params: expected dsc.SamplingParams, got {type(p).__name__}")
        d = self.generation_defaults
        temperature = p.temperature if p.temperature is not None else d.get("temperature", 1.0)
        top_p = p.top_p if p.top_p is not None else d.get("top_p", 1.0)
        top_k = p.top_k if p.top_k is not None else d.get("top_k", 0)
        check_sampling_fields(n=p.n, temperature=temperature, top_p=top_p, top_k=top_k, vocab_size=self.vocab_size)
        # a sequence ends at max_seq whatever max_tokens says: larger values are kept as max_seq
        max_tokens = None if p.max_tokens is None else min(p.max_tokens, self.max_model_len)
        most = max_tokens if max_tokens is not None else self.max_model_len
        min_tokens = p.min_tokens if p.min_tokens is not None else min(d.get("min_tokens", 0), most)
        if not is_int(min_tokens) or not 0 <= min_tokens <= most:
            raise UserError(f"min_tokens: expected an integer from 0 to max_tokens ({most}), got {_short(min_tokens)}")
        stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        ids = list(p.stop_token_ids or [])
        check_token_ids(ids, self.vocab_size, "stop_token_ids")
        most_logprobs = min(MAX_LOGPROBS, self.vocab_size)
        if p.logprobs is not None and p.logprobs > most_logprobs:
            raise UserError(f"logprobs: expected an integer from 0 to {most_logprobs}, got {_short(p.logprobs)}")
        return p.model_copy(
            update=dict(
                max_tokens=max_tokens,
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=max(int(top_k), 0),
                stop=stop,
                stop_token_ids=ids,
                min_tokens=min_tokens,
            )
        )

    def encode(self, prompt: str | Seq[int], where: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            _check_text(prompt, where)
            if self.tokenizer is None:
                raise UserError(f"{where}: the artifact has no tokenizer; give token ids")
            ids = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = check_token_ids(prompt, self.vocab_size, where)
        else:
            raise UserError(f"{where}: expected text or a list of token ids")
        if not ids:
            raise UserError(f"{where}: empty")
        return ids

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None) -> None:
        if request_id in self._requests:
            raise UserError(f"request_id: {request_id!r} is already running")
        p = self._resolve(params or SamplingParams())
        # _resolve leaves none of these unset
        assert p.temperature is not None and p.top_k is not None and p.top_p is not None and p.min_tokens is not None
        assert isinstance(p.stop, list) and p.stop_token_ids is not None
        ids = self.encode(prompt)
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(ids)
        self.scheduler.check_fits(len(ids), max(max_tokens, 1))
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        base_seed = p.seed if p.seed is not None else secrets.randbits(62)
        seqs, detoks = [], []
        for i in range(p.n):
            sp = SeqParams(
                max_tokens=max(max_tokens, 1),
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=(base_seed + i) % 2**63,
                stop_token_ids=stop_ids,
                logprobs=p.logprobs,
                min_tokens=p.min_tokens,
            )
            seqs.append(Sequence(request_id, ids, sp, index=i))
            detoks.append(self._detokenizer(ids, p))
        req = _Request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            ids,
            p,
            seqs,
            detoks,
            p.stop,
            [None] * p.n,
            [0] * p.n,
        )
        for s in seqs:
            self.scheduler.add(s)
        self._requests[request_id] = req

    def _detokenizer(self, ids: list[int], p: SamplingParams):
        if self.tokenizer is None or not self.detokenize:
            return None
        from dsc.runtime.detokenize import Detokenizer

        assert isinstance(p.stop, list)  # resolved (_resolve)
        return Detokenizer(
            self.tokenizer,
            ids,
            stop=p.stop,
            include_stop=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens,
        )

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
        """One scheduler step; the requests that advanced, with their outputs so far. A step may
        bring a sequence more than one token (tokens in flight collected together)."""
        touched: dict[str, _Request] = {}
        for seq in dict.fromkeys(self.core.step()):
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            d = req.detoks[seq.index]
            if d is not None and len(seq.output_ids) > req.fed[seq.index]:
                d.add(seq.output_ids[req.fed[seq.index] :])
                req.fed[seq.index] = len(seq.output_ids)
                if d.stopped and not seq.finished:
                    self.scheduler.finish(seq, "stop")
                    req.stop_reasons[seq.index] = d.stop_reason
                elif d.stopped:
                    seq.finish_reason = "stop"
                    req.stop_reasons[seq.index] = d.stop_reason
            if d is not None and seq.finished and not d.stopped:
                d.flush()  # ended by length or a stop token: the text held back for stop strings
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
            comps.append(
                CompletionOutput(
                    seq.index,
                    text,
                    list(seq.output_ids),
                    list(seq.logprobs) if req.params.logprobs is not None else None,
                    seq.finish_reason,
                    reason,
                )
            )
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, comps, all(s.finished for s in req.seqs))

    def stats(self) -> dict:
        out = self.scheduler.stats()
        ring = getattr(self.engine, "ring", None)
        if ring is not None:  # --offload: weight bytes streamed to the device so far
            out["offload_bytes_total"] = ring.bytes_moved
        return out

    # -- tensor parallelism -----------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks > 0: run the steps rank 0 broadcasts until rank 0 calls `release_followers`."""
        follow(self.engine)

    def release_followers(self) -> None:
        """Rank 0: let the other ranks' `follow` return."""
        release_followers(self.engine)

    def shutdown(self) -> None:
        self.release_followers()


def artifact_kind(path: str | Path) -> str:
    """ "decoder" or "encoder", from the artifact's plan (checked as the loader checks it)."""
    from dsc.runtime.artifact import open_artifact

    return open_artifact(path, ranks=[], verify=False).plan["model"].get("kind", "decoder")


class LLM:
    """Offline generation over the continuous-batching engine; embeddings of an encoder
    artifact (runtime/embed.py)."""

    def __init__(self, model: str | Path, **kwargs):
        if kwargs.get("engine") is None and artifact_kind(model) == "encoder":
            from dsc.runtime.embed import EmbeddingEngine

            self.engine: LLMEngine | EmbeddingEngine = EmbeddingEngine(model, **kwargs)
        else:
            self.engine = LLMEngine(model, **kwargs)
        self._ids = 0

    def _decoder(self, what: str) -> LLMEngine:
        """The engine, a decoder's (UserError naming `what` for an encoder's)."""
        if not isinstance(self.engine, LLMEngine):
            raise UserError(f"{what}: {self.engine.model_name} is an embedding (encoder) model; use LLM.embed")
        return self.engine

    def embed(self, prompts, pooling_params=None) -> list:
        """One EmbeddingRequestOutput per prompt (text or token ids), in order: `.outputs.embedding`.
        pooling_params: an EmbeddingParams (normalize) for all, or a list of them. Under tensor
        parallelism every rank calls this; rank 0 returns the outputs, the others []."""
        from dsc.runtime.embed import EmbeddingEngine

        eng = self.engine
        if not isinstance(eng, EmbeddingEngine):
            raise UserError(
                f"embed: {eng.model_name} is a decoder (causal LM); compile an encoder model "
                "(BERT, RoBERTa, DistilBERT, a sentence-transformers checkpoint) for embeddings"
            )
        return self._run(prompts, pooling_params, "pooling_params")

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _prompts(self, prompts) -> list:
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and all(is_int(t) for t in prompts)
        ):
            return [prompts]
        if isinstance(prompts, dict):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise UserError("prompts: expected text, token ids, or a non-empty list of them")
        return [
            p["prompt_token_ids"]
            if isinstance(p, dict) and "prompt_token_ids" in p
            else p["prompt"]
            if isinstance(p, dict) and "prompt" in p
            else p
            for p in prompts
        ]

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, callback=None
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Under tensor parallelism every rank calls this; rank
        0 schedules and returns the outputs, the others run its steps and return []."""
        self._decoder("generate")
        return self._run(prompts, sampling_params, "sampling_params", callback)

    def _run(self, prompts, params, params_name: str, callback=None) -> list:
        """Add one request per prompt (params: one for all, or a list of them), step the engine
        until every one finished, return their final outputs in order; `callback(out)` sees
        every output. Ranks > 0 follow rank 0's steps and return []."""
        eng = self.engine
        if eng.engine.rank != 0:
            eng.follow()
            return []
        try:
            prompts = self._prompts(prompts)
            params = params if isinstance(params, list) else [params] * len(prompts)
            if len(params) != len(prompts):
                raise UserError(f"{params_name}: {len(params)} given for {len(prompts)} prompts")
            ids: list[str] = []
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
            final: dict[str, Any] = {}
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if callback:
                        callback(out)
                    if out.finished:
                        final[out.request_id] = out
            return [final[r] for r in ids]
        finally:
            eng.release_followers()

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | None = None,
        callback=None,
        *,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them, rendered
        by the artifact's chat template (LLMEngine.apply_chat_template takes the keywords)."""
        eng = self._decoder("chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if eng.engine.rank != 0:
            eng.follow()
            return []
        if not isinstance(convs, list) or not convs:
            raise UserError("messages: expected a conversation (a list of messages) or a list of them")
        texts = [
            eng.apply_chat_template(
                c,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            for c in convs
        ]
        return self.generate(texts, sampling_params, callback)
