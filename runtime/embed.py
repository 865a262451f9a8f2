"""Embeddings from an encoder artifact: the request engine `dsc serve` drives, and pooling.

    llm = dsc.LLM("build/minilm")
    outs = llm.embed(["a sentence", "another one"])     # vLLM's LLM.embed
    outs[0].outputs.embedding                           # list of floats (hidden_size)

`EmbeddingEngine` has LLMEngine's request interface (add_request / abort_request / step /
has_unfinished_requests / stats), so the serving driver and engine process run it unchanged.
A step takes waiting requests in arrival order while the padded batch stays within the token
budget (`max_num_batched_tokens`: rows x the longest row) and `max_num_seqs` rows, runs the
`encode` program once, pools each row and finishes those requests. A request is one input;
nothing is cached between steps.

Pooling is the artifact's (plan "model.pooling", compiler/pooling.py): the mean of the real
tokens' states, the first token's (CLS) or the last real token's; then L2 normalization where
the plan says so (a request may ask for it or not, as vLLM's `normalize`). Rows are padded with
the plan's pad token; a padded key is never attended to, so a row's embedding does not depend
on the batch it ran in beyond floating-point rounding.

Under tensor parallelism rank 0 schedules and broadcasts each batch (executor.broadcast); the
other ranks run it in `follow` until rank 0's `release_followers`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsc.errors import UserError
from dsc.runtime.checks import is_int
from dsc.runtime.executor import STOP, _receive, broadcast

DEFAULT_EMBED_BUDGET = 16384  # padded tokens per step: batches of short inputs fill the GPU


@dataclass
class EmbeddingParams:
    """What a request may choose (vLLM's PoolingParams): normalize None keeps the artifact's."""

    normalize: bool | None = None
    n: int = 1  # one embedding per request (the serving loop's choice count)

    def __post_init__(self):
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise UserError(f"normalize: expected true or false, got {self.normalize!r}")


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def pool(hidden: torch.Tensor, lengths: torch.Tensor, mode: str, normalize) -> torch.Tensor:
    """hidden [B, S, E] fp32, lengths [B] -> [B, E]: mean | cls | last over each row's real
    tokens; rows whose `normalize` (a bool per row) is set are scaled to unit L2 norm."""
    B, S, _ = hidden.shape
    lengths = lengths.to(hidden.device)
    if mode == "cls":
        out = hidden[:, 0]
    elif mode == "last":
        out = hidden[torch.arange(B, device=hidden.device), lengths - 1]
    else:
        real = (torch.arange(S, device=hidden.device)[None, :] < lengths[:, None]).to(hidden.dtype)
        out = (hidden * real[..., None]).sum(1) / lengths[:, None].to(hidden.dtype)
    norm = torch.as_tensor(normalize, device=hidden.device).reshape(-1, 1).expand(B, 1)
    return torch.where(norm, torch.nn.functional.normalize(out, p=2, dim=-1), out)


@dataclass
class _Waiting:
    request_id: str
    prompt: str | None
    ids: list[int]
    normalize: bool
    arrived: float = field(default_factory=time.monotonic)


class EmbeddingEngine:
    def __init__(
        self,
        artifact: str | Path | None = None,
        *,
        device=None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = DEFAULT_EMBED_BUDGET,
        verify: bool = True,
        require_signature: str | Path | None = None,
        engine=None,
        trust_kernels: bool = False,
        offload: str | None = None,
        gpu_memory: float | None = None,
        **decoder_options: Any,
    ):
        """decoder_options: the KV-cache, CUDA-graph and scheduling keywords of LLMEngine, which
        an encoder has no use for (accepted, so that one set of serving flags starts either)."""
        for name, value in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens)):
            if not is_int(value) or value < 1:
                raise UserError(f"{name}: expected an integer >= 1, got {value!r}")
        if decoder_options.get("pipeline_parallel_size", 1) != 1:
            raise UserError("--pipeline-parallel-size: only decoders run in pipeline stages (this is an encoder)")
        if engine is None:
            from dsc.runtime.engine import load

            if artifact is None:
                raise TypeError("EmbeddingEngine: give an artifact path or an engine")
            engine = load(
                artifact,
                device=device,
                verify=verify,
                require_signature=require_signature,
                static=False,
                trust_kernels=trust_kernels,
                offload=offload,
                gpu_memory=gpu_memory,
            )
        if engine.kind != "encoder":
            raise UserError(
                f"{engine.artifact.path}: a {engine.kind} artifact has no embeddings; "
                "use LLM.generate, /v1/completions or /v1/chat/completions"
            )
        self.engine = engine
        self.kind = "encoder"
        model = engine.plan["model"]
        self.pooling = dict(model["pooling"])
        self.pad_token_id = model["pad_token_id"]
        self.hidden_size = model["hidden_size"]
        self.tokenizer = engine.artifact.tokenizer()
        self.model_name = Path(engine.artifact.path).name
        self.max_model_len = engine.max_seq
        self.vocab_size = engine.vocab_size
        self.eos_token_ids: list[int] = []
        self.max_num_seqs = min(max_num_seqs, engine.max_batch)
        self.budget = max_num_batched_tokens
        if self.budget < self.max_model_len:
            raise UserError(
                f"--max-num-batched-tokens {self.budget} is below the artifact's max_seq "
                f"{self.max_model_len}: its longest inputs would never run"
            )
        self.load_times = dict(getattr(engine, "load_times", {}))
        self._waiting: deque[_Waiting] = deque()
        self._steps = self._tokens = 0

    # -- requests ---------------------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int], where: str = "input") -> list[int]:
        """A prompt's token ids (text through the artifact's tokenizer, special tokens added as
        the model was trained), checked against the vocabulary and max_seq."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError(f"{where}: the artifact has no tokenizer; give token ids")
            ids = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise UserError(f"{where}: expected text or a list of token ids")
        if not ids:
            raise UserError(f"{where}: empty input")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"{where}: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(ids) > self.max_model_len:
            raise UserError(f"{where}: {len(ids)} tokens; the model's maximum is {self.max_model_len}")
        return ids

    def add_request(self, request_id: str, prompt: str | Seq[int], params: EmbeddingParams | None = None) -> None:
        params = params or EmbeddingParams()
        ids = self.encode(prompt)
        normalize = self.pooling["normalize"] if params.normalize is None else params.normalize
        self._waiting.append(_Waiting(request_id, prompt if isinstance(prompt, str) else None, ids, normalize))

    def abort_request(self, request_id: str) -> None:
        self._waiting = deque(w for w in self._waiting if w.request_id != request_id)

    def finish_sequence(self, request_id: str, index: int, reason: str = "stop") -> bool:
        return False  # no sequences: an embedding request ends in the step that runs it

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting)

    def stats(self) -> dict:
        """LLMEngine.stats' fields (the server's metrics read them): no KV blocks, no generation."""
        return {
            "num_running": 0,
            "num_waiting": len(self._waiting),
            "kv_blocks_total": 0,
            "kv_blocks_used": 0,
            "prefix_cache_hit_tokens": 0,
            "prompt_tokens_total": self._tokens,
            "generation_tokens_total": 0,
            "preemptions": 0,
            "steps": self._steps,
        }

    # -- steps ------------------------------------------------------------------------------------
    def _take(self) -> list[_Waiting]:
        batch: list[_Waiting] = []
        longest = 0
        while self._waiting and len(batch) < self.max_num_seqs:
            n = max(longest, len(self._waiting[0].ids))
            if batch and n * (len(batch) + 1) > self.budget:
                break
            batch.append(self._waiting.popleft())
            longest = n
        return batch

    def step(self) -> list[EmbeddingRequestOutput]:
        batch = self._take()
        if not batch:
            return []
        S = max(2, max(len(w.ids) for w in batch))  # the program is traced for seq >= 2
        ids = torch.full((len(batch), S), self.pad_token_id, dtype=torch.long)
        for i, w in enumerate(batch):
            ids[i, : len(w.ids)] = torch.tensor(w.ids, dtype=torch.long)
        lengths = torch.tensor([len(w.ids) for w in batch], dtype=torch.long)
        vecs = self._run(ids, lengths, [w.normalize for w in batch]).cpu()
        self._steps += 1
        self._tokens += sum(len(w.ids) for w in batch)
        return [
            EmbeddingRequestOutput(w.request_id, w.prompt, w.ids, EmbeddingOutput(v.tolist()))
            for w, v in zip(batch, vecs)
        ]

    def _run(self, ids: torch.Tensor, lengths: torch.Tensor, normalize: list[bool]) -> torch.Tensor:
        eng = self.engine
        if eng.world > 1:  # the batch and each row's normalization, to the ranks following this one
            head = torch.tensor([ids.shape[0], ids.shape[1], 1], dtype=torch.long)
            broadcast(torch.cat([head, ids.flatten(), lengths, torch.tensor(normalize, dtype=torch.long)]))
        hidden = eng.encode(ids, lengths)
        return pool(hidden, lengths, self.pooling["mode"], torch.tensor(normalize))

    # -- tensor parallelism -----------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks > 0: run the batches rank 0 broadcasts, until it releases them."""
        while True:
            t = _receive().cpu()
            if t.numel() == STOP.numel() and int(t[0]) == int(STOP[0]):
                return
            B, S = int(t[0]), int(t[1])
            ids = t[3 : 3 + B * S].view(B, S)
            lengths = t[3 + B * S : 3 + B * S + B]
            self.engine.encode(ids, lengths)

    def release_followers(self) -> None:
        from dsc.runtime.executor import release_followers

        release_followers(self.engine)

    def shutdown(self) -> None:
        self._waiting.clear()
        self.release_followers()
