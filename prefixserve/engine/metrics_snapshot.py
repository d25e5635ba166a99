"""The engine's /metrics figures as a snapshot the engine thread publishes and any thread reads.

Why a snapshot: the core's counters and RAM cache change only on the engine thread, under its step
lock. /metrics used to take that lock (waiting up to 2 s, on the event loop) for a consistent read;
a prefill step holds it for seconds, and the engine thread re-takes it back to back, so a waiter was
starved and every request on the server waited with it. The engine thread now copies the figures
at the end of each locked section (and before a request's final Delta leaves, so a client that saw
its request finish sees it counted), and readers take the last copy without waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixserve.engine.core import EngineCore


@dataclass(frozen=True)
class MetricsSnapshot:
    """The core's figures at one moment between mutations; replaced whole, never changed in place."""

    values: dict[str, float] = field(default_factory=dict)
    oldest_arrival: float | None = None  # the queue's oldest request's arrival (monotonic), None when empty


def take(core: EngineCore) -> MetricsSnapshot:
    """Copy what only the engine thread mutates. Call on the engine thread (microseconds)."""
    st = core.cache.stats()
    c = core.counters
    lookups = st.num_lookups or 0
    hits = st.num_full_hits + st.num_partial_hits
    values = {
        "cache_bytes": float(core.cache.num_bytes),
        "cache_max_bytes": float(core.cache.config.max_bytes),
        "cache_entries": float(core.cache.num_entries),
        "cache_lookups": float(lookups),
        "cache_full_hits": float(st.num_full_hits),
        "cache_partial_hits": float(st.num_partial_hits),
        "cache_misses": float(st.num_misses),
        "cache_hit_ratio": float(hits / lookups) if lookups else 0.0,
        "cache_insertions": float(st.num_insertions),
        "cache_evictions": float(st.num_evictions),
        "cache_evicted_bytes": float(st.num_evicted_bytes),
        "cache_logits_shed": float(st.num_logits_shed),  # entries that kept their KV, gave up their logits
        "cache_logits_shed_bytes": float(st.num_logits_shed_bytes),
        "cache_rejected_too_large": float(st.num_rejected_too_large),
        "requests": float(c.num_requests),
        "prompt_tokens": float(c.num_prompt_tokens),
        "cached_tokens": float(c.num_cached_tokens),
        "computed_prompt_tokens": float(c.num_computed_prompt_tokens),
        "completion_tokens": float(c.num_completion_tokens),
        "running": float(core.num_running()),  # waiting and queued: AsyncEngine.metrics (engine/admission.py)
        "exact_reuse": 1.0 if core.exact_reuse else 0.0,
        "reserved_session_bytes": float(core.scheduler.reserved_bytes),
        "refill_bytes": float(core.refills.nbytes()),
        "max_session_bytes": float(core.config.max_session_bytes),
        # per tier (docs/cache.md, "Metrics"): RAM's figures under their tier name
        "cache_ram_hits": float(hits),
        "cache_ram_bytes": float(core.cache.num_bytes),
        "cache_ram_evictions": float(st.num_evictions),
        "cache_ram_flushed": float(st.num_flushed),
    }
    return MetricsSnapshot(values, core.scheduler.oldest_arrival())


def read(core: EngineCore, snap: MetricsSnapshot, peak_requests: int) -> dict[str, float]:
    """The figures for /metrics from `snap`, plus what is read live: the peak (taken at submission,
    off the engine thread), the oldest wait (grows with the clock), the disk and Redis tiers
    (their writer/loader threads change them outside steps; each guards them with its own short lock)
    and the cache listener's counters."""
    out = dict(snap.values)
    out["peak_requests"] = float(peak_requests)  # most requests running + waiting at once since start
    out["oldest_wait_seconds"] = time.monotonic() - snap.oldest_arrival if snap.oldest_arrival is not None else 0.0
    if core.disk is not None:
        out.update({f"cache_{k}": v for k, v in core.disk.stats().items()})
    if core.shared is not None:
        out.update({f"cache_{k}": v for k, v in core.shared.stats().items()})
    if core.cache.listener is not None:  # the KV events' publisher (docs/gateway.md): its thread's counters
        out.update(core.cache.listener.stats())
    return out
