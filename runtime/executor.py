"""Run the scheduler's plans on an engine, with one step in flight.

    core = EngineCore.for_engine(engine, max_num_batched_tokens=2048, max_num_seqs=256)
    core.scheduler.add(seq)
    while core.has_work():
        advanced = core.step()     # the sequences that got a token

`Executor.launch(plan)` packs the plan's step, runs the ragged program and samples one token per
sequence of the step, on the device; the tokens stay there (the next step's pending inputs are
gathered from them on the device) and one non-blocking copy brings them to pinned host memory.
`Executor.collect` waits for that copy. `EngineCore.step` schedules and launches step t+1
before it collects step t, so the host plans, packs and copies while the device computes, and
waits only for a step that has already been followed by another in the device's queue
(async scheduling, vLLM v1's and SGLang's overlap). With `async_scheduling=False` each step is
collected at once; the tokens are the same either way (runtime/scheduler.py says why).

Under tensor parallelism rank 0 schedules; it broadcasts each packed step and then its sampled
tokens (the other ranks gather pending inputs from them as rank 0 does), and STOP when the
other ranks may return from `follow`. Under pipeline parallelism (runtime/pipeline.py)
`EngineCore.for_engine` returns a `PipelineCore`: one scheduler per micro-batch, up to one step
in flight per stage, each step's packed inputs handed down the stages and its logits sent back
to rank 0 (no pending inputs: a micro-batch is scheduled again once its step is collected).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

import torch

from dsc.errors import UserError
from dsc.runtime.distributed import comm_device
from dsc.runtime.ragged import pack
from dsc.runtime.sampling import logprobs as token_logprobs
from dsc.runtime.sampling import sample_batch
from dsc.runtime.scheduler import DEFAULT_BUDGET, Scheduler, SchedulerLimits, StepPlan

STOP = torch.tensor([-1, 0, 0], dtype=torch.long)  # what rank 0 broadcasts when the followers may return


class _HostRing:
    """Pinned host buffers reused round-robin (allocated once, grown when a step needs more),
    each with the event of the last copy that used it."""

    def __init__(self, device: torch.device, slots: int = 3):
        self.cuda = device.type == "cuda"
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.i = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        i = self.i = (self.i + 1) % len(self.bufs)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()  # its last copy is done before the buffer is rewritten
        buf = self.bufs[i]
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[i] = torch.empty(
                max(nbytes, 2 * (buf.numel() if buf is not None else 0), 4096), dtype=torch.uint8, pin_memory=self.cuda
            )
        return buf[:nbytes].view(dtype), i

    def record(self, i: int) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        ev = self.events[i] = torch.cuda.Event()
        ev.record()
        return ev


@dataclass
class Launched:
    """A launched step: its sampled tokens (and log-probabilities) being copied to the host."""

    tokens: torch.Tensor  # host [S] int64 (pinned on CUDA)
    done: torch.cuda.Event | None
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # host chosen, top ids, top lps
    top_n: list[int] | None = None


class Executor:
    def __init__(self, engine):
        self.engine = engine
        self.device = engine.device
        self.world = engine.world
        self.prev: torch.Tensor | None = None  # the last launched step's sampled tokens [N], on the device
        # a step uploads at most 7 times (step, its tp size, mask, sampling rules, rows twice, the
        # tokens' tp size): a slot comes back after two steps, whose copies have run by then
        self._in = _HostRing(self.device, slots=16)
        self._out = _HostRing(self.device)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host int64 tensor on the device, through a pinned staging buffer."""
        if self.device.type != "cuda":
            return host
        buf, i = self._in.take(host.numel(), torch.long)
        buf.copy_(host.reshape(-1))
        dev = buf.to(self.device, non_blocking=True)
        self._in.record(i)
        return dev.view(host.shape)

    def launch(self, plan: StepPlan) -> Launched:
        packed = pack(plan.step)
        dev = self._upload(packed)
        if self.world > 1:
            broadcast(dev, self._upload)
        logits = self.engine.ragged(packed, self.prev if plan.pending_inputs else None, upload=lambda _: dev)  # [N, V]
        tokens = self._sample(logits, plan)  # [N]
        if self.world > 1:
            broadcast(tokens, self._upload)
        self.prev = tokens
        return self._to_host(logits, tokens, plan)

    def _to_host(self, logits: torch.Tensor, tokens: torch.Tensor, plan: StepPlan) -> Launched:
        """The plan's sampled rows of `tokens` (and their log-probabilities) copied to the host."""
        rows = plan.sample
        chosen = (
            tokens
            if len(rows) == tokens.shape[0]
            else tokens.index_select(0, self._upload(torch.tensor(rows, dtype=torch.long)))
        )
        host, i = self._out.take(len(rows), torch.long)
        host.copy_(chosen, non_blocking=True)
        lp = self._logprobs(logits, tokens, plan)
        return Launched(host, self._out.record(i), *lp)

    def _sample(self, logits: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """One token per row of the step: the plan's sampled rows with their sequences' rules,
        the others greedy (their tokens are never read)."""
        seqs = plan.sampled_seqs
        ps = [s.params for s in seqs]
        masks = [
            (r, t)
            for r, s, c in zip(plan.sample, seqs, plan.counters)
            if c < s.params.min_tokens
            for t in s.params.stop_token_ids
        ]
        if masks:  # min_tokens: no stop token yet
            idx = self._upload(torch.tensor(masks, dtype=torch.long).T.contiguous())
            logits = logits.index_put(
                (idx[0], idx[1]), torch.full((1,), float("-inf"), dtype=logits.dtype, device=logits.device)
            )
        if not any(p.temperature > 0 for p in ps):
            return logits.argmax(dim=-1)
        N = logits.shape[0]
        temp, top_p = [0.0] * N, [1.0] * N
        top_k, seed, counter = [0] * N, [0] * N, [0] * N
        for r, p, c in zip(plan.sample, ps, plan.counters):
            temp[r], top_p[r], top_k[r], seed[r], counter[r] = p.temperature, p.top_p, p.top_k, p.seed, c
        ints = array("q", top_k + seed + counter)
        ints.frombytes(array("d", temp + top_p).tobytes())
        dev = self._upload(torch.frombuffer(ints, dtype=torch.long))
        k, sd, ctr, floats = dev[:N], dev[N : 2 * N], dev[2 * N : 3 * N], dev[3 * N :].view(torch.float64).float()
        sampled = [p for p in ps if p.temperature > 0]
        top_ks = [p.top_k for p in sampled]
        return sample_batch(
            logits,
            floats[:N],
            k,
            floats[N:],
            sd,
            ctr,
            any_sampled=True,
            any_top_k=any(top_ks),
            any_top_p=any(p.top_p < 1 for p in sampled),
            max_top_k=max(top_ks) if all(top_ks) else None,
        )

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, plan: StepPlan):
        want = [s.params.logprobs for s in plan.sampled_seqs]
        if all(w is None for w in want):
            return None, None
        rows = self._upload(torch.tensor(plan.sample, dtype=torch.long))
        chosen, top_ids, top_lps = token_logprobs(
            logits.index_select(0, rows), tokens.index_select(0, rows), max(w for w in want if w is not None)
        )
        pin = self.device.type == "cuda"
        host = tuple(
            torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=True)
            for t in (chosen, top_ids, top_lps)
        )
        return host, [w or 0 for w in want]

    def collect(self, launched: Launched) -> tuple[list[int], list[dict[int, float]] | None]:
        if launched.done is not None:
            launched.done.synchronize()
        tokens = launched.tokens.tolist()
        if launched.logprobs is None:
            return tokens, None
        assert launched.top_n is not None  # _to_host sets it with the log-probabilities
        chosen, top_ids, top_lps = (t.tolist() for t in launched.logprobs)
        lps = []
        for j, n in enumerate(launched.top_n):
            d = {tokens[j]: chosen[j]}
            for tid, lp in zip(top_ids[j][:n], top_lps[j][:n]):
                d.setdefault(tid, lp)
            lps.append(d)
        return tokens, lps


class EngineCore:
    """A scheduler, an executor of its plans, and the steps in flight."""

    def __init__(self, scheduler: Scheduler, executor, async_scheduling: bool = True):
        self.scheduler, self.executor, self.async_scheduling = scheduler, executor, async_scheduling
        self._inflight: deque[tuple[StepPlan, Launched]] = deque()

    @classmethod
    def for_engine(
        cls,
        engine,
        max_num_batched_tokens: int = DEFAULT_BUDGET,
        max_num_seqs: int | None = None,
        prefix_caching: bool = True,
        async_scheduling: bool = True,
    ) -> EngineCore | PipelineCore:
        """Over an engine's KV pool and ragged program; the mixed steps of the budget captured now.
        Under pipeline parallelism, a PipelineCore (its micro-batches step themselves)."""
        if getattr(engine, "pp", 1) > 1:
            return PipelineCore(engine, max_num_batched_tokens, max_num_seqs, prefix_caching)
        num_blocks = next(iter(engine.kv_pool.values())).shape[0]
        scheduler = Scheduler(
            SchedulerLimits(
                num_blocks=num_blocks,
                block_size=engine.plan["kv_pool"]["block_size"],
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=min(max_num_seqs or engine.max_num_seqs, engine.max_num_seqs),
                max_seq=engine.max_seq,
                prefix_caching=prefix_caching,
            )
        )
        engine.ragged.warm_up(max_num_batched_tokens)
        return cls(scheduler, Executor(engine), async_scheduling)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    def step(self) -> list:
        """Schedule and launch the next step, then collect the one before it (or, stepping
        synchronously, this one); returns the sequences that got a token."""
        plan = self.scheduler.schedule()
        if plan is not None:
            self._inflight.append((plan, self.executor.launch(plan)))
        keep = 1 if self.async_scheduling and plan is not None and self.scheduler.has_work() else 0
        out = []
        while len(self._inflight) > keep:
            done, launched = self._inflight.popleft()
            out += self.scheduler.update(done, *self.executor.collect(launched))
        if not self.scheduler.has_work():  # what is left in flight is dropped tokens only
            while self._inflight:
                done, launched = self._inflight.popleft()
                self.scheduler.update(done, *self.executor.collect(launched))
        return out


def broadcast(t: torch.Tensor, upload=None) -> None:
    """Rank 0: a packed step (its size first) or a step's sampled tokens, to the other ranks.
    upload: how a host tensor reaches the communication device (Executor._upload: through
    pinned memory, so the host does not wait for the device's queue)."""
    import torch.distributed as dist

    dev = comm_device()
    size = torch.tensor([t.numel()], dtype=torch.long)
    dist.broadcast(upload(size) if upload is not None and dev.type == "cuda" else size.to(dev), src=0)
    dist.broadcast(t if t.device == dev else t.to(dev), src=0)


def _receive() -> torch.Tensor:
    import torch.distributed as dist

    dev = comm_device()
    size = torch.zeros(1, dtype=torch.long, device=dev)
    dist.broadcast(size, src=0)
    t = torch.zeros(int(size.item()), dtype=torch.long, device=dev)
    dist.broadcast(t, src=0)
    return t


def release_followers(engine) -> None:
    """Rank 0: let the other ranks' `follow` return."""
    if getattr(engine, "pp", 1) > 1:
        engine.hand_on(STOP)
        engine.drain_sends()
    elif engine.world > 1:
        broadcast(STOP)


def follow(engine) -> None:
    """Ranks > 0: run the steps rank 0 broadcasts, until it broadcasts STOP. Under pipeline
    parallelism: the steps handed on by the stage before (or, on the first stage, broadcast by
    rank 0), each passed on before it runs."""
    if getattr(engine, "pp", 1) > 1:
        while True:
            packed = engine.receive_step()
            engine.hand_on(packed)
            if int(packed[0]) < 0:
                engine.drain_sends()
                return
            engine.ragged(packed, None)
    prev = None
    while True:
        packed = _receive().cpu()
        if int(packed[0]) < 0:
            return
        has_pending = bool((packed[3 : 3 + int(packed[0])] < 0).any())
        engine.ragged(packed, prev.to(engine.device) if has_pending and prev is not None else None)
        prev = _receive()


# -- pipeline parallelism ------------------------------------------------------------------------
class MultiScheduler:
    """The schedulers of a pipeline's micro-batches, as one scheduler to LLMEngine: a new
    sequence goes to the least loaded; the rest follows the sequence."""

    def __init__(self, parts: list[Scheduler]):
        self.parts = parts
        self.block_size = parts[0].block_size

    def check_fits(self, n_prompt: int, max_tokens: int, where: str = "prompt") -> None:
        self.parts[0].check_fits(n_prompt, max_tokens, where)

    def add(self, seq, where: str = "prompt") -> None:
        k = min(range(len(self.parts)), key=lambda i: (len(self.parts[i].running) + len(self.parts[i].waiting), i))
        self.parts[k].add(seq, where)
        seq.micro_batch = k

    def finish(self, seq, reason: str) -> None:
        self.parts[getattr(seq, "micro_batch", 0)].finish(seq, reason)

    def has_work(self) -> bool:
        return any(p.has_work() for p in self.parts)

    def stats(self) -> dict:
        out: dict = {}
        for p in self.parts:
            for k, v in p.stats().items():
                out[k] = out.get(k, 0) + v
        return out


def _shifted(step, blocks: int, block_size: int):
    """The step with its block ids (and the slots in them) moved up by `blocks`."""
    from dataclasses import replace

    if blocks == 0:
        return step
    return replace(
        step,
        block_tables=[[b + blocks for b in t] for t in step.block_tables],
        slot_mapping=[s + blocks * block_size if s >= 0 else s for s in step.slot_mapping],
    )


class PipelineExecutor(Executor):
    """Rank 0 of a pipeline: `launch` packs a micro-batch's step, hands it to the stages (its
    stage's tp ranks by broadcast, the next stage with the activations) and runs the first
    stage; `finish` receives that step's logits from the last stage (in launch order), samples
    and returns the tokens. Micro-batch k's blocks are the pool's k-th share."""

    def __init__(self, engine, blocks_each: int, block_size: int):
        super().__init__(engine)
        self.blocks_each, self.block_size = blocks_each, block_size

    def launch_part(self, plan: StepPlan, k: int) -> None:
        packed = pack(_shifted(plan.step, k * self.blocks_each, self.block_size))
        self.engine.hand_on(packed)
        dev = self._upload(packed)
        self.engine.ragged(packed, None, upload=lambda _: dev)

    def finish(self, plan: StepPlan) -> tuple[list[int], list[dict[int, float]] | None]:
        logits = self.engine.last_stage_logits()
        return self.collect(self._to_host(logits, self._sample(logits, plan), plan))


class PipelineCore:
    """EngineCore's loop over pipeline stages: one scheduler per micro-batch (pp of them, each
    over its share of the KV blocks and sequences), stepped round-robin so that up to pp steps
    are in flight, one per stage, each collected (in launch order) before its micro-batch is
    scheduled again."""

    def __init__(self, engine, max_num_batched_tokens: int, max_num_seqs: int | None, prefix_caching: bool):
        k = engine.pp
        num_blocks = next(iter(engine.kv_pool.values())).shape[0]
        block_size = engine.plan["kv_pool"]["block_size"]
        seqs = min(max_num_seqs or engine.max_num_seqs, engine.max_num_seqs)
        each = num_blocks // k
        if each < 1:
            raise UserError(f"--kv-cache-memory: {num_blocks} KV blocks cannot be shared by {k} pipeline micro-batches")
        self.scheduler = MultiScheduler(
            [
                Scheduler(
                    SchedulerLimits(
                        num_blocks=each,
                        block_size=block_size,
                        max_num_batched_tokens=max_num_batched_tokens,
                        max_num_seqs=max(1, seqs // k),
                        max_seq=engine.max_seq,
                        prefix_caching=prefix_caching,
                    )
                )
                for _ in range(k)
            ]
        )
        self.executor = PipelineExecutor(engine, each, block_size)
        self._inflight: deque[tuple[int, StepPlan]] = deque()
        self._next = 0
        self.peak_in_flight = 0  # the most steps that were in the pipeline at once

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    def step(self) -> list:
        """Launch the next micro-batch with work and nothing in flight; collect the oldest step
        when every micro-batch has one in flight or none could be launched."""
        parts = self.scheduler.parts
        busy = {k for k, _ in self._inflight}
        launched = False
        for j in range(len(parts)):
            k = (self._next + j) % len(parts)
            if k in busy:
                continue
            plan = parts[k].schedule()
            if plan is None:
                continue
            self.executor.launch_part(plan, k)
            self._inflight.append((k, plan))
            self._next, launched = (k + 1) % len(parts), True
            self.peak_in_flight = max(self.peak_in_flight, len(self._inflight))
            break
        if self._inflight and (not launched or len(self._inflight) == len(parts)):
            k, plan = self._inflight.popleft()
            return parts[k].update(plan, *self.executor.finish(plan))
        return []
