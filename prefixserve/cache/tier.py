"""What every lower cache tier shares (disk and Redis): how namespaces and keys are
named outside RAM (`TierKeys`), the runtime's codec, and the named results of a load. See docs/cache.md."""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from array import array
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class TierKeys:
    """How namespaces and token prefixes are named outside RAM (disk file names and headers, Redis
    keys and value headers): BLAKE2b-128 keyed by `key`, never a tenant id, salt or bare token hash,
    so nobody without the key can test a guessed tenant, salt or prompt against a name. Tiers that
    hold the same key give the same names (replicas sharing a deployment secret share keys).
    `key`: 32 bytes, `from_secret(deployment secret)` or a data directory's own (cache/disk_io.py,
    `directory_key`)."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not 16 <= len(self.key) <= 64:  # BLAKE2b's key
            raise ValueError("a tier key is 16 to 64 bytes")

    @classmethod
    def from_secret(cls, secret: bytes) -> TierKeys:
        """The names' key under a deployment secret (kept apart from the secret's value MACs)."""
        return cls(hmac.new(secret, b"prefixserve tier names", hashlib.sha256).digest())

    def digest(self, kind: str, value: str) -> str:
        """A namespace component's name (`kind`: model, tenant or salt)."""
        return hashlib.blake2b(f"{kind}\0{value}".encode(), key=self.key, digest_size=16, person=b"ps-ns").hexdigest()

    def tokens(self, token_ids: Sequence[int]) -> str:
        """A token prefix's name."""
        data = array("i", token_ids).tobytes()
        return hashlib.blake2b(data, key=self.key, digest_size=16, person=b"ps-tokens").hexdigest()

    def namespace(self, ns: Namespace) -> Namespace:
        """`ns` with every component named by its digest (the disk index's and file headers' namespace)."""
        return Namespace(self.digest("model", ns.model_id), self.digest("tenant", ns.tenant_id),
                         self.digest("salt", ns.cache_salt))

    def ns_digest(self, dns: Namespace) -> str:
        """One name for a digest namespace (a disk file's first part)."""
        data = f"{dns.model_id}|{dns.tenant_id}|{dns.cache_salt}".encode()
        return hashlib.blake2b(data, key=self.key, digest_size=16, person=b"ps-space").hexdigest()

    def selects(self, scope: FlushScope, dns: Namespace) -> bool:
        """Whether a flush of `scope` reaches the digest namespace `dns`."""
        return (scope.tenant_id is None or dns.tenant_id == self.digest("tenant", scope.tenant_id)) and (
            scope.cache_salt is None or dns.cache_salt == self.digest("salt", scope.cache_salt))


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
