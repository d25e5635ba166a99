"""The scheduler: which sessions wait, run and are parked, the session memory they reserve, and which
prompt tokens each step feeds (docs/architecture.md, "Admission" and "Scheduling").

It owns the queue (`waiting`, started in `admission.FairShare`'s order), the running sessions, the
sessions parked while a lower tier loads their entry (`loads`, engine/disk_loads.py), the KV bytes
admitted sessions may grow to (`reserved_bytes`, bounded by `max_session_bytes`) and the suspects of a
failed batch (each runs alone until cleared: engine/control.py). Starting a session (its cache lookup
and copy) is not its work: `admit` calls the `start` it is given. The OutputProcessor tells it when
a session leaves (`stop_running`, `release`). Engine thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from prefixserve.cache import Hit, PrefixCache
from prefixserve.config import EngineConfig
from prefixserve.engine.admission import FairShare, Room, Waiting
from prefixserve.engine.disk_loads import DiskLoads
from prefixserve.engine.refill import TurnRefills
from prefixserve.engine.session import Phase, Session, Snapshot, kv_bytes_needed, slots_needed
from prefixserve.engine.step_record import Fail, guarded
from prefixserve.runner import ModelRunner
from prefixserve.types import Request, lcp

CHUNK_GRAIN = 64  # prompt chunks shrink in steps of this many tokens (the dense tile's rows)
LONG_CONTEXT_KEYS = 2048  # in a step shared with other sessions, a chunk deep in a long prompt does at most
SHARED_GRAIN = 16  # a quarter of the attention work of a full one at this many keys, down to this many rows
LONE_CONTEXT_KEYS = 8192  # alone in its step, at most the work of a full chunk at this many keys
FOLLOW_MIN_TOKENS = 64  # a request waits for a prompt under way only to be served at least this many more tokens


class Scheduler:
    """Queue, fairness, reservations and admission; the batch's prompt chunks. `refills` are the cache
    writer's pending turn refills: they share the session budget, so admission sheds them (never waits
    for them) to make room."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, cache: PrefixCache[Snapshot], loads: DiskLoads,
                 refills: TurnRefills, max_model_len: int, exact_reuse: bool) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.exact_reuse = exact_reuse  # False: the self-test failed, so never reuse across requests
        self.loads = loads  # sessions parked on a lower tier's load
        self.waiting: deque[Session] = deque()  # in arrival order; started in FairShare's
        self.running: list[Session] = []
        self._runner = runner
        self._cache = cache  # read only: `follows` peeks at it
        self._refills = refills
        self._fair = FairShare()
        self._reserved_bytes = 0  # KV bytes admitted sessions may grow to (max_session_bytes bounds it)
        self._suspects: list[Session] = []  # sessions of a failed batch, run alone until cleared

    # ---- the queue -----------------------------------------------------------------------------

    def queue(self, s: Session) -> None:
        """Put a new session at the back of the queue."""
        self.waiting.append(s)

    def unqueue(self, s: Session) -> None:
        """Take `s` out of the queue (no-op where it is not in it)."""
        if s in self.waiting:
            self.waiting.remove(s)

    def add_running(self, s: Session) -> None:
        """A session that runs from now on (an n > 1 fork: its reservation came with it)."""
        self.running.append(s)

    def stop_running(self, s: Session) -> None:
        """`s` finished: it runs no more (no-op where it did not run)."""
        if s in self.running:
            self.running.remove(s)

    def has_work(self) -> bool:
        """Requests to serve: waiting, running or parked on a load."""
        return bool(self.waiting or self.running or self.loads)

    def oldest_arrival(self) -> float | None:
        """The arrival (monotonic) of the queue's oldest request, None when the queue is empty."""
        return self.waiting[0].arrival if self.waiting else None

    def take(self, request_id: str) -> list[Session]:
        """The sessions of `request_id` to end for an abort, out of the queue or the loads: the queued
        one if it waits, else every running choice then a parked one. Running ones stay in `running`
        until they finish (`stop_running`)."""
        for s in self.waiting:
            if s.request.request_id == request_id:
                self.waiting.remove(s)
                return [s]
        found = [s for s in self.running if s.request.request_id == request_id]
        if (parked := self.loads.take(request_id)) is not None:
            found.append(parked)
        return found

    def take_all(self) -> list[Session]:
        """Every session held, to end them all: waiting, running, then parked (unparked now). The suspects
        are forgotten. Queued ones leave the queue as the caller ends each (`unqueue`)."""
        self._suspects = []
        return list(self.waiting) + list(self.running) + self.loads.take_all()

    def sessions(self) -> list[Session]:
        """Every session held: waiting, running, parked."""
        return [*self.waiting, *self.running, *self.loads.sessions()]

    # ---- the session budget ----------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        """The KV bytes admitted sessions may grow to."""
        return self._reserved_bytes

    def free_bytes(self) -> int:
        """What the session budget leaves beside the reservations (pending refills may hold some)."""
        return self.config.max_session_bytes - self._reserved_bytes

    def release(self, s: Session) -> None:
        """Free `s`'s reservation (it finished)."""
        if s.reserved_bytes:
            self._reserved_bytes -= s.reserved_bytes
            s.reserved_bytes = 0

    def room(self) -> Room:
        """The admission state now, for the inbox's counts (engine/admission.py). Between mutations."""
        per_token = self._runner.kv_bytes_per_token()
        return Room(
            num_running=len(self.running),
            num_free_slots=self.config.max_num_seqs - sum(slots_needed(s) for s in self.running),
            num_free_bytes=self.free_bytes(),
            # back from a lower tier's load (engine/disk_loads.py), a request holds its reservation already
            waiting=tuple(Waiting(s.request.request_id, kv_bytes_needed(s.request, self.max_model_len, per_token)
                                  - s.reserved_bytes, slots_needed(s), s.request.namespace.tenant_id)
                          for s in self._fair.order(self.running, self.waiting)),
        )

    # ---- admission -------------------------------------------------------------------------------

    def reuses(self, req: Request) -> bool:
        """Whether `req` may be served from any cache tier. Not where the self-test refused reuse, and
        not with prompt logprobs: they need the logits of every prompt position, which no entry holds."""
        return self.exact_reuse and req.sampling.prompt_logprobs is None

    def admit(self, start: Callable[[Session], None], fail: Fail) -> None:
        """Start waiting sessions in FairShare order while a session slot is free (`max_num_seqs`; n > 1
        takes n, any n while nothing runs) and their KV fits the bytes left (any size while nothing
        runs), stopping at the first that does not fit. One that `follows` a prompt under way keeps its
        place. Each admitted session reserves its KV, then is parked on a lower tier's load or runs and
        is handed to `start`. A fault in one session's admission ends its request (`fail`) only. Loaded
        sessions come back to the front first; afterwards the KV pool is trimmed to what the budget
        leaves (docs/operations.md, "Memory")."""
        if self.loads:  # loaded from disk: back to the front of the queue, their entries in RAM now
            self.waiting.extendleft(reversed(self.loads.ready(block=not self.running and not self.waiting)))
        cfg = self.config
        taken = sum(slots_needed(r) for r in self.running)
        for s in self._fair.order(self.running, self.waiting):
            if taken >= cfg.max_num_seqs or (self.running and taken + slots_needed(s) > cfg.max_num_seqs):
                break
            with guarded(fail, s):  # a fault in its admission ends its request only
                if self.follows(s):  # waits, in its place, for a prompt under way that will serve it
                    continue
                need = kv_bytes_needed(s.request, self.max_model_len, self._runner.kv_bytes_per_token()) - s.reserved_bytes
                if self.running and self._reserved_bytes + need > cfg.max_session_bytes:
                    break  # waits until running sessions finish and free their share
                self.waiting.remove(s)
                self._fair.started(s)
                s.reserved_bytes += need
                self._reserved_bytes += need
                self._refills.shed(self.free_bytes())  # before its KV is allocated
                if not (self.reuses(s.request) and self.loads.park(s)):
                    self.running.append(s)
                    start(s)
                taken += slots_needed(s)
        # pooled buffers (runner/state.py KVPool), pending turn refills and the admitted sessions' KV share
        # the session budget: the server's memory bound (docs/operations.md, "Memory") holds with the pool full
        self._runner.kv_pool.trim(self.free_bytes() - self._refills.nbytes())

    def follows(self, s: Session) -> bool:
        """Whether `s` should wait for a prompt being prefilled in its own namespace instead of starting:
        once that prompt is computed its entry serves `s` at least `FOLLOW_MIN_TOKENS` more tokens than
        the cache does now, and those are at least half of what the leader has left to compute (so the
        wait is mostly the tokens `s` would compute anyway). A burst of requests opening with one new
        system prompt computes it once, not once each. Never across namespaces: another tenant's or
        salt's prompts cannot delay a request. Shared prefixes are memoised per leader
        (`Session.shared_with`); the cache is asked only when one is long enough."""
        req = s.request
        if not self.reuses(req) or self._cache.config.max_bytes == 0:
            return False
        have = -1
        for r in self.running:
            if r.phase is not Phase.PREFILL or r.request.namespace != req.namespace:
                continue
            shared = s.shared_with.get(r.request.request_id)
            if shared is None:
                shared = s.shared_with[r.request.request_id] = lcp(req.prompt_ids, r.request.prompt_ids)
            if shared < FOLLOW_MIN_TOKENS:
                continue
            if have < 0:
                hit = self._cache.peek(req.namespace, req.prompt_ids)
                have = hit.num_cached_tokens if isinstance(hit, Hit) else 0
            extra = shared - have
            if extra >= FOLLOW_MIN_TOKENS and 2 * extra >= r.prompt_len - r.num_computed:
                return True
        return False

    # ---- the step's batch ------------------------------------------------------------------------

    def active(self) -> list[Session]:
        """The sessions this step may feed: the first unfinished suspect alone, else every running one."""
        self._suspects = [s for s in self._suspects if s.phase is not Phase.FINISHED]
        return self._suspects[:1] or list(self.running)

    def passed(self, s: Session) -> None:
        """`s` ran alone in a step that went through: it is no suspect any more."""
        self._suspects = [x for x in self._suspects if x is not s]

    def suspect(self, involved: list[Session]) -> None:
        """The sessions of a failed batch: each runs alone, these first, until it passes or fails."""
        self._suspects = involved + [s for s in self._suspects if all(s is not x for x in involved)]

    def drop_finished_suspects(self) -> None:
        """Forget the suspects that finished (their requests ended)."""
        self._suspects = [x for x in self._suspects if x.phase is not Phase.FINISHED]

    def has_suspects(self) -> bool:
        """Whether a failed batch's sessions still run alone."""
        return bool(self._suspects)

    def prefill_plan(self, prefilling: list[Session], budget: int) -> list[tuple[Session, int]]:
        """Which prompts this step feeds, each with its most tokens (docs/architecture.md, "Scheduling").

        Prompts that can finish in this step go first (their first token is what their clients wait
        for), then the others in admission order, at least `CHUNK_GRAIN` tokens for the oldest of those
        so a long prompt never starves. A chunk's attention work (rows x keys) is bounded, so a step,
        and whoever arrives during it, stays short: alone in its step, a prompt's chunk does at most
        the work of a full chunk at `LONE_CONTEXT_KEYS` keys (shrinking, by grains, only past that);
        in a step shared with decode rows or other prompts, a prompt that cannot finish does at most a
        quarter of a full chunk's work at `LONG_CONTEXT_KEYS` (down to `SHARED_GRAIN` rows; one that
        can finish, the whole of it): the others' tokens wait for this step, and a short request
        arriving during a long prefill gets its first token after two short steps. Chunking never
        changes a bit (docs/exactness.md)."""
        cfg = self.config
        finishing = [s for s in prefilling if s.remaining_prompt() <= cfg.prefill_chunk_tokens]
        longer = [s for s in prefilling if s.remaining_prompt() > cfg.prefill_chunk_tokens]
        shared = budget < cfg.max_batch_tokens or len(prefilling) > 1  # decode rows, or other prompts
        full = cfg.prefill_chunk_tokens * LONG_CONTEXT_KEYS
        plan: list[tuple[Session, int]] = []
        for s in finishing + longer:
            reserve = CHUNK_GRAIN if (longer and s in finishing) else 0
            room = min(cfg.prefill_chunk_tokens, budget - reserve)
            start = s.num_computed
            rows = room
            if not shared:
                grain, most = CHUNK_GRAIN, cfg.prefill_chunk_tokens * LONE_CONTEXT_KEYS
            else:
                grain, most = (SHARED_GRAIN, full // 4) if s in longer else (CHUNK_GRAIN, full)
            while rows > grain and rows * (start + rows) > most:
                rows -= grain
            if rows <= 0:
                continue
            plan.append((s, rows))
            budget -= min(rows, s.remaining_prompt())
        return plan

