"""Prometheus metrics of the server (``GET /metrics``), one registry per app.

What the HTTP layer sees is recorded as it happens: requests by route and status, time to
first token, inter-token latency and request duration. What the engine knows is read from
:meth:`kvserve.Engine.stats` at each scrape (a custom collector), so the numbers can never
drift from the engine's own counters: prompt, cached-prompt, generated and computed tokens,
the K/V pool (usage ratio; blocks free, cached and used), the prefix hit rate, evictions,
preemptions, waiting and running sequences, and sessions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; CPU serving spans milliseconds (a cached prompt) to minutes (a long queue).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

Stats = Callable[[], "dict[str, float | int] | None"]

# engine.stats() key -> (metric name, help); counters get Prometheus' ``_total`` suffix.
_COUNTERS = {
    "prompt_tokens": ("kvserve_prompt_tokens", "Prompt tokens of admitted requests"),
    "cached_prompt_tokens": (
        "kvserve_cached_prompt_tokens",
        "Prompt tokens whose K/V was reused from the prefix cache",
    ),
    "generated_tokens": ("kvserve_generated_tokens", "Tokens generated"),
    "computed_tokens": (
        "kvserve_computed_tokens",
        "Tokens fed to the model (prompt tokens not reused, recomputation, generated tokens)",
    ),
    "evictions": ("kvserve_evictions", "Idle sessions whose K/V was reclaimed"),
    "preemptions": ("kvserve_preemptions", "Running sequences preempted for memory"),
    "session_misses": (
        "kvserve_session_misses",
        "Turns of an evicted session (its K/V recomputed, with prefix reuse)",
    ),
    "kv_blocks_evicted": (
        "kvserve_kv_blocks_evicted",
        "Cached K/V blocks reused for new data (dropped from the prefix index)",
    ),
}
_GAUGES = {
    "kv_usage": ("kvserve_kv_usage_ratio", "Share of K/V blocks referenced by live sequences"),
    "kv_blocks_total": ("kvserve_kv_blocks_total", "K/V blocks in the pool"),
    "prefix_hit_rate": (
        "kvserve_prefix_hit_rate",
        "Cached prompt tokens / prompt tokens since start",
    ),
    "waiting": ("kvserve_queue_depth", "Requests waiting for the engine (sequences)"),
    "running": ("kvserve_running", "Sequences running in the engine"),
    "sessions": ("kvserve_sessions", "Sessions held"),
    "decode_tok_s": ("kvserve_decode_tokens_per_second", "Generated tokens/s over the last 10 s"),
}


class _EngineCollector(Collector):
    def __init__(self, stats: Stats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        if st is None:  # the model is not loaded yet
            return
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(st.get(key, 0)))
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(st.get(key, 0)))
        total = int(st["kv_blocks_total"])
        used = int(st["kv_blocks_used"])
        cached = int(st["kv_blocks_cached"])
        blocks = GaugeMetricFamily(
            "kvserve_kv_blocks", "K/V blocks by state (free, cached, used)", labels=["state"]
        )
        blocks.add_metric(["free"], float(total - used - cached))
        blocks.add_metric(["cached"], float(cached))
        blocks.add_metric(["used"], float(used))
        yield blocks


class Metrics:
    """The app's registry and the metrics the HTTP layer records."""

    def __init__(self, stats: Stats) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvserve_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds",
            "From a request's arrival to its first text (per choice)",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvserve_inter_token_latency_seconds",
            "Between successive pieces of text of one choice",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvserve_request_duration_seconds",
            "From a generation request's arrival to its last byte",
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
