"""Prometheus metrics of the server (``GET /metrics``), one registry per app.

What the HTTP layer sees is recorded as it happens: requests by route and status, time to
first token (by priority class), inter-token latency and request duration. What the engine
knows is read from :meth:`kvserve.Engine.stats` and :meth:`kvserve.Engine.waiting_by_priority`
at each scrape (a custom collector), so the numbers can never drift from the engine's own
counters: prompt, cached-prompt (by source: the request's session or the prefix index),
generated and computed tokens, the K/V pool (usage ratio; blocks free, cached and used; the
same per layer group), the prefix cache (hit rates, lookups, hit tokens, shared and indexed
blocks), the K/V disk tier (blocks and tokens read back, misses, bytes read and written,
dropped writes, invalid and evicted entries, read time and count, entries and bytes held),
evictions, preemptions, waiting (by priority class) and running sequences, sessions, and the
K/V blocks each tenant holds (label values: the keys file's tenants).

Priority labels: a request's priority is an integer in [-1000, 1000]; a label per value
could make 2001 series per metric (and 17 per histogram), so the label is its *class*
(:func:`priority_label`): the value itself in [-9, 9], else the value rounded toward zero
to a power of ten (``"10"`` is 10..99, ``"-100"`` is -999..-100, ``"1000"`` is 1000). That
is 25 values at most, in the priorities' order, and exact for small schemes (0/1/2, -1/0/1).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "Metrics", "priority_label"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; CPU serving spans milliseconds (a cached prompt) to minutes (a long queue).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

Stats = Callable[[], "dict[str, float | int] | None"]
Waiting = Callable[[], "dict[int, int] | None"]
TenantKv = Callable[[], "dict[str, int] | None"]


def priority_label(priority: int) -> str:
    """The ``priority`` label of a request's priority: the value in [-9, 9], else the value
    rounded toward zero to a power of ten (42 -> "10", -250 -> "-100", 1000 -> "1000")."""
    if -9 <= priority <= 9:
        return str(priority)
    magnitude = 10 ** (len(str(abs(priority))) - 1)
    return str(magnitude if priority > 0 else -magnitude)


# engine.stats() key -> (metric name, help); counters get Prometheus' ``_total`` suffix.
_COUNTERS = {
    "prompt_tokens": ("kvserve_prompt_tokens", "Prompt tokens of admitted requests"),
    "cached_prompt_tokens": (
        "kvserve_cached_prompt_tokens",
        "Prompt tokens whose K/V was reused (a resident session's or the prefix index's)",
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
    "prefix_lookups": ("kvserve_prefix_lookups", "Lookups of prompts in the prefix index"),
    "prefix_hit_tokens": (
        "kvserve_prefix_hit_tokens",
        "Prompt tokens the prefix index mapped to cached blocks",
    ),
    "kv_disk_hit_blocks": (
        "kvserve_kv_disk_hit_blocks",
        "K/V blocks read back from the disk tier instead of recomputed",
    ),
    "kv_disk_hit_tokens": (
        "kvserve_kv_disk_hit_tokens",
        "Prompt tokens whose K/V was read back from the disk tier",
    ),
    "kv_disk_misses": (
        "kvserve_kv_disk_misses",
        "Disk tier lookups that found no valid entry (the prompt was computed from there)",
    ),
    "kv_disk_bytes_read": ("kvserve_kv_disk_read_bytes", "Bytes read from the K/V disk tier"),
    "kv_disk_bytes_written": (
        "kvserve_kv_disk_written_bytes",
        "Bytes written to the K/V disk tier",
    ),
    "kv_disk_writes_dropped": (
        "kvserve_kv_disk_writes_dropped",
        "K/V blocks not written to the disk tier (its write queue was full)",
    ),
    "kv_disk_removed": (
        "kvserve_kv_disk_invalid_entries",
        "Disk tier entries removed as invalid (torn, corrupt, another model or version)",
    ),
    "kv_disk_evicted": (
        "kvserve_kv_disk_evicted_entries",
        "Disk tier entries evicted to stay within its size (least recently used first)",
    ),
    "kv_disk_read_seconds": (
        "kvserve_kv_disk_read_seconds",
        "Seconds spent reading K/V blocks back from the disk tier (per block: divide by"
        " kvserve_kv_disk_hit_blocks_total)",
    ),
    "kv_remote_fetches": (
        "kvserve_kv_remote_fetches",
        "Requests that asked the shared K/V tier for blocks RAM and disk lacked",
    ),
    "kv_remote_hit_blocks": (
        "kvserve_kv_remote_hit_blocks",
        "K/V blocks fetched from the shared tier and mapped instead of recomputed",
    ),
    "kv_remote_hit_tokens": (
        "kvserve_kv_remote_hit_tokens",
        "Prompt tokens whose K/V came from the shared tier",
    ),
    "kv_remote_misses": (
        "kvserve_kv_remote_misses",
        "Fetches that met a block the shared tier lacked (the prompt was computed from there)",
    ),
    "kv_remote_invalid": (
        "kvserve_kv_remote_invalid",
        "Shared tier values that failed verification (another model or version, damaged)",
    ),
    "kv_remote_lost": (
        "kvserve_kv_remote_lost",
        "Shared tier blocks evicted between the existence check and the read",
    ),
    "kv_remote_bytes_read": (
        "kvserve_kv_remote_read_bytes",
        "Bytes read from the shared K/V tier",
    ),
    "kv_remote_bytes_written": (
        "kvserve_kv_remote_written_bytes",
        "Bytes written to the shared K/V tier",
    ),
    "kv_remote_writes_dropped": (
        "kvserve_kv_remote_writes_dropped",
        "K/V blocks not sent to the shared tier (queue full, store down)",
    ),
    "kv_remote_errors": (
        "kvserve_kv_remote_errors",
        "Shared K/V tier connection, protocol and timeout errors (requests recomputed)",
    ),
    "kv_remote_skipped_down": (
        "kvserve_kv_remote_skipped_down",
        "Fetches skipped while the shared tier rested after an error",
    ),
    "kv_remote_skipped_full": (
        "kvserve_kv_remote_skipped_full",
        "Fetches skipped while blocks staged for requests not yet admitted took their budget",
    ),
    "kv_remote_fetch_seconds": (
        "kvserve_kv_remote_fetch_seconds",
        "Seconds spent fetching from the shared K/V tier (per fetch: divide by"
        " kvserve_kv_remote_fetches_total)",
    ),
    "grammar_compiles": (
        "kvserve_grammar_compiles",
        "Structured-output grammars compiled (cache misses)",
    ),
    "grammar_compile_seconds": (
        "kvserve_grammar_compile_seconds",
        "Seconds spent compiling structured-output grammars",
    ),
    "grammar_masks": ("kvserve_grammar_masks", "Token masks computed for constrained rows"),
    "grammar_mask_seconds": (
        "kvserve_grammar_mask_seconds",
        "Seconds spent computing token masks (on a helper thread, during the forward passes)",
    ),
    "grammar_mask_wait_seconds": (
        "kvserve_grammar_mask_wait_seconds",
        "Seconds the engine thread waited for token masks after a pass (what did not overlap)",
    ),
}
_GAUGES = {
    "kv_usage": ("kvserve_kv_usage_ratio", "Share of K/V blocks referenced by live sequences"),
    "kv_blocks_total": ("kvserve_kv_blocks_total", "K/V blocks in the pool"),
    "prefix_hit_rate": (
        "kvserve_prefix_hit_rate",
        "Cached prompt tokens / prompt tokens since start",
    ),
    "prefix_hit_rate_recent": (
        "kvserve_prefix_hit_rate_recent",
        "Cached prompt tokens / prompt tokens of requests admitted in the last 60 s",
    ),
    "prefix_blocks_shared": (
        "kvserve_prefix_blocks_shared",
        "K/V blocks referenced by more than one sequence",
    ),
    "prefix_blocks_indexed": ("kvserve_prefix_blocks_indexed", "K/V blocks in the prefix index"),
    "waiting": ("kvserve_queue_depth", "Requests waiting for the engine (sequences)"),
    "running": ("kvserve_running", "Sequences running in the engine"),
    "sessions": ("kvserve_sessions", "Sessions held"),
    "decode_tok_s": ("kvserve_decode_tokens_per_second", "Generated tokens/s over the last 10 s"),
    "model_repacked_bytes": (
        "kvserve_model_repacked_bytes",
        "Bytes of weights the model copied at load in the decode kernels' layouts (beside its"
        " mapped file)",
    ),
    "kv_disk_entries": ("kvserve_kv_disk_entries", "K/V blocks held by the disk tier"),
    "kv_disk_bytes": ("kvserve_kv_disk_bytes", "Bytes held by the K/V disk tier"),
    "kv_disk_bytes_max": ("kvserve_kv_disk_bytes_max", "Size limit of the K/V disk tier"),
    "kv_remote_staged_bytes": (
        "kvserve_kv_remote_staged_bytes",
        "Bytes of blocks fetched from the shared K/V tier waiting for their requests' admission",
    ),
    "kv_remote_down": (
        "kvserve_kv_remote_down",
        "1 while the shared K/V tier rests after an error (fetches and writes skipped)",
    ),
}


# A layer group's stats: kv_<kind>_blocks_total (kind: full, window, recurrent, ...).
_GROUP_TOTAL = re.compile(r"^kv_([a-z]+)_blocks_total$")


class _EngineCollector(Collector):
    def __init__(self, stats: Stats, waiting: Waiting, tenant_kv: TenantKv | None) -> None:
        self._stats = stats
        self._waiting = waiting
        self._tenant_kv = tenant_kv

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        waiting = self._waiting()
        if st is None or waiting is None:  # the model is not loaded yet
            return
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(st[key]))
        by_source = CounterMetricFamily(
            "kvserve_cached_prompt_tokens_by_source",
            "Reused prompt tokens by where their K/V was: the request's resident session or"
            " the prefix index",
            labels=["source"],
        )
        for source in ("session", "prefix"):
            by_source.add_metric([source], float(st[f"cached_prompt_tokens_{source}"]))
        yield by_source
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(st[key]))
        yield _blocks(
            GaugeMetricFamily(
                "kvserve_kv_blocks", "K/V blocks by state (free, cached, used)", labels=["state"]
            ),
            [],
            st,
            "kv",
        )
        groups = [m.group(1) for key in st if (m := _GROUP_TOTAL.match(key))]
        usage = GaugeMetricFamily(
            "kvserve_kv_group_usage_ratio",
            "Share of a layer group's K/V blocks referenced by live sequences",
            labels=["group"],
        )
        totals = GaugeMetricFamily(
            "kvserve_kv_group_blocks_total", "K/V blocks of a layer group", labels=["group"]
        )
        blocks = GaugeMetricFamily(
            "kvserve_kv_group_blocks",
            "K/V blocks of a layer group by state (free, cached, used)",
            labels=["group", "state"],
        )
        for group in groups:
            usage.add_metric([group], float(st[f"kv_{group}_usage"]))
            totals.add_metric([group], float(st[f"kv_{group}_blocks_total"]))
            _blocks(blocks, [group], st, f"kv_{group}")
        yield usage
        yield totals
        yield blocks
        classes: dict[str, int] = {}
        for priority, n in waiting.items():
            label = priority_label(priority)
            classes[label] = classes.get(label, 0) + n
        by_priority = GaugeMetricFamily(
            "kvserve_waiting",
            "Sequences waiting for the engine, by priority class",
            labels=["priority"],
        )
        for label, n in sorted(classes.items(), key=lambda item: int(item[0])):
            by_priority.add_metric([label], float(n))
        yield by_priority
        held = self._tenant_kv() if self._tenant_kv is not None else None
        if held is not None:
            # Label values: the engine's tenants, i.e. the keys file's (0 while none held).
            by_tenant = GaugeMetricFamily(
                "kvserve_tenant_kv_blocks",
                "K/V blocks held by a tenant's running requests and idle sessions (estimate:"
                " ceil(tokens / block size) each)",
                labels=["tenant"],
            )
            for tenant, n in sorted(held.items()):
                by_tenant.add_metric([tenant], float(n))
            yield by_tenant


def _blocks(
    family: GaugeMetricFamily, labels: list[str], st: dict[str, float | int], prefix: str
) -> GaugeMetricFamily:
    """``family`` with the free, cached and used blocks of ``prefix``'s stats (``kv`` for the
    whole pool, ``kv_<kind>`` for a layer group; a group that caches nothing has no
    ``_blocks_cached``)."""
    total = int(st[f"{prefix}_blocks_total"])
    used = int(st[f"{prefix}_blocks_used"])
    cached = int(st.get(f"{prefix}_blocks_cached", 0))
    family.add_metric([*labels, "free"], float(total - used - cached))
    family.add_metric([*labels, "cached"], float(cached))
    family.add_metric([*labels, "used"], float(used))
    return family


class Metrics:
    """The app's registry and the metrics the HTTP layer records."""

    def __init__(self, stats: Stats, waiting: Waiting, tenant_kv: TenantKv | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvserve_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        # Per tenant (API keys file): label values are the configured tenant names, so the
        # cardinality is the file's; requests refused before a tenant is known (401) are not
        # attributed.
        self.tenant_requests = Counter(
            "kvserve_tenant_requests",
            "HTTP requests by tenant and status",
            ["tenant", "status"],
            registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "kvserve_tenant_tokens",
            "Tokens of a tenant's generation requests by kind: prompt, cached (of the prompt),"
            " generated",
            ["tenant", "kind"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds",
            "From a request's arrival to its first text (per choice), by priority class",
            ["priority"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvserve_inter_token_latency_seconds",
            "Between successive pieces of text of one choice",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.prefix_wait = Histogram(
            "kvserve_shared_prefix_wait_seconds",
            "Time a prompt waited in the queue for a shared prefix another request was"
            " computing (0 when it waited for none), per prompt",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvserve_request_duration_seconds",
            "From a generation request's arrival to its last byte",
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats, waiting, tenant_kv))

    def render(self) -> bytes:
        return generate_latest(self.registry)
