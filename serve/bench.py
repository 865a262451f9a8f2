"""`dsc bench-serve URL`: a load generator for an OpenAI-compatible server, on the official
`openai` async client.

For each request rate, requests arrive as a Poisson process (exponential gaps; rate inf: all
at once), each a streamed completion of random token ids with a prompt length and an output
length drawn from the given distributions (`ignore_eos`, so every request generates exactly
its output length). Per rate it reports throughput (requests/s, output and total tokens/s)
and time to first token, inter-token latency and end-to-end latency at p50/p90/p99, as a
table, JSON, and a PNG of latency against throughput across the rates.

A length distribution is `N` (fixed), `LO:HI` (uniform integers) or `A,B,...` (one of them,
uniformly): `--prompt-len 32:2048 --output-len 32:512`, or `--prompt-len 128,2048`.

The vocabulary prompt ids are drawn from and the longest request are the server's, from
/v1/models (`vocab_size`, dsc's; `max_model_len`, as vLLM reports it): by default prompts and
outputs of 128 tokens each, or half of max_model_len each when that is smaller; given lengths or
`--vocab` that the server cannot take are one error line before any request.

`--offline ARTIFACT` also runs the same requests through `dsc.LLM` in this process, all at
once, for the throughput the server's saturated rate is compared with.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dsc.errors import UserError


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts: values (uniform choice) or an inclusive range."""

    spec: str
    lo: int
    hi: int
    values: tuple = ()

    @classmethod
    def parse(cls, spec: str, flag: str) -> Lengths:
        try:
            if ":" in spec:
                lo, hi = (int(x) for x in spec.split(":"))
                out = cls(spec, lo, hi)
            else:
                values = tuple(int(x) for x in spec.split(","))
                out = cls(spec, min(values), max(values), values)
        except ValueError:
            raise UserError(f"{flag}: expected N, LO:HI or A,B,..., got {spec!r}") from None
        if out.lo < 1 or out.hi < out.lo:
            raise UserError(f"{flag}: lengths must be >= 1 and LO <= HI, got {spec!r}")
        return out

    def draw(self, rng: random.Random) -> int:
        return rng.choice(self.values) if self.values else rng.randint(self.lo, self.hi)


@dataclass
class BenchConfig:
    url: str
    rates: list  # requests per second; math.inf: all at once
    num_requests: int = 100
    prompt_len: Lengths | None = None  # None: DEFAULT_LEN, or half the model's max length
    output_len: Lengths | None = None
    vocab: int | None = None  # prompt token ids are drawn from [10, vocab); None: the model's
    model: str | None = None  # None: the server's first model
    api_key: str = "none"
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # asked for
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list = field(default_factory=list)  # seconds between token deliveries
    completion_tokens: int = 0


DEFAULT_LEN = 128  # prompt and output tokens when not given
FALLBACK_VOCAB = 1000  # prompt ids below this when the server does not report its vocabulary


def fit(cfg: BenchConfig, vocab: int | None, max_model_len: int | None, where: str) -> BenchConfig:
    """cfg for a model of this vocabulary and max length (None: unknown): the lengths not given
    fitted to it, the given ones and --vocab checked against it."""
    if cfg.vocab is not None and vocab and cfg.vocab > vocab:
        raise UserError(f"--vocab {cfg.vocab}: {where} has a vocabulary of {vocab} token ids")
    use_vocab = cfg.vocab or vocab or FALLBACK_VOCAB
    if use_vocab <= 10:
        raise UserError(
            f"--vocab: prompt ids are drawn from [10, vocab), so it must be > 10, got {use_vocab}"
            + ("" if cfg.vocab else f" (the vocabulary of {where})")
        )
    prompt, output = cfg.prompt_len, cfg.output_len
    if max_model_len:
        if prompt is None:
            prompt = Lengths.parse(str(max(1, min(DEFAULT_LEN, max_model_len // 2))), "--prompt-len")
        if prompt.hi >= max_model_len:
            raise UserError(
                f"--prompt-len {prompt.spec}: {where} takes prompts of at most {max_model_len - 1} "
                f"tokens (max_model_len {max_model_len})"
            )
        if output is None:
            output = Lengths.parse(str(min(DEFAULT_LEN, max_model_len - prompt.hi)), "--output-len")
        if prompt.hi + output.hi > max_model_len:
            raise UserError(
                f"--prompt-len {prompt.spec}, --output-len {output.spec}: the longest request "
                f"({prompt.hi} + {output.hi} tokens) exceeds the max_model_len {max_model_len} of {where}"
            )
    default = Lengths.parse(str(DEFAULT_LEN), "--prompt-len")
    return replace(cfg, vocab=use_vocab, prompt_len=prompt or default, output_len=output or default)


def workload(cfg: BenchConfig) -> list[tuple[list[int], int]]:
    """The (prompt token ids, output length) of every request: the same at every rate (cfg as
    `fit` returns it)."""
    rng = random.Random(cfg.seed)
    return [
        ([rng.randrange(10, cfg.vocab) for _ in range(cfg.prompt_len.draw(rng))], cfg.output_len.draw(rng))
        for _ in range(cfg.num_requests)
    ]


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Offsets in seconds of n Poisson arrivals at `rate` per second (all 0 at rate inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _one(client, model: str, prompt: list[int], max_tokens: int, at: float, t0: float) -> RequestResult:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    res = RequestResult(len(prompt), max_tokens, start=time.perf_counter())
    last = None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                res.completion_tokens = chunk.usage.completion_tokens
            new = sum(len((c.model_extra or {}).get("token_ids") or []) for c in chunk.choices)
            if not new:
                continue
            now = time.perf_counter()
            if last is None:
                res.ttft = now - res.start
            else:
                res.itl.append(now - last)
            last = now
        res.e2e = time.perf_counter() - res.start
        res.ok = res.completion_tokens == max_tokens
        if not res.ok:
            res.error = f"{res.completion_tokens} tokens, asked for {max_tokens}"
    except Exception as e:  # a failed request is a result to count and show, not a crash
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def q(p):  # nearest rank
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))] * 1e3

    return {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "mean": sum(s) / len(s) * 1e3}


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration else 0.0,
        "output_tokens_per_s": out_tokens / duration if duration else 0.0,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": _percentiles([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


async def _run_rate(client, model: str, cfg: BenchConfig, rate: float, work) -> dict:
    times = arrivals(rate, len(work), cfg.seed)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one(client, model, p, n, at, t0) for (p, n), at in zip(work, times)))
    return summarize(rate, list(results), time.perf_counter() - t0)


async def _bench(cfg: BenchConfig, progress: Callable[[str], None]) -> dict:
    import openai

    base = cfg.url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key=cfg.api_key, max_retries=0, timeout=cfg.timeout_s) as client:
        try:
            cards = (await client.models.list()).data
        except openai.APIError as e:
            raise UserError(f"{cfg.url}: cannot list the server's models: {e}") from None
        card = next((c for c in cards if c.id == cfg.model), None) if cfg.model else (cards[0] if cards else None)
        if card is None:
            raise UserError(
                f"--model: {cfg.url} serves {', '.join(c.id for c in cards) or 'no model'}"
                + (f", not {cfg.model!r}" if cfg.model else "")
            )
        model, extra = card.id, card.model_extra or {}
        cfg = fit(cfg, _count(extra.get("vocab_size")), _count(extra.get("max_model_len")), f"{cfg.url} ({model})")
        progress(
            f"{model}: prompt ids from [10, {cfg.vocab}), prompts {cfg.prompt_len.spec} and outputs "
            f"{cfg.output_len.spec} tokens"
        )
        work = workload(cfg)
        rows = []
        for rate in cfg.rates:
            progress(f"rate {rate} req/s: {len(work)} requests")
            rows.append(await _run_rate(client, model, cfg, rate, work))
    config = asdict(cfg) | {
        "prompt_len": cfg.prompt_len.spec,
        "output_len": cfg.output_len.spec,
        "rates": [("inf" if math.isinf(r) else r) for r in cfg.rates],
        "api_key": None,
    }
    return {"model": model, "config": config, "results": rows}


def _count(v) -> int | None:
    """A positive integer the server reported, else None (not reported, or not a count)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def check(cfg: BenchConfig) -> None:
    if not cfg.rates or any(not (r > 0) for r in cfg.rates):
        raise UserError(f"--rate: request rates must be > 0 (inf: all at once), got {cfg.rates}")
    if cfg.num_requests < 1:
        raise UserError(f"--num-requests must be >= 1, got {cfg.num_requests}")
    if cfg.vocab is not None and cfg.vocab <= 10:
        raise UserError(f"--vocab: prompt ids are drawn from [10, vocab), so it must be > 10, got {cfg.vocab}")


def run(cfg: BenchConfig, progress: Callable[[str], None] = lambda _: None) -> dict:
    check(cfg)
    return asyncio.run(_bench(cfg, progress))


def run_offline(cfg: BenchConfig, artifact, **engine_kwargs) -> tuple[dict, BenchConfig]:
    """The same requests (workload(cfg), fitted to the artifact) through dsc.LLM in this process,
    all at once: the throughput the server's saturated rate is compared with (what the HTTP layer
    costs). Returns the result row and the config it ran."""
    from dsc.runtime.llm import LLM, SamplingParams

    llm = LLM(artifact, **engine_kwargs)
    try:
        cfg = fit(cfg, llm.engine.vocab_size, llm.engine.max_model_len, str(artifact))
        work = workload(cfg)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
        llm.generate([p for p, _ in work[:2]], params[:2])  # warm-up: first-step costs out of the timing
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params)
        duration = time.perf_counter() - t0
    finally:
        llm.engine.shutdown()
    done = [(len(p), len(o.outputs[0].token_ids)) for (p, n), o in zip(work, outs) if len(o.outputs[0].token_ids) == n]
    return {
        "rate": "offline",
        "requests": len(work),
        "completed": len(done),
        "failed": len(work) - len(done),
        "duration_s": duration,
        "requests_per_s": len(done) / duration,
        "output_tokens_per_s": sum(n for _, n in done) / duration,
        "total_tokens_per_s": sum(a + b for a, b in done) / duration,
        "ttft_ms": _percentiles([]),
        "itl_ms": _percentiles([]),
        "e2e_ms": _percentiles([]),
        "errors": [],
    }, cfg


def compare_offline(res: dict) -> None:
    """res["http_over_offline"]: the best HTTP rate's output tokens/s over the offline run's."""
    http = [r["output_tokens_per_s"] for r in res["results"] if r["rate"] != "offline"]
    offline = [r["output_tokens_per_s"] for r in res["results"] if r["rate"] == "offline"]
    if http and offline and offline[0]:
        res["http_over_offline"] = max(http) / offline[0]


def render(res: dict) -> str:
    """The results as a table (rich, plain text)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"dsc bench-serve: {res['model']}, prompts {res['config']['prompt_len']}, "
        f"outputs {res['config']['output_len']} tokens"
    )
    for col in (
        "rate/s",
        "done",
        "fail",
        "req/s",
        "out tok/s",
        "tok/s",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "E2E p50/p90/p99 ms",
    ):
        t.add_column(col, justify="right")
    for r in res["results"]:
        t.add_row(
            str(r["rate"]),
            str(r["completed"]),
            str(r["failed"]),
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['total_tokens_per_s']:.1f}",
            *(_triple(r[k]) for k in ("ttft_ms", "itl_ms", "e2e_ms")),
        )
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(t)
    errors = sorted({e for r in res["results"] for e in r["errors"]})
    ratio = (
        f"saturated HTTP throughput / offline dsc.LLM: {res['http_over_offline']:.3f}\n"
        if "http_over_offline" in res
        else ""
    )
    return console.export_text() + ratio + "".join(f"error: {e}\n" for e in errors)


def _triple(p: dict) -> str:
    return "-" if p["p50"] is None else f"{p['p50']:.1f} / {p['p90']:.1f} / {p['p99']:.1f}"


def plot(res: dict, path: Path) -> str | None:
    """Latency against output throughput across the rates, to `path`; None when matplotlib is
    missing (the reason is returned instead of raising)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'dsc[bench]'): no PNG written"
    rows = [r for r in res["results"] if r["completed"] and r["rate"] != "offline"]
    x = [r["output_tokens_per_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (key, label), color in zip((("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")), ("C0", "C1", "C2")):
        for p, style in (("p50", "-o"), ("p99", "--x")):
            ax.plot(x, [r[key][p] for r in rows], style, color=color, label=f"{label} {p}")
    for xi, r in zip(x, rows):
        ax.annotate(f"{r['rate']}/s", (xi, r["e2e_ms"]["p50"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for r in res["results"]:
        if r["rate"] == "offline":
            ax.axvline(r["output_tokens_per_s"], color="gray", linestyle=":", label="offline dsc.LLM")
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{res['model']}: latency against throughput")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_json(res: dict, path: Path) -> None:
    path.write_text(json.dumps(res, indent=1, sort_keys=True, default=str) + "\n")
