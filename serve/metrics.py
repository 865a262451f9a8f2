"""The server's Prometheus metrics, in a registry of its own (one per app, so that two servers
in one process, as in the tests, keep separate counts).

Latencies are measured where the client sees them begin and end: from the request's arrival
at the HTTP handler to its first token (TTFT), between a request's token deliveries (ITL), and
to its last token (E2E). Queue length, running requests and KV blocks are the engine's stats
after its latest step, read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds: a decode step on a GPU is milliseconds, a queued long prompt on a CPU is seconds
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)


class _EngineStats:
    """A collector over engine.stats() (dsc_num_requests_waiting, dsc_kv_blocks_used, ...)."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield _gauge("dsc_num_requests_waiting", "requests queued, not yet scheduled", s["num_waiting"])
        yield _gauge("dsc_num_requests_running", "requests the scheduler is running", s["num_running"])
        yield _gauge("dsc_kv_blocks_used", "KV-cache blocks in use", s["kv_blocks_used"])
        yield _gauge("dsc_kv_blocks_total", "KV-cache blocks in the pool", s["kv_blocks_total"])
        yield CounterMetricFamily(
            "dsc_prefix_cache_hit_tokens",
            "prompt tokens served from the prefix cache",
            value=s["prefix_cache_hit_tokens"],
        )
        if "offload_bytes_total" in s:
            yield CounterMetricFamily(
                "dsc_offload_bytes", "weight bytes streamed to the device (--offload)", value=s["offload_bytes_total"]
            )


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dsc_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"], registry=r
        )
        self.prompt_tokens = Counter("dsc_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("dsc_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "dsc_time_to_first_token_seconds", "arrival to first token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "dsc_inter_token_latency_seconds",
            "time between a request's token deliveries",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "dsc_e2e_request_latency_seconds", "arrival to last token", registry=r, buckets=_LATENCY_BUCKETS
        )
        r.register(_EngineStats(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
