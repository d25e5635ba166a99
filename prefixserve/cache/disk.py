"""The disk tier (L2): entries written through to files off the engine thread, kept when RAM evicts
them, loaded back on a RAM miss, surviving restarts. Contracts and the file format: docs/cache.md.

Threads: the engine thread calls `lookup`, `load`, `offer`, `flush`, `stats`; one writer thread
writes files; one loader thread reads them. Everything shared (the index, counters, the job queue)
is guarded by `_lock`; file IO and (de)serialisation run outside it. The index is a `PrefixCache`
over digest namespaces whose states are `DiskRef`s (bytes = file sizes), so the disk budget is the
same LRU as RAM's. Files are named and their headers' namespaces digested by `TierKeys` (keyed: the
deployment secret's, else the directory's own key, cache/disk_io.py `directory_key`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

from prefixserve.cache import disk_io
from prefixserve.cache.disk_format import CorruptFile, FileHeader, encode_file, read_file, read_header
from prefixserve.cache.disk_io import WriteHealth, create_private, fsync_dir, make_private, remove
from prefixserve.cache.entry import Entry, FlushResult, Hit
from prefixserve.cache.prefix_cache import PrefixCache
from prefixserve.cache.tier import (
    Codec,
    Loaded,
    LoadFailed,
    TierCounters,
    TierKeys,
    WriteBehind,
    snapshot_kind,
)
from prefixserve.config import CacheConfig
from prefixserve.types import FlushScope, Namespace

log = logging.getLogger("prefixserve.cache")
SUFFIX = ".kv"
MAX_PENDING_WRITES = 256  # more queued than this: new offers are dropped (counted), never block

@dataclass(frozen=True, slots=True)
class DiskRef:
    """A file's place in the disk index (implements CachedState)."""

    path: str
    num_tokens: int
    has_logits: bool
    nbytes: int
    truncatable: bool = True  # False: a hybrid file, serving its length and resume points only
    resume_points: tuple[int, ...] = ()

    def storage(self) -> list[tuple[Hashable, int]]:
        return [(self.path, self.nbytes)]


class DiskTier(WriteBehind):
    def __init__(self, directory: str, max_bytes: int, fingerprint: str, runtime: str, codec: Codec,
                 keys: TierKeys | None = None) -> None:
        """Check `directory` (created 0700; docs/cache.md, "Privacy") and scan it: keep intact files of
        this fingerprint and runtime named under `keys` (None: the directory's own key), remove the
        rest, evict LRU (by mtime) over `max_bytes`. Starts the writer and loader threads."""
        self.directory = directory
        self.fingerprint = fingerprint
        self.runtime = runtime
        self._codec = codec
        self._index: PrefixCache[DiskRef] = PrefixCache(CacheConfig(max_bytes=max_bytes))
        self._lock = threading.Condition()
        self._c = TierCounters()
        self._pending: deque[tuple[Namespace, tuple[int, ...], Any, int]] = deque()
        self._epoch = 0  # bumped by every flush; a write that straddles one is re-checked
        self._flushes: list[tuple[int, FlushScope]] = []
        self._closed = False
        self._health = WriteHealth(directory)  # failed writes (docs/cache.md, "Disk failures")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._health.check_directory()
        self.keys = keys or TierKeys(disk_io.directory_key(directory))
        self._scan()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="prefixserve-disk-load")
        self._writer = threading.Thread(target=self._write_loop, name="prefixserve-disk-write", daemon=True)
        self._writer.start()

    # ---- engine thread --------------------------------------------------------------------------

    def lookup(self, ns: Namespace, prompt: Sequence[int]) -> Hit[DiskRef] | None:
        """The disk entry serving the most of `prompt` (RAM's rules), or None. Touches its recency."""
        with self._lock:
            self._c.num_lookups += 1
            if self._index.num_entries == 0:
                return None
            hit = self._index.lookup(self.keys.namespace(ns), prompt)
            if not isinstance(hit, Hit):
                return None
            self._c.num_hits += 1
            return hit

    def load(self, hit: Hit[DiskRef]) -> Future[Loaded | LoadFailed]:
        """Read, verify and decode `hit`'s file on the loader thread. The entry is pinned meanwhile
        (not evicted; a flush still forgets it). A corrupt file is dropped, logged and counted."""
        with self._lock:
            self._index.pin(hit.entry)
        return self._loader.submit(self._load, hit.entry)

    def offer(self, ns: Namespace, token_ids: tuple[int, ...], state: Any) -> bool:
        """Queue `state` (immutable from now on, as a cache entry is) to be written; False if the queue
        is full, the tier is closed, or writes are failing (WriteHealth.refuses). Never blocks on IO."""
        with self._lock:
            if (self._closed or len(self._pending) >= MAX_PENDING_WRITES
                    or self._health.refuses(bool(self._pending) or self._busy)):
                self._c.num_dropped_writes += 1
                return False
            self._pending.append((ns, token_ids, state, self._epoch))
            self._lock.notify()
            return True

    def flush(self, scope: FlushScope) -> FlushResult:
        """Forget (and delete the files of) every entry of the namespaces `scope` selects, queued
        writes included; a write in progress is deleted when it lands."""
        with self._lock:
            self._epoch += 1
            self._flushes.append((self._epoch, scope))
            self._pending = deque(j for j in self._pending if not scope.selects(j[0]))
            gone = [_path_of(e) for e in self._index.entries() if self.keys.selects(scope, e.namespace)]
            result = self._index.flush(lambda dns: self.keys.selects(scope, dns))
            self._c.num_flushed += result.num_entries
        remove(gone)
        return result

    def stats(self) -> dict[str, float]:
        """Counters and gauges as `disk_*` (docs/cache.md, "Metrics"). No namespace appears."""
        with self._lock:
            out = {"disk_" + f.name.removeprefix("num_"): float(getattr(self._c, f.name))
                   for f in fields(TierCounters)}
            out.update(disk_bytes=float(self._index.num_bytes), disk_max_bytes=float(self._index.config.max_bytes),
                       disk_entries=float(self._index.num_entries), disk_pending_writes=float(len(self._pending)),
                       disk_write_failures=float(self._health.num_failures), disk_writable=float(not self._health.failing))
            return out

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to `timeout`), then stop both threads."""
        self._stop_threads(timeout)

    def check_integrity(self) -> None:
        """The index's invariants; every indexed file exists with its counted size."""
        with self._lock:
            self._index.check_integrity()
            for e in self._index.entries():
                assert os.path.getsize(_path_of(e)) == e.nbytes, f"{_path_of(e)} changed size"

    # ---- writer / loader threads ----------------------------------------------------------------

    _busy = False

    def _write_loop(self) -> None:
        """Ends only at close: a failed write is counted, logged and forgotten, its state released at
        once; after an OSError the queue too (docs/cache.md, "Disk failures")."""
        while True:
            with self._lock:
                job = self._take_write()
                if job is None:
                    return
                self._busy = True
            try:
                self._write_job(*job)
            except Exception as e:  # noqa: BLE001 - WriteHealth logs it; a read-only or full disk, a bug
                with self._lock:
                    self._health.failed(e)
                    if isinstance(e, OSError):  # the queued writes would fail too: hold none of them
                        self._c.num_dropped_writes += len(self._pending)
                        self._pending.clear()
            else:
                with self._lock:
                    self._health.ok()
            finally:
                job = None  # the state is released now, not when the next write comes
                with self._lock:
                    self._busy = False
                    if not self._pending:  # no write outstanding can predate a flush any more
                        self._flushes.clear()
                    self._lock.notify_all()

    def _write_job(self, ns: Namespace, key: tuple[int, ...], state: Any, epoch: int) -> None:
        dns = self.keys.namespace(ns)
        path = self._path(dns, key)
        with self._lock:
            held = self._index.get(dns, key)  # written already (with logits if these have them)
            if held is not None and (held.has_logits or not state.has_logits):
                return
        try:
            self._write(ns, dns, key, state, epoch, path)
        except BaseException:
            remove([path + ".tmp"])
            raise

    def _write(self, ns: Namespace, dns: Namespace, key: tuple[int, ...], state: Any, epoch: int, path: str) -> None:
        meta, payload = self._codec.encode(state)
        kind = snapshot_kind(state)
        header = FileHeader(self.runtime, self.fingerprint, dns.model_id, dns.tenant_id, dns.cache_salt, key,
                            bool(state.has_logits), meta, len(payload), *kind)
        data = encode_file(header, payload)
        tmp = path + ".tmp"
        with create_private(tmp) as f:  # mode 0600: every tenant's token ids are in it
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.directory)
        with self._lock:
            if any(e > epoch and scope.selects(ns) for e, scope in self._flushes):
                stale = [path]  # flushed while being written
            else:
                result = self._index.insert(dns, key, DiskRef(path, len(key), bool(state.has_logits), len(data), *kind))
                stale = [_path_of(e) for e in result.evicted]
                if not result.stored:  # refused; a kept entry of this key lost its file to the rename
                    stale.append(path)
                    if result.entry is not None:
                        self._index.discard(result.entry)
                self._c.num_evictions += len(result.evicted)
                self._c.num_writes += result.stored
                self._c.num_write_bytes += len(data) if result.stored else 0
        remove(stale)

    def _load(self, entry: Entry[DiskRef]) -> Loaded | LoadFailed:
        t0 = time.monotonic()
        ref = entry.state
        try:
            with open(ref.path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)  # read once, into memory the state keeps
                if f.readinto(data) != len(data):
                    raise CorruptFile("truncated while being read")
            header, payload = read_file(data)
            if header.token_ids != entry.token_ids or header.fingerprint != self.fingerprint:
                raise CorruptFile("the file does not hold the entry it was indexed as")
            state = self._codec.decode(header.meta, payload, len(header.token_ids))
            if snapshot_kind(state) != (ref.truncatable, ref.resume_points):  # never serve it at another length
                raise CorruptFile("the file's state is not the kind it was indexed as")
        except (CorruptFile, OSError, ValueError, RuntimeError) as e:
            corrupt = not isinstance(e, FileNotFoundError)
            if corrupt:
                log.warning("disk tier: dropping %s: %s", os.path.basename(ref.path), e)
            with self._lock:
                self._index.unpin(entry)
                self._c.num_load_failures += 1
                self._c.num_corrupt_files += corrupt
                if corrupt:
                    self._index.discard(entry)
            remove([ref.path] if corrupt else [])
            return LoadFailed(str(e))
        seconds = time.monotonic() - t0
        with self._lock:
            self._index.unpin(entry)
            self._c.num_loads += 1
            self._c.load_seconds_total += seconds
            self._c.load_seconds_max = max(self._c.load_seconds_max, seconds)
        return Loaded(entry.token_ids, state, seconds)

    def _path(self, dns: Namespace, key: tuple[int, ...]) -> str:
        return os.path.join(self.directory, f"{self.keys.ns_digest(dns)}-{self.keys.tokens(key)}{SUFFIX}")

    def _scan(self) -> None:
        found = []
        stale = 0
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.endswith(".tmp"):
                remove([path])  # a write cut short by a crash
            elif name.endswith(SUFFIX):
                try:
                    size = (st := os.stat(path)).st_size
                    make_private(path, st.st_mode)  # written before files were created 0600
                    with open(path, "rb") as f:
                        header = read_header(f, size)
                except (CorruptFile, OSError) as e:
                    log.warning("disk tier: dropping %s: %s", name, e)
                    self._c.num_corrupt_files += 1
                    remove([path])
                    continue
                dns = Namespace(header.model_digest, header.tenant_digest, header.salt_digest)
                if (header.fingerprint != self.fingerprint or header.runtime != self.runtime
                        or path != self._path(dns, header.token_ids)):  # another runtime, or another key's name
                    stale += 1
                    remove([path])
                    continue
                found.append((st.st_mtime, path, size, header, dns))
        if stale:  # one line, not one per file: an upgrade may retire every file at once
            log.warning("disk tier: removed %d files of another model, dtype, kernel, runtime or key", stale)
            self._c.num_stale_files += stale
        for _, path, size, h, dns in sorted(found):  # oldest first: the LRU order survives the restart
            ref = DiskRef(path, len(h.token_ids), h.has_logits, size, h.truncatable, h.points)
            result = self._index.insert(dns, h.token_ids, ref)
            remove([_path_of(e) for e in result.evicted] + ([] if result.stored else [path]))
        log.info("disk tier %s: %d entries, %d bytes", self.directory, self._index.num_entries, self._index.num_bytes)


def _path_of(entry: Entry[DiskRef]) -> str:
    assert isinstance(entry.state, DiskRef)
    return entry.state.path
