"""Prometheus metrics on the app's own CollectorRegistry (never the process-global one).

No label carries anything a tenant sent or holds: endpoints are a fixed set of route names, status is a
class ("2xx"), and cache figures are the engine's aggregates, read at scrape time.

Gateway signals: besides the prefixserve_* names, the scheduling gauges that cache- and load-aware
gateways read from vLLM- and SGLang-compatible servers are exported under those servers' names, with
the same meaning (Gateway API Inference Extension's model-server protocol; docs/cache.md, "Behind a
gateway"): `vllm:num_requests_waiting` / `sglang:num_queue_reqs` (requests not started yet),
`vllm:num_requests_running` / `sglang:num_running_reqs` (sessions running), and
`vllm:kv_cache_usage_perc`, `vllm:gpu_cache_usage_perc` and `sglang:token_usage` (the fraction of
--max-session-bytes reserved by running sessions, in [0, 1]: the KV that admission gives out, as
vLLM's counts the KV blocks its running requests hold; the prefix cache's own fill is
prefixserve_cache_usage_ratio). Each carries one label, `model_name`, the served model name.
There is no LoRA, so no `vllm:lora_requests_info`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixserve.engine.protocol import EngineClient
from prefixserve.types import Usage

logger = logging.getLogger("prefixserve.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/v1/usage", "/v1/cache", "/tokenize",
             "/detokenize", "/health", "/metrics")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# engine.metrics() keys exported under stable names (first key present wins), gauges or counters (_total)
_CACHE_FIGURES = {
    "prefixserve_cache_bytes": ("Bytes held by prefix cache entries", ("cache_bytes",), GaugeMetricFamily),
    "prefixserve_cache_entries": ("Prefix cache entries", ("cache_entries",), GaugeMetricFamily),
    "prefixserve_cache_evictions": (
        "Prefix cache entries evicted since start",
        ("evictions", "cache_evictions"),
        CounterMetricFamily,
    ),
    "prefixserve_cache_hit_ratio": ("Prefix cache lookups that hit", ("hit_ratio", "cache_hit_ratio"),
                                    GaugeMetricFamily),
}

# engine.metrics() keys that only grow, exported as counters (prefixserve_engine_<key>_total, so that
# rate() and increase() read them as Prometheus means); the other keys are gauges
_ENGINE_COUNTERS = frozenset({
    "requests", "prompt_tokens", "cached_tokens", "computed_prompt_tokens", "completion_tokens",
    "cache_lookups", "cache_full_hits", "cache_partial_hits", "cache_misses", "cache_insertions", "cache_evictions",
    "cache_evicted_bytes", "cache_logits_shed", "cache_logits_shed_bytes", "cache_rejected_too_large",
    "cache_ram_hits", "cache_ram_evictions", "cache_ram_flushed",
    "kv_events_batches", "kv_events_events", "kv_events_dropped_changes", "kv_events_resyncs",
})
# ... and the lower tiers' (cache_disk_<key>, cache_redis_<key>; cache/tier.py TierCounters and the rest)
_TIER_COUNTERS = frozenset({
    "lookups", "hits", "loads", "load_failures", "load_seconds_total", "corrupt_files", "stale_files",
    "rejected_values", "stale_values", "writes", "write_bytes", "dropped_writes", "write_failures", "evictions",
    "flushed", "present", "errors",
})

# help texts of engine.metrics() keys exported as prefixserve_engine_<key> (the others name their key)
_ENGINE_DOCS = {
    "requests": "Requests the engine has taken since start",
    "prompt_tokens": "Prompt tokens served since start, cached + computed (a request aborted mid-prefill "
                     "counts the tokens it reached, as its usage does)",
    "cached_tokens": "Prompt tokens served from the prefix cache since start",
    "computed_prompt_tokens": "Prompt tokens computed by prefill since start",
    "completion_tokens": "Tokens generated since start",
    "peak_requests": "Most requests running + waiting at once since start",
    "waiting": "Requests not started yet (the engine's queue and inbox)",
    "queued": "Waiting requests the next step cannot start; --max-queued-requests bounds them",
    "kv_events_dropped_changes": "Cache changes the KV events dropped: their queue was full (docs/gateway.md)",
    "kv_events_resyncs": "Times the KV events withdrew every announced block after dropped changes",
}


class ServerMetrics:
    """All of the server's metrics. Safe to call from the event loop; `render` reads the engine."""

    def __init__(self, engine: EngineClient | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "prefixserve_http_requests",
            "HTTP requests by endpoint and status class",
            ["endpoint", "status_class"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "prefixserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "prefixserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.completion_tokens = Counter("prefixserve_completion_tokens", "Generated tokens", registry=r)
        self.finished = Counter(
            "prefixserve_requests_finished",
            "Generation requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "prefixserve_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "prefixserve_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "prefixserve_requests_in_flight", "Generation requests being served", registry=r
        )
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        if engine is not None:
            r.register(_EngineCollector(engine, self))

    def observe_finished(self, usage: Usage, finish_reason: str) -> None:
        """Count one finished (or aborted) request's worker-truth usage."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.finished.labels(finish_reason).inc()
        self._num_prompt_tokens += usage.prompt_tokens
        self._num_cached_tokens += usage.cached_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def token_hit_ratio(self) -> float:
        n = self._num_prompt_tokens
        return self._num_cached_tokens / n if n else 0.0


def endpoint_label(path: str) -> str:
    """A fixed label per route: an unknown path never becomes a label value."""
    if path in ENDPOINTS:
        return path
    for route in ("/v1/models", "/v1/responses"):  # /v1/models/{name}, /v1/responses/{id}
        if path.startswith(route + "/"):
            return route
    return "other"


class _EngineCollector(Collector):
    """Reads engine.metrics() and engine.health() at scrape time."""

    def __init__(self, engine: EngineClient, server: ServerMetrics) -> None:
        self._engine = engine
        self._server = server

    def describe(self) -> list[Metric]:
        return []  # dynamic: the engine decides its keys

    def collect(self) -> Iterator[Metric]:
        try:
            values = dict(self._engine.metrics())
        except Exception:
            logger.exception("engine.metrics() failed")
            values = {}
        for name, (doc, keys, family) in _CACHE_FIGURES.items():
            value = next((values[k] for k in keys if k in values), None)
            if value is None and name == "prefixserve_cache_hit_ratio":
                value = _ratio(values)
            if value is not None:
                yield family(name, doc, value=float(value))
        yield GaugeMetricFamily(
            "prefixserve_cache_token_hit_ratio",
            "Cached prompt tokens / prompt tokens over finished requests",
            value=self._server.token_hit_ratio(),
        )
        for key in sorted(values):
            try:
                value = float(values[key])
            except (TypeError, ValueError):
                continue
            family = CounterMetricFamily if _is_counter(key) else GaugeMetricFamily
            yield family(f"prefixserve_engine_{_metric_name(key)}", _ENGINE_DOCS.get(key, f"engine.metrics()[{key!r}]"),
                         value=value)
        try:
            health = self._engine.health()
        except Exception:
            logger.exception("engine.health() failed")
            return
        yield GaugeMetricFamily(
            "prefixserve_num_requests_running", "Sessions running in the engine", value=health.num_running
        )
        yield GaugeMetricFamily(
            "prefixserve_num_requests_waiting", "Requests not started yet (the engine's queue and inbox)",
            value=health.num_waiting,
        )
        yield GaugeMetricFamily(
            "prefixserve_num_requests_queued",
            "Waiting requests the next step cannot start (no free session slot or session bytes); "
            "--max-queued-requests bounds them", value=health.num_queued,
        )
        yield from _gateway_gauges(self._engine.model_id, health.num_waiting, health.num_running, values)
        yield GaugeMetricFamily(
            "prefixserve_exact_reuse",
            "1 if the start-up self-test allows cross-request reuse",
            value=float(health.exact_reuse),
        )


# (vLLM name, SGLang name or None, help): the gauges gateways schedule by (module docstring)
_GATEWAY_WAITING = (("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
                    "Requests not started yet (the engine's queue and inbox)")
_GATEWAY_RUNNING = (("vllm:num_requests_running", "sglang:num_running_reqs"), "Sessions running in the engine")
_GATEWAY_KV = (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
               "Fraction of --max-session-bytes reserved by running sessions (1 = full; admission waits past it)")


def session_usage(values: dict[str, float]) -> float | None:
    """reserved_session_bytes / max_session_bytes clamped to [0, 1]; None where the engine reports neither."""
    reserved, budget = values.get("reserved_session_bytes"), values.get("max_session_bytes")
    if reserved is None or budget is None:
        return None
    return min(1.0, max(0.0, float(reserved) / float(budget))) if budget > 0 else 0.0


def _gateway_gauges(model_name: str, num_waiting: int, num_running: int,
                    values: dict[str, float]) -> Iterator[Metric]:
    """The vLLM / SGLang names of the scheduling gauges, labelled model_name (module docstring)."""
    figures: list[tuple[tuple[tuple[str, ...], str], float | None]] = [
        (_GATEWAY_WAITING, float(num_waiting)), (_GATEWAY_RUNNING, float(num_running)),
        (_GATEWAY_KV, session_usage(values))]
    for (names, doc), value in figures:
        if value is None:
            continue
        for name in names:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model_name], value)
            yield family
    cache_max = values.get("cache_max_bytes")
    if cache_max is not None and "cache_bytes" in values:
        yield GaugeMetricFamily(
            "prefixserve_cache_usage_ratio", "Prefix cache bytes / --cache-max-bytes (0 when caching is off)",
            value=min(1.0, float(values["cache_bytes"]) / float(cache_max)) if cache_max > 0 else 0.0)


def _ratio(values: dict[str, float]) -> float | None:
    for hits_key, misses_key in (("cache_hits", "cache_misses"), ("hits", "misses")):
        if hits_key in values and misses_key in values:
            total = float(values[hits_key]) + float(values[misses_key])
            return float(values[hits_key]) / total if total else 0.0
    return None


def _is_counter(key: str) -> bool:
    tier = key.removeprefix("cache_disk_").removeprefix("cache_redis_")
    return key in _ENGINE_COUNTERS or (tier != key and tier in _TIER_COUNTERS)


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_") or "unnamed"
