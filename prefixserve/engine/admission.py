"""What counts as waiting and as queued, for `/health`, `/metrics` and `--max-queued-requests`
(docs/architecture.md, "Admission").

A request waits in two places before it runs: the inbox (handed over by the event loop; the engine
thread takes it in between two steps, so arrivals during a prefill step of seconds stay there) and the
core's queue. It is *waiting* in either. It is *queued* only if the next admission would not start it:
admission (EngineCore._admit) starts requests in `FairShare` order while a session slot is free
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
from typing import TYPE_CHECKING

from prefixserve.cache import Hit
from prefixserve.engine.session import Phase, Session, kv_bytes_needed, slots_needed
from prefixserve.types import Overloaded, Request, lcp

if TYPE_CHECKING:
    from prefixserve.engine.core import EngineCore
    from prefixserve.engine.grammar import TokenMatcher

RETRY_AFTER_S = 2  # a 429's Retry-After: about one step
FOLLOW_MIN_TOKENS = 64  # a request waits for a prompt under way only to be served at least this many more tokens


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


def follows(core: EngineCore, s: Session) -> bool:
    """Whether `s` should wait for a prompt being prefilled in its own namespace instead of starting:
    once that prompt is computed its entry serves `s` at least `FOLLOW_MIN_TOKENS` more tokens than the
    cache does now, and those are at least half of what the leader has left to compute (so the wait is
    mostly the tokens `s` would compute anyway). A burst of requests opening with one new system prompt
    computes it once, not once each: the first prefills, the others start as its prefill ends and hit
    it (the learning sequence, in a burst). Never across namespaces: another tenant's or salt's prompts
    cannot delay a request, so waiting tells nothing about them. Shared prefixes are memoised per
    leader (`Session.shared_with`); the cache is asked only when one is long enough."""
    req = s.request
    if not core._reuses(req) or core.cache.config.max_bytes == 0:
        return False
    have = -1
    for r in core.running:
        if r.phase is not Phase.PREFILL or r.request.namespace != req.namespace:
            continue
        shared = s.shared_with.get(r.request.request_id)
        if shared is None:
            shared = s.shared_with[r.request.request_id] = lcp(req.prompt_ids, r.request.prompt_ids)
        if shared < FOLLOW_MIN_TOKENS:
            continue
        if have < 0:
            hit = core.cache.peek(req.namespace, req.prompt_ids)
            have = hit.num_cached_tokens if isinstance(hit, Hit) else 0
        extra = shared - have
        if extra >= FOLLOW_MIN_TOKENS and 2 * extra >= r.prompt_len - r.num_computed:
            return True
    return False


def room(core: EngineCore) -> Room:
    """The core's room now. Call on the engine thread, between mutations."""
    per_token = core.runner.kv_bytes_per_token()
    return Room(
        num_running=core.num_running(),
        num_free_slots=core.config.max_num_seqs - sum(slots_needed(s) for s in core.running),
        num_free_bytes=core.config.max_session_bytes - core._reserved_bytes,
        # back from a lower tier's load (engine/disk_loads.py), a request holds its reservation already
        waiting=tuple(Waiting(s.request.request_id, kv_bytes_needed(s.request, core.max_model_len, per_token)
                              - s.reserved_bytes, slots_needed(s), s.request.namespace.tenant_id)
                      for s in core.fair.order(core.running, core.waiting)),
    )


def num_queued(room: Room, pending: Iterable[Waiting]) -> int:
    """Of the core's queue then `pending` (the inbox, in order): how many the next admission would
    leave waiting, as EngineCore._admit decides. Pure."""
    return _queued(room, [*room.waiting, *pending])


def _queued(room: Room, waiting: list[Waiting]) -> int:
    """`num_queued` of `waiting`: those of the core's queue still counted, then the inbox."""
    slots, free, running = room.num_free_slots, room.num_free_bytes, room.num_running > 0
    for k, w in enumerate(waiting):
        if slots <= 0 or (running and (w.need > free or w.slots > slots)):
            return len(waiting) - k
        slots, free, running = slots - w.slots, free - w.need, True
    return 0


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

    def take(self, core: EngineCore, request: Request, matcher: TokenMatcher | None = None) -> None:
        """Engine thread: move the inbox's oldest request into the core's queue (`EngineCore.add`, with
        its constraint's `matcher` compiled beforehand, not under the lock), then take it out of the inbox
        and publish the core's room with it, as one change for the readers: until then they count it in
        the inbox, after it in the core's queue. It leaves the inbox also when `EngineCore.add` raises."""
        rid = request.request_id
        try:
            core.add(request, matcher)
        finally:
            now = room(core)
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
