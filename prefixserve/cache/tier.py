"""What every lower cache tier shares (disk now, Redis in issue 16): how namespaces and keys are
named outside RAM, the runtime's codec, and the named results of a load. See docs/cache.md."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from prefixserve.types import FlushScope, Namespace


class Codec(Protocol):
    """The runtime's (de)serialisation of a cached state; the tier only moves bytes."""

    def encode(self, state: Any) -> tuple[dict[str, Any], bytes]: ...

    def decode(self, meta: dict[str, Any], payload: memoryview, num_tokens: int) -> Any: ...


@dataclass(frozen=True, slots=True)
class Loaded:
    token_ids: tuple[int, ...]
    state: Any  # the codec's decoded state
    seconds: float


@dataclass(frozen=True, slots=True)
class LoadFailed:
    reason: str


@dataclass(slots=True)
class TierCounters:
    """A lower tier's counters (metrics `disk_*` for the disk tier). Mutated under the tier's lock."""

    num_lookups: int = 0
    num_hits: int = 0  # lookups that found a usable file
    num_loads: int = 0  # files read back into RAM
    num_load_failures: int = 0
    num_corrupt_files: int = 0  # torn, truncated or bit-flipped files dropped
    num_stale_files: int = 0  # files of another model, dtype, kernel or runtime removed
    num_writes: int = 0
    num_write_bytes: int = 0
    num_dropped_writes: int = 0
    num_evictions: int = 0
    num_flushed: int = 0
    load_seconds_total: float = 0.0
    load_seconds_max: float = 0.0


def usable_len(state: Any, common: int, prompt_len: int) -> int:
    """How many tokens of a prompt (`prompt_len` tokens, sharing `common` with the key of `state`, a
    CachedState) a lower tier's entry may serve: `common` if truncatable; else the longest of its
    own length and its resume points within `common` (its own length equal to the prompt's only with
    logits), 0 if none (snapshot-only semantics, docs/hybrid.md)."""
    if getattr(state, "truncatable", True):  # a codec's state without it is a KV state
        return common
    ends = [*getattr(state, "resume_points", ()), state.num_tokens]
    return max((n for n in ends if n <= common and (n < prompt_len or state.has_logits)), default=0)


def snapshot_kind(state: Any) -> tuple[bool, tuple[int, ...]]:
    """(truncatable, resume points) of a codec's state, as a file header and the disk index keep them
    (a state without `truncatable` is a KV state)."""
    if getattr(state, "truncatable", True):
        return True, ()
    return False, tuple(getattr(state, "resume_points", ()))


def digest(kind: str, value: str) -> str:
    """A namespace component's name on disk: never the tenant id or salt itself."""
    return hashlib.sha256(f"prefixserve:{kind}\0{value}".encode()).hexdigest()[:32]


def disk_ns(ns: Namespace) -> Namespace:
    return Namespace(digest("model", ns.model_id), digest("tenant", ns.tenant_id), digest("salt", ns.cache_salt))


def ns_digest(dns: Namespace) -> str:
    return hashlib.sha256(f"{dns.model_id}|{dns.tenant_id}|{dns.cache_salt}".encode()).hexdigest()[:32]


def selects(scope: FlushScope, dns: Namespace) -> bool:
    return (scope.tenant_id is None or dns.tenant_id == digest("tenant", scope.tenant_id)) and (
        scope.cache_salt is None or dns.cache_salt == digest("salt", scope.cache_salt))


class WriteBehind:
    """The writer-thread lifecycle the disk and shared tiers share: writes queued in `_pending` under
    `_lock` (a Condition), sent by `_writer` (which sets `_busy` while one is in flight and exits once
    `_closed`), loads run on `_loader`. Subclasses create those attributes."""

    _lock: threading.Condition
    _pending: deque[Any]
    _busy: bool
    _closed: bool
    _writer: threading.Thread
    _loader: ThreadPoolExecutor

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued write has been done (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.05))
        return True

    def _take_write(self) -> Any | None:
        """The next queued write, waiting for one; None once closed with nothing left. The caller
        holds `_lock`."""
        while not self._pending and not self._closed:
            self._lock.wait()
        return self._pending.popleft() if self._pending else None

    def _stop_threads(self, timeout: float) -> None:
        """Do what is queued (up to `timeout`), then stop the writer and the loaders."""
        self.wait_idle(timeout)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._writer.join(timeout)
        self._loader.shutdown(wait=True)
