"""What counts as waiting and as queued, for `/health`, `/metrics` and `--max-queued-requests`
(docs/architecture.md, "Admission").

A request waits in two places before it runs: the inbox (handed over by the event loop; the engine
thread takes it in between two steps, so arrivals during a prefill step of seconds stay there) and the
core's queue. It is *waiting* in either. It is *queued* only if the next admission would not start it:
admission (engine/scheduler.py `Scheduler.admit`) starts requests in `FairShare` order while a session slot is free
(`max_num_seqs`) and the prompt + max_tokens of KV fits the session bytes left (any size while nothing
runs), and stops at the first that does not fit, so every one behind it waits too. `--max-queued-requests`
bounds the queued ones: a burst that free slots will take at the next step is never refused. Past
the bound a request is refused if its tenant already has an even share of the bound waiting (the
bound divided among the tenants waiting), and at twice the bound whoever sends it: one tenant's
flood gets the 429s, not the others, whose requests then queue beyond the bound.

The order is fair between tenants: the next to start is the oldest request of the tenant with the
fewest sessions running, the one that started one least recently among equals. A tenant's burst
cannot hold another tenant's request back behind all of it; one tenant alone is served first come,
first served.

Race-free: the engine thread publishes the core's room whole (`Room`, immutable) after each change,
and takes a request out of the inbox in the same locked swap that publishes the room with it in the
core's queue (the work of queueing it, `EngineCore.add`, runs before, outside the lock; a constrained request's
grammar was compiled before it reached the inbox, on a worker thread). The lock is held only for such swaps and the event
loop's bookkeeping, never for work; `counts` reads the `Counts` each swap publishes, without it.
Between publications (a step of seconds) the room is the one before the step: the step's own
admissions were counted as starting, its finishes free room only after it.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prefixserve.engine.session import Session
from prefixserve.types import Overloaded, Request

if TYPE_CHECKING:
    from prefixserve.engine.grammar import TokenMatcher

RETRY_AFTER_S = 2  # a 429's Retry-After: about one step


@dataclass(frozen=True, slots=True)
class Waiting:
    """A request not started yet, as admission counts it."""

    request_id: str
    need: int  # the KV bytes it will reserve (beyond what it holds already: engine/session.py kv_bytes_needed)
    slots: int = 1  # the session slots it takes: its n
    tenant_id: str = ""


@dataclass(frozen=True, slots=True)
class Room:
    """The core's admission state at one moment between mutations; replaced whole, never changed."""

    num_running: int  # sessions running
    num_free_slots: int  # max_num_seqs - the slots running sessions take (a choice 0 not yet forked: its n)
    num_free_bytes: int  # max_session_bytes - the KV bytes admitted sessions reserved
    waiting: tuple[Waiting, ...] = ()  # the core's queue, in admission order


@dataclass(frozen=True, slots=True)
class Counts:
    num_waiting: int  # requests not started yet: in the core's queue or the inbox
    num_queued: int  # of those, the ones the next admission would not start (`--max-queued-requests` bounds them)


class FairShare:
    """The order in which waiting sessions start (the module docstring). Engine thread only."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # tenant -> the clock when one of its sessions last started
        self._clock = 0

    def order(self, running: Sequence[Session], waiting: Sequence[Session]) -> list[Session]:
        """`waiting` in the order admission tries them: those back from a lower tier's load first (they
        hold their reservation), then one at a time from the tenant with the fewest running, least
        recently started, oldest first."""
        if len(self._last) > 4096:  # remember only the tenants still here
            here = {s.request.namespace.tenant_id for s in (*running, *waiting)}
            self._last = {t: c for t, c in self._last.items() if t in here}
        first: list[Session] = []
        queues: dict[str, deque[Session]] = {}
        for s in waiting:
            if s.reserved_bytes:
                first.append(s)
            else:
                queues.setdefault(s.request.namespace.tenant_id, deque()).append(s)
        if len(queues) == 1:
            return [*first, *next(iter(queues.values()))]
        busy = Counter(s.request.namespace.tenant_id for s in running)
        last = {t: self._last.get(t, 0) for t in queues}
        out = first
        clock = self._clock
        while queues:
            tenant = min(queues, key=lambda t: (busy[t], last[t]))  # ties: dict order, the oldest head first
            out.append(queues[tenant].popleft())
            if not queues[tenant]:
                del queues[tenant]
            busy[tenant] += 1
            clock += 1
            last[tenant] = clock
        return out

    def started(self, s: Session) -> None:
        self._clock += 1
        self._last[s.request.namespace.tenant_id] = self._clock


def num_queued(room: Room, pending: Iterable[Waiting]) -> int:
    """Of the core's queue then `pending` (the inbox, in order): how many the next admission would
    leave waiting, as `Scheduler.admit` decides. Pure."""
    return _queued(room, [*room.waiting, *pending])


def _queued(room: Room, waiting: list[Waiting]) -> int:
    """`num_queued` of `waiting`: those of the core's queue still counted, then the inbox."""
    slots, free, running = room.num_free_slots, room.num_free_bytes, room.num_running > 0
    for k, w in enumerate(waiting):
        if slots <= 0 or (running and (w.need > free or w.slots > slots)):
            return len(waiting) - k
        slots, free, running = slots - w.slots, free - w.need, True
    return 0


class Queue(Protocol):
    """What `AdmissionQueue.take` moves a request into: the engine's own queue (EngineCore)."""

    def add(self, request: Request, matcher: TokenMatcher | None = None) -> None:
        """Queue a validated request (its constraint's `matcher` compiled beforehand, or None)."""
        ...

    def room(self) -> Room:
        """The admission state now (engine thread, between mutations)."""
        ...


class AdmissionQueue:
    """The inbox's requests and the core's published room, under one lock. The event loop calls
    `submit` and the readers; the engine thread `take` and `publish`."""

    def __init__(self, first: Room) -> None:
        self._lock = threading.Lock()
        self._room = first
        self._counts = Counts(len(first.waiting), _queued(first, list(first.waiting)))  # replaced whole, under the lock
        self._pending: dict[str, Waiting] = {}  # the inbox, in order, by request id
        # requests whose client left while they wait in the core's queue: the engine aborts them before
        # it admits again, so they count for nothing (a client's retry is not refused for its own timeout)
        self._gone: set[str] = set()
        # the most requests the engine held at once (running + waiting), since start: taken at each
        # submission, the only moment the count grows
        self.peak = 0

    def submit(self, request: Waiting, limit: int) -> None:
        """Count `request` into the inbox, or raise Overloaded (nothing counted) when it would make more
        than `limit` requests queued and its tenant has its share of `limit` waiting already, or more
        than twice `limit` (the module docstring)."""
        with self._lock:
            waiting = self._waiting()
            if (queued := _queued(self._room, [*waiting, request])) > limit:
                held = Counter(w.tenant_id for w in waiting)
                if queued > 2 * limit or held[request.tenant_id] >= max(1, limit // max(1, len(held))):
                    raise Overloaded(f"too many requests are queued ({limit} wait for a session slot or session "
                                     "memory, this key's share among the keys waiting); retry shortly",
                                     retry_after_s=RETRY_AFTER_S)
            self._pending[request.request_id] = request
            self.peak = max(self.peak, self._room.num_running + len(waiting) + 1)
            self._recount()

    def take(self, core: Queue, request: Request, matcher: TokenMatcher | None = None) -> None:
        """Engine thread: move the inbox's oldest request into the core's queue (`EngineCore.add`, with
        its constraint's `matcher` compiled beforehand, not under the lock), then take it out of the inbox
        and publish the core's room with it, as one change for the readers: until then they count it in
        the inbox, after it in the core's queue. It leaves the inbox also when `EngineCore.add` raises."""
        rid = request.request_id
        try:
            core.add(request, matcher)
        finally:
            now = core.room()
            with self._lock:
                if self._pending.pop(rid, None) is None and any(w.request_id == rid for w in now.waiting):
                    self._gone.add(rid)  # its client left while it was being queued: it counts no more
                self._publish(now)

    def forget(self, request_id: str) -> None:
        """Event loop: the client of `request_id` left before it finished; if it still waits it no longer
        counts (the engine's abort of it follows)."""
        with self._lock:
            if self._pending.pop(request_id, None) is None and any(w.request_id == request_id for w in self._room.waiting):
                self._gone.add(request_id)
            self._recount()

    def publish(self, now: Room) -> None:
        """Engine thread: the core's room after a change (a step, an abort)."""
        with self._lock:
            self._publish(now)

    def _publish(self, now: Room) -> None:
        self._room = now
        self._gone &= {w.request_id for w in now.waiting}
        self._recount()

    def _recount(self) -> None:
        """Publish the counts after a change. Under the lock."""
        waiting = self._waiting()
        self._counts = Counts(len(waiting), _queued(self._room, waiting))

    def counts(self) -> Counts:
        """What waits and what is queued, read together, as of the last change: never waits for the lock."""
        return self._counts

    def _waiting(self) -> list[Waiting]:
        """Every request still waiting, in admission order: the core's queue, then the inbox. Under the lock."""
        return [*(w for w in self._room.waiting if w.request_id not in self._gone), *self._pending.values()]
