"""Plain data of the usage ledger: one record per finished request, typed queries and their rows.

Nothing here touches SQLite or threads; everything is immutable and safe to share.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# Bucket widths the usage query accepts, in seconds (the names are OpenAI's).
BUCKET_WIDTHS: dict[str, int] = {"1m": 60, "1h": 3600, "1d": 86400}
# What a query may group by besides the time bucket.
GROUP_BY_FIELDS: tuple[str, ...] = ("model", "tenant_id")


class UsageQueryError(ValueError):
    """A usage query's parameter is missing or invalid: a client error (HTTP 400).

    `param` names the offending query parameter, as OpenAI's error object does.
    """

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one finished (or aborted) request consumed, as counted by the worker that served it.

    `tenant_id` is the tenant's id, never an API key. `cached_tokens` is the part of
    `prompt_tokens` served from the prefix cache (so 0 <= cached_tokens <= prompt_tokens).
    `request_id` must be unique for the life of the ledger file (server-generated, e.g. a uuid):
    re-recording an id is ignored, which is what makes retries and replays idempotent.
    `created` is unix seconds (float). Construction raises TypeError / ValueError on a wrong type or
    a broken invariant, so a bad record fails where it was made, not later on the writer thread.
    """

    request_id: str
    tenant_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        for name in ("request_id", "tenant_id", "model", "finish_reason"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string")
        if not self.request_id or not self.finish_reason:
            raise ValueError("request_id and finish_reason must not be empty")
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, not {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, not {value!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens must not exceed prompt_tokens")
        if not isinstance(self.created, (int, float)):
            raise TypeError("created must be unix seconds (a float)")
        if not math.isfinite(self.created):
            raise ValueError("created must be finite")


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Aggregate records with start_time <= created < end_time into fixed-width time buckets.

    Buckets are [origin + k * bucket_width_s, origin + (k + 1) * bucket_width_s); `origin`
    defaults to start_time (origin=0 gives UTC-aligned calendar minutes, hours and days).
    `tenant_ids` / `models` of None mean "all"; an empty tuple matches nothing.
    """

    start_time: int
    end_time: int
    bucket_width_s: int = BUCKET_WIDTHS["1d"]
    group_by: tuple[str, ...] = ()
    tenant_ids: tuple[str, ...] | None = None
    models: tuple[str, ...] | None = None
    origin: int | None = None

    def __post_init__(self) -> None:
        if self.end_time < self.start_time:
            raise ValueError("end_time must be >= start_time")
        if self.bucket_width_s < 1:
            raise ValueError("bucket_width_s must be >= 1")
        if any(g not in GROUP_BY_FIELDS for g in self.group_by):
            raise ValueError(f"group_by may only name {GROUP_BY_FIELDS}")
        if self.origin is not None and self.origin > self.start_time:
            raise ValueError("origin must be <= start_time")

    @property
    def bucket_origin(self) -> int:
        return self.start_time if self.origin is None else self.origin


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One aggregate: a time bucket, plus model / tenant when grouped by them (else None)."""

    bucket_start: int
    model: str | None
    tenant_id: str | None
    num_requests: int
    input_tokens: int  # prompt tokens, cached ones included (OpenAI's meaning)
    cached_tokens: int
    output_tokens: int
    cost_usd: float
