"""Per-request bookkeeping: latency histograms as deltas arrive, then exactly one `finish`, which
counts usage in the metrics and writes one record to the usage ledger (finished or aborted).

Usage is the engine's: the final Delta's `usage`. A request aborted before its final delta (the client
went away and its iterator was closed) is recorded with the last usage the engine reported, or, when
it reported none, with the prompt length we sent and the tokens we received, cached_tokens 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefixserve.server.operator.metrics import ServerMetrics
from prefixserve.types import Delta, Usage

logger = logging.getLogger("prefixserve.server")


class RequestTracker:
    """One generation request's latency and usage accounting. Not thread-safe (event loop only)."""

    def __init__(
        self,
        metrics: ServerMetrics,
        ledger: Any | None,
        *,
        request_id: str,
        tenant_id: str,
        model: str,
        prompt_len: int,
        http_id: str = "",
    ) -> None:
        self._metrics = metrics
        self.http_id = http_id  # the response's x-request-id (server/middleware.py), for log lines
        self._ledger = ledger
        self.request_id = request_id
        self.tenant_id = tenant_id
        self.model = model
        self.prompt_len = prompt_len
        self.start = time.perf_counter()
        self.created = time.time()
        self._last_token_at: float | None = None
        self._num_tokens_seen = 0
        self._last_usage: Usage | None = None
        self.usage: Usage | None = None  # set by finish
        self.finish_reason: str | None = None
        metrics.in_flight.inc()

    @property
    def finished(self) -> bool:
        return self.usage is not None

    def on_delta(self, delta: Delta) -> None:
        """Observe one delta: TTFT on the first token, inter-token latency after it."""
        if delta.token_ids:
            now = time.perf_counter()
            if self._last_token_at is None:
                self._metrics.ttft.observe(now - self.start)
            else:
                self._metrics.itl.observe(now - self._last_token_at)
            self._last_token_at = now
            self._num_tokens_seen += len(delta.token_ids)
        if delta.usage is not None:
            self._last_usage = delta.usage

    def finish(self, finish_reason: str, usage: Usage | None = None) -> Usage:
        """Record the request once; later calls return the first result and do nothing else."""
        if self.usage is not None:
            return self.usage
        if usage is None:
            usage = self._last_usage or Usage(
                prompt_tokens=self.prompt_len, completion_tokens=self._num_tokens_seen, cached_tokens=0
            )
        self.usage = usage
        self.finish_reason = finish_reason
        self._metrics.in_flight.dec()
        self._metrics.observe_finished(usage, finish_reason)
        if self._ledger is not None:
            self._record(self._ledger, usage, finish_reason)
        return usage

    def discard(self) -> None:
        """The engine never served the request (e.g. it raised PromptTooLong): count nothing."""
        if self.usage is None:
            self.usage = Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0)
            self._metrics.in_flight.dec()

    def _record(self, ledger: Any, usage: Usage, finish_reason: str) -> None:
        try:
            from prefixserve.ledger import UsageRecord

            ledger.record(
                UsageRecord(
                    request_id=self.request_id,
                    tenant_id=self.tenant_id,
                    model=self.model,
                    prompt_tokens=usage.prompt_tokens,
                    cached_tokens=usage.cached_tokens,
                    completion_tokens=usage.completion_tokens,
                    finish_reason=finish_reason,
                    created=self.created,
                )
            )
        except Exception:  # the ledger must never fail a request
            logger.exception("could not record usage for %s", self.request_id)
