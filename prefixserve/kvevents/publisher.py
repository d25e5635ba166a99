"""KV events over ZMQ in vLLM's format (docs/gateway.md): the RAM cache's blocks as a gateway's
indexer (llm-d's KV-cache manager, vLLM-aware routers) reads them.

Wire form, as vLLM's ZmqEventPublisher sends it: a PUB socket; each message three frames, [topic,
sequence number (8 bytes big-endian, from 0), msgpack payload]; the payload an EventBatch, the array
[timestamp (float seconds), [events], data_parallel_rank], each event an array with its tag first
(blocks.py `wire`). Replay (when a replay endpoint is set): a ROUTER socket; a request [start sequence
(8 bytes big-endian)] from a REQ or DEALER socket gets one reply [seq, payload] per batch still
buffered from that sequence on, then [-1 (8 bytes, signed), b""].

Threads: the cache calls `stored` / `removed` / `cleared` on the engine thread, which only queues
the change (a bounded queue; when it is full the change is dropped and counted, never waited for).
One publisher thread owns the block tracker and both sockets: it turns changes into events, encodes
and sends them. A dropped change makes the announced set unreliable, so the thread then announces
the removal of every block it announced and starts over from the changes that follow (a subset of
the cache, never a block the cache lacks).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from prefixserve.cache.entry import Entry
from prefixserve.config import KVEventsConfig
from prefixserve.kvevents.blocks import AllBlocksCleared, BlockHasher, BlockTracker, KVEvent
from prefixserve.types import Namespace

log = logging.getLogger("prefixserve.kvevents")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last reply
REPLAY_POLL_S = 0.1  # how often the publisher thread looks for a replay request while idle
MAX_CHANGES_PER_BATCH = 4096  # cache changes turned into one EventBatch at most

_Change = tuple[str, Namespace, tuple[int, ...]]  # ("stored" | "removed", namespace, token ids); ("cleared", ...)


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` (else it connects to it): vLLM's rule, bound where
    the address has a wildcard ('*', '::') or is local (ipc://, inproc://)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int) -> bytes:
    """One EventBatch's msgpack payload."""
    return msgpack.packb([ts, [e.wire() for e in events], data_parallel_rank])


class KVEventPublisher:
    """A `cache.CacheListener` that publishes the cache's blocks (see the module docstring).

    Binds or connects its sockets in the constructor (raises zmq.ZMQError: a port in use is a start-up
    error) and starts its thread; `close` stops it. `stored`, `removed` and `cleared` never block."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[_Change | None] = queue.Queue(config.max_queue_size)
        self._num_dropped = 0  # written by the engine thread only
        self._num_seen_dropped = 0  # the publisher thread's last look at it
        self._tracker = BlockTracker(BlockHasher(config.hash_key, config.block_size))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._topic = config.topic.encode()
        self.num_batches = 0
        self.num_events = 0
        self.num_resyncs = 0
        self._ctx = zmq.Context()
        self._replay: zmq.Socket[bytes] | None = None
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(config.hwm)
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        # the sockets are the thread's from here on (ZMQ sockets are not thread-safe)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- the engine thread (cache.CacheListener) ----------------------------------------------

    def stored(self, entry: Entry[Any]) -> None:
        self._put(("stored", entry.namespace, entry.token_ids))

    def removed(self, entry: Entry[Any]) -> None:
        self._put(("removed", entry.namespace, entry.token_ids))

    def cleared(self) -> None:
        self._put(("cleared", Namespace("", ""), ()))

    # ---- any thread ---------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters for /metrics (docs/gateway.md): batches and events sent, cache changes dropped
        because the queue was full, restarts of the announced set after drops, changes waiting."""
        return {"kv_events_batches": float(self.num_batches), "kv_events_events": float(self.num_events),
                "kv_events_dropped_changes": float(self._num_dropped), "kv_events_resyncs": float(self.num_resyncs),
                "kv_events_queued_changes": float(self._queue.qsize())}

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued change has been published; False on timeout. For tests and close."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued (within `timeout`), stop the thread, close the sockets. Idempotent."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                log.warning("KV events: %d changes still queued at close, not published", self._queue.qsize())
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    # ---- the publisher thread -----------------------------------------------------------------

    def _put(self, change: _Change) -> None:
        try:
            self._queue.put_nowait(change)
        except queue.Full:
            self._num_dropped += 1

    def _run(self) -> None:
        self._send([AllBlocksCleared()])  # whatever an indexer holds for this topic is not ours
        wait = REPLAY_POLL_S if self._replay is not None else None
        while True:
            try:
                change = self._queue.get(timeout=wait)
            except queue.Empty:
                self._serve_replays()
                continue
            changes = [change]
            while change is not None and len(changes) < MAX_CHANGES_PER_BATCH:
                try:
                    change = self._queue.get_nowait()
                except queue.Empty:
                    break
                changes.append(change)
            try:
                self._send(self._events(changes))
            except Exception:  # a bug here must not stop the thread: the engine never waits on it
                log.exception("KV events: publishing a batch failed")
            finally:
                for _ in changes:
                    self._queue.task_done()
            self._serve_replays()
            if changes[-1] is None:
                return

    def _events(self, changes: list[_Change | None]) -> list[KVEvent]:
        events: list[KVEvent] = []
        for change in changes:
            if change is None:
                break
            kind, ns, token_ids = change
            if kind == "stored":
                event: KVEvent | None = self._tracker.stored(ns, token_ids)
            elif kind == "removed":
                event = self._tracker.removed(ns, token_ids)
            else:
                events += self._tracker.cleared()
                continue
            if event is not None:
                events.append(event)
        dropped = self._num_dropped
        if dropped != self._num_seen_dropped:  # the tracker missed changes: withdraw all it announced
            log.warning("KV events: %d cache changes dropped (queue of %d full); announcing the set anew",
                        dropped - self._num_seen_dropped, self.config.max_queue_size)
            self._num_seen_dropped = dropped
            self.num_resyncs += 1
            events += self._tracker.cleared()
        return events

    def _send(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode_batch(time.time(), events, self.config.data_parallel_rank)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        if self.config.buffer_steps:
            self._buffer.append((seq, payload))
        self.num_batches += 1
        self.num_events += len(events)

    def _serve_replays(self) -> None:
        """Answer every replay request waiting (see the module docstring); a malformed one is logged."""
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            # [client, b"", seq] from a REQ socket (or a DEALER sending the empty delimiter first, as
            # vLLM's client does), [client, seq] from a DEALER sending the sequence alone: answered
            # in the envelope it came in
            if len(frames) not in (2, 3) or len(frames[-1]) != 8 or (len(frames) == 3 and frames[1]):
                log.warning("KV events: malformed replay request of %d frames", len(frames))
                continue
            envelope, first = tuple(frames[:-1]), int.from_bytes(frames[-1], "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((*envelope, END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
