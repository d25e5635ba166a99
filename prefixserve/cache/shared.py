"""The shared tier (L3) on Redis, read on a local miss by every replica (docs/cache.md, "Shared
tier"; key names and the value MAC: cache/shared_keys.py). The engine thread calls `find`, `offer`,
`flush`, `stats`; a writer thread and LOADER_THREADS loaders do the network IO outside `_lock`
(counters, job queue) and the Link's lock (connection health). Redis down, slow or full is a miss or
a dropped write, a rate-limited log line and a metric, never an error; after a failure the tier is
skipped for a back-off (0.25 s doubling to 8 s)."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

from prefixserve.cache.disk_format import CorruptFile, FileHeader, encode_file, read_file
from prefixserve.cache.entry import FlushResult
from prefixserve.cache.shared_delete import delete_keys, unwrite
from prefixserve.cache.shared_keys import (
    MAC_BYTES,
    MARK_TOKENS,
    add,
    key_space,
    mac,
    marker_keys,
    ns_prefix,
    scope_pattern,
)
from prefixserve.cache.shared_link import Link
from prefixserve.cache.tier import (
    Codec,
    Loaded,
    LoadFailed,
    TierCounters,
    TierKeys,
    WriteBehind,
    snapshot_kind,
    usable_len,
)
from prefixserve.config import SharedTierConfig
from prefixserve.types import FlushScope, Namespace, lcp

log = logging.getLogger("prefixserve.cache")  # constants below: docs/cache.md, "Shared tier"
MAX_PENDING_WRITES = 64  # values are whole states (MBs): more queued than this are dropped, counted
MAX_CANDIDATES = 8  # entry lengths probed per lookup, longest first
LOADER_THREADS = 4


@dataclass(slots=True)
class SharedCounters:
    num_present: int = 0  # writes skipped: the key was there already (another replica wrote it)


class SharedTier(WriteBehind):
    def __init__(self, config: SharedTierConfig, fingerprint: str, runtime: str, codec: Codec,
                 keys: TierKeys | None = None) -> None:
        """Connects lazily (a Redis down at start is a miss, like one that goes down later); starts the
        writer and loader threads. `keys` name namespaces and prefixes (None: under `config.secret`)."""
        self.config = config
        self.fingerprint = fingerprint
        self.runtime = runtime
        self.space = key_space(config.prefix, config.secret, fingerprint, runtime)  # cache/shared_keys.py
        self.keys = keys or TierKeys.from_secret(config.secret)
        self._codec = codec
        self._link = Link(config.url, config.timeout_s)
        self._redis = self._link.client
        self._lock = threading.Condition()
        self._c = TierCounters()
        self._s = SharedCounters()
        self._pending: deque[tuple[Namespace, tuple[int, ...], Any, int]] = deque()
        self._epoch = 0  # bumped by every flush; a write that straddles one is deleted when it lands
        self._flushes: list[tuple[int, FlushScope]] = []
        self._busy = False
        self._closed = False
        self._loader = ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="prefixserve-redis-load")
        self._writer = threading.Thread(target=self._write_loop, name="prefixserve-redis-write", daemon=True)
        self._writer.start()

    # ---- engine thread --------------------------------------------------------------------------

    def find(self, ns: Namespace, prompt: Sequence[int], min_tokens: int) -> Future[Loaded | LoadFailed] | None:
        """Start looking for the longest entry of `ns` whose key is a prefix of `prompt` and holds at
        least `min_tokens` tokens, read and verify it, on the loader thread. None when Redis is in
        back-off (no wait at all). The future never raises: a miss is LoadFailed."""
        if min_tokens > len(prompt) or not self._link.available():
            return None
        return self._loader.submit(self._find, ns, tuple(prompt), max(1, min_tokens))

    def offer(self, ns: Namespace, token_ids: tuple[int, ...], state: Any) -> bool:
        """Queue `state` (immutable from now on) to be written; False (counted) when the queue is full,
        Redis is in back-off or the tier is closed. Never blocks on IO."""
        with self._lock:
            if self._closed or len(self._pending) >= MAX_PENDING_WRITES or not self._link.available():
                self._c.num_dropped_writes += 1
                return False
            self._pending.append((ns, token_ids, state, self._epoch))
            self._lock.notify()
            return True

    def flush(self, scope: FlushScope) -> FlushResult:
        """Delete every value (and length index) of the namespaces `scope` selects, of every model, by
        SCAN over their key prefix; queued writes of them are dropped and one in flight is deleted when
        it lands. Redis in a back-off (not tried: a flush must not stall the engine thread a socket
        timeout each), unreachable or failing part way: what was deleted, `complete` False."""
        with self._lock:
            self._epoch += 1
            self._flushes.append((self._epoch, scope))
            self._pending = deque(j for j in self._pending if not scope.selects(j[0]))
        pattern = scope_pattern(self.config.prefix, self.keys, scope)
        num_entries = num_bytes = 0

        def scan_delete() -> bool:
            nonlocal num_entries, num_bytes
            batch: list[bytes] = []
            for key in self._redis.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    num_entries, num_bytes = add(delete_keys(self._redis, batch), (num_entries, num_bytes))
                    batch = []
            num_entries, num_bytes = add(delete_keys(self._redis, batch), (num_entries, num_bytes))
            return True

        complete = self._link.call("flush", scan_delete, False)
        with self._lock:
            self._c.num_flushed += num_entries
        return FlushResult(num_entries, num_bytes, complete)

    def stats(self) -> dict[str, float]:
        """Counters and gauges as `redis_*` (docs/cache.md, "Metrics"). No namespace appears."""
        rename = {"corrupt_files": "rejected_values", "stale_files": "stale_values"}  # values, not files
        with self._lock:
            out = {"redis_" + rename.get(n, n): float(getattr(self._c, f.name))
                   for f in fields(TierCounters) if (n := f.name.removeprefix("num_")) not in ("evictions",)}
            out.update({"redis_" + f.name.removeprefix("num_"): float(getattr(self._s, f.name))
                        for f in fields(SharedCounters)})
            out.update(redis_pending_writes=float(len(self._pending)), redis_up=float(self._link.up),
                       redis_errors=float(self._link.num_errors))
            return out

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (up to `timeout`), then stop both threads and the connections."""
        self._stop_threads(timeout)
        self._link.close()

    def check_integrity(self) -> None:
        """The queue is bounded, and no queued write belongs to a namespace flushed after it was queued."""
        with self._lock:
            assert len(self._pending) <= MAX_PENDING_WRITES
            for ns, _, _, epoch in self._pending:
                assert epoch <= self._epoch
                assert not any(e > epoch and scope.selects(ns) for e, scope in self._flushes), "flushed write queued"

    # ---- keys and values (pure) -----------------------------------------------------------------

    def key(self, ns: Namespace, token_ids: Sequence[int]) -> str:
        return f"{ns_prefix(self.space, self.keys, ns)}:{self.keys.tokens(token_ids)}"

    def encode(self, key: str, header: FileHeader, payload: bytes) -> bytes:
        body = encode_file(header, payload)
        return body + mac(self.config.secret, key, body)

    # ---- loader / writer threads ----------------------------------------------------------------

    def _find(self, ns: Namespace, prompt: tuple[int, ...], min_tokens: int) -> Loaded | LoadFailed:
        t0 = time.monotonic()
        with self._lock:
            self._c.num_lookups += 1
        base = ns_prefix(self.space, self.keys, ns)
        marks = range(MARK_TOKENS, len(prompt) + 1, MARK_TOKENS)

        def probe() -> list[Any]:  # one round trip: the length index and every marker on the prompt's path
            pipe = self._redis.pipeline(transaction=False)
            pipe.zrevrangebyscore(base + ":len", len(prompt), min_tokens, start=0, num=MAX_CANDIDATES)
            for k in marks:
                pipe.get(f"{base}:p:{self.keys.tokens(prompt[:k])}")
            return pipe.execute()

        got = self._link.call("lookup", probe, None)
        if got is None:
            return LoadFailed("Redis unavailable")
        # (tokens it serves at least, key, the token ids it must hold; None = its own, extending the prompt)
        found: list[tuple[int, str, tuple[int, ...] | None]] = [
            (n, self.key(ns, prompt[:n]), prompt[:n]) for n in sorted({int(x) for x in got[0]}, reverse=True)]
        deepest = max(((k, m) for k, m in zip(marks, got[1:], strict=True) if m), default=None)
        if deepest is not None and deepest[0] + MARK_TOKENS > min_tokens and deepest[1].startswith(base.encode()):
            # the lengths are the namespace's, most of them other prompts' (their GET finds nothing)
            found.append((deepest[0], deepest[1].decode(), None))
            found.sort(key=lambda c: c[0], reverse=True)  # stable: a length beats a marker at equal depth
        failed = LoadFailed("no usable entry")
        for _, key, token_ids in found:
            value: Any = self._link.call("read", lambda k=key: self._redis.get(k), None)  # type: ignore[misc]
            if value is None:
                continue  # evicted by Redis's LRU (its length or marker is still there), or Redis failed
            with self._lock:
                self._c.num_hits += 1
            result = self._verify(ns, key, token_ids, value)
            if isinstance(result, Loaded) and usable_len(
                    result.state, lcp(result.token_ids, prompt), len(prompt)) < min_tokens:
                result = LoadFailed("the entry serves too little of the prompt")  # shares too little, or hybrid
            if isinstance(result, LoadFailed):
                with self._lock:
                    self._c.num_load_failures += 1
                failed = result
                continue
            seconds = time.monotonic() - t0
            with self._lock:
                self._c.num_loads += 1
                self._c.load_seconds_total += seconds
                self._c.load_seconds_max = max(self._c.load_seconds_max, seconds)
            return Loaded(result.token_ids, result.state, seconds)
        return failed

    def _verify(self, ns: Namespace, key: str, token_ids: tuple[int, ...] | None, value: bytes) -> Loaded | LoadFailed:
        """The decoded state of `value` read under `key` (holding `token_ids`, or None: whatever tokens
        `key` names), or LoadFailed (the value is then deleted)."""
        body, tag = memoryview(value)[:-MAC_BYTES], value[-MAC_BYTES:]
        dns = self.keys.namespace(ns)
        try:
            if len(value) <= MAC_BYTES or not hmac.compare_digest(tag, mac(self.config.secret, key, body)):
                raise CorruptFile("HMAC mismatch (tampered, or written under another secret)")
            header, payload = read_file(body)
            if header.fingerprint != self.fingerprint or header.runtime != self.runtime:
                return self._drop(key, "another model, dtype, kernel or runtime", stale=True)
            digests = (header.model_digest, header.tenant_digest, header.salt_digest)
            if digests != (dns.model_id, dns.tenant_id, dns.cache_salt) or key != self.key(ns, header.token_ids) or (
                    token_ids is not None and header.token_ids != token_ids):
                raise CorruptFile("the value does not hold the entry it was found under")
            state = self._codec.decode(header.meta, payload, len(header.token_ids))
            if snapshot_kind(state) != (header.truncatable, header.points):
                raise CorruptFile("the value's state is not the kind its header names")
        except (CorruptFile, ValueError, RuntimeError) as e:
            with self._lock:
                self._c.num_corrupt_files += 1
            return self._drop(key, str(e), stale=False)
        return Loaded(header.token_ids, state, 0.0)

    def _drop(self, key: str, reason: str, *, stale: bool) -> LoadFailed:
        if stale:
            with self._lock:
                self._c.num_stale_files += 1
        self._link.warn("redis tier: dropping a value: %s", reason)
        self._link.call("delete", lambda: self._redis.delete(key), None)
        return LoadFailed(reason)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                job = self._take_write()
                if job is None:
                    return
                ns, token_ids, state, epoch = job
                self._busy = True
            try:
                self._write(ns, token_ids, state, epoch)
            except Exception:  # a bug in encoding: this entry is not shared; serving goes on
                log.exception("redis tier: encoding a value failed")
            with self._lock:
                self._busy = False
                if not self._pending:
                    self._flushes.clear()
                self._lock.notify_all()

    def _write(self, ns: Namespace, token_ids: tuple[int, ...], state: Any, epoch: int) -> None:
        key = self.key(ns, token_ids)
        if self._link.call("write", lambda: self._redis.exists(key), None) != 0:  # present, or Redis failed
            with self._lock:
                self._s.num_present += 1
            return
        dns = self.keys.namespace(ns)
        meta, payload = self._codec.encode(state)
        header = FileHeader(self.runtime, self.fingerprint, dns.model_id, dns.tenant_id, dns.cache_salt, token_ids,
                            bool(state.has_logits), meta, len(payload), *snapshot_kind(state))
        value = self.encode(key, header, payload)

        markers = marker_keys(self.space, self.keys, ns, token_ids)

        def send() -> bool:
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(key, value)
            for marker in markers:  # this entry extends that prefix
                pipe.set(marker, key)
            pipe.zadd(ns_prefix(self.space, self.keys, ns) + ":len", {str(len(token_ids)): len(token_ids)})
            pipe.execute()
            return True

        sent = self._link.call("write", send, False)
        with self._lock:
            flushed = any(e > epoch and scope.selects(ns) for e, scope in self._flushes)
            if sent and not flushed:
                self._c.num_writes += 1
                self._c.num_write_bytes += len(value)
            elif not sent:
                self._c.num_dropped_writes += 1
        if sent and flushed:  # flushed while being written: what this write added goes
            self._link.call("delete", lambda: unwrite(self._redis, key, markers, ns_prefix(self.space, self.keys, ns) + ":len", len(token_ids)), None)
