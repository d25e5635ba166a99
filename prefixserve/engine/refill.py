"""Finished turns, re-fed by prefill so that prompt + reply can be cached exactly.

A 4-bit decoded token's KV has other bits than prefilling it would give (docs/exactness.md), so a
finished turn's own state is not offered to the cache: it is cut back to the exact prompt and the
reply re-fed. Dense decode states are exact, but decode never fed the reply's last sampled token:
only that one is fed. Either way in prefill chunks, off the serving path: only while the engine has
nothing else to do, one layer at a time between its loop's turns, then stored one piece at a time (a
bitwise compare with the prompt's cached piece, or a copy), so a request arriving meanwhile waits one
layer or one piece (about a millisecond each for the embedded model), never a whole forward or a
whole store. When the chat's next message arrives first, its admission finishes the refill at once
(the request would compute those tokens itself) and is billed for them as computed, not cached.

A busy engine is never idle, so under load (other users decoding) no refill ran and a conversation's
next turn hit only its previous prompt (QA: 39 of 42 follow-up turns of 6 users). An eager refill, a
turn likely to be continued (`Request.continues`: its prompt held an earlier reply, or offered tools,
whose results come back in the next turn) also runs while the engine serves: after each step, one layer at a time,
within EAGER_SHARE of the steps' time (`EagerShare`). That work is moved earlier, not added, when the
conversation goes on; a one-shot request's refill still waits for an idle engine.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

from prefixserve.engine.session import TurnRefill
from prefixserve.runner import ModelRunner, SessionState, StepItem
from prefixserve.types import Namespace, lcp

log = logging.getLogger("prefixserve.engine")
MAX_PENDING_REFILLS = 8  # each holds its session's KV; past this the oldest is dropped
EAGER_SHARE = 0.5  # of a busy engine's time, at most, for eager refills (their layers between steps)
MAX_EAGER_CREDIT_S = 0.05  # time owed to eager refills is capped: no long burst after a long step
# ... and their KV shares --max-session-bytes with the running sessions' reservations: admission sheds
# the oldest to make room (`shed`), never waits for one (a dropped refill costs the next turn a hit)

Store = Callable[[Namespace, tuple[int, ...], SessionState], Iterator[None]]  # a store, paused per piece


class TurnRefills:
    """The queue of pending refills, oldest first. Engine-thread only."""

    def __init__(self, runner: ModelRunner, chunk_tokens: int, store: Store) -> None:
        self.runner = runner
        self.chunk_tokens = chunk_tokens
        self.store = store  # caches a finished refill's state (the engine's insert path), a piece a call
        self._queue: deque[TurnRefill] = deque()
        # the work under way, paused between layers (a chunk) or between pieces (the store, when True)
        self._job: tuple[TurnRefill, Iterator[None], bool] | None = None

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[TurnRefill]:
        return iter(self._queue)

    def offer(self, ns: Namespace, token_ids: tuple[int, ...], state: SessionState, num_exact: int,
              eager: bool = False) -> None:
        """Queue a finished turn: `state` is the session's own (taken over), exact up to `num_exact`;
        `eager`: re-fed under load too (the module's docstring)."""
        state.truncate(num_exact)
        self._queue.append(TurnRefill(ns, token_ids, state, eager))
        if len(self._queue) > MAX_PENDING_REFILLS:
            self._drop_oldest()

    def nbytes(self) -> int:
        """The bytes the pending refills' states hold (their KV buffers, whole)."""
        return sum(r.state.nbytes for r in self._queue)

    def shed(self, limit: int) -> None:
        """Drop the oldest pending refills until the rest hold at most `limit` bytes: what the session
        budget leaves beside the running sessions' reservations (as `Scheduler.admit` reserves, and as a
        session finishes: engine/outputs.py). Without it eight
        finished long turns held their KV beyond every budget (QA: RSS ~400 MiB past the bound in docs/operations.md, "Memory")."""
        while self._queue and self.nbytes() > limit:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        oldest = self._queue.popleft()
        if self._job is not None and self._job[0] is oldest:
            self._job = None  # its paused forward or store is closed with it: nothing uses the state any more
        self.runner.recycle(oldest.state)

    def run_layer(self) -> None:
        """Run one layer of the oldest refill's next chunk (starting the chunk if none is under way),
        or, once the refill covers its whole turn, one piece of its store; a stored refill leaves the
        queue and its KV buffer goes back to the pool."""
        if self._job is None:
            r = self._queue[0]
            start = r.state.num_tokens
            end = min(len(r.token_ids), start + self.chunk_tokens)
            # no logits: the next turn always extends the entry, so they could never serve a full hit
            self._job = (r, self.runner.step_layers([StepItem(r.state, r.token_ids[start:end], want_logits=False)]), False)
        r, steps, storing = self._job
        try:
            next(steps)
            return
        except StopIteration:
            pass
        self._job = None
        if storing:
            self._queue.remove(r)
            self.runner.recycle(r.state)  # the cache copied what it keeps
        elif r.state.num_tokens == len(r.token_ids):
            self._job = (r, self.store(r.namespace, r.token_ids, r.state), True)

    def run_eager_layer(self) -> bool:
        """One layer towards an eager refill: of the work under way (a chunk or store started is
        finished first), else of the oldest eager refill; False when no eager refill is pending."""
        if not any(r.eager for r in self._queue):
            return False
        if self._job is None:
            self._to_front(next(r for r in self._queue if r.eager))
        self.run_layer()
        return True

    def _to_front(self, r: TurnRefill) -> None:
        """`r` becomes the refill `run_layer` works on next (between jobs: one under way is at the front)."""
        self._queue.remove(r)
        self._queue.appendleft(r)

    def holds(self, ns: Namespace, token_ids: tuple[int, ...]) -> bool:
        """Whether this very turn is pending (the same request again, finished before its refill ran)."""
        return any(r.namespace == ns and r.token_ids == token_ids for r in self._queue)

    def owns(self, state: SessionState) -> bool:
        """Whether `state` is a pending refill's (handed over by `offer`)."""
        return any(r.state is state for r in self._queue)

    def complete_for(self, ns: Namespace, prompt_ids: tuple[int, ...]) -> tuple[int, int]:
        """Finish now every refill that the prompt continues (same namespace, same tokens past its
        exact part), so the prompt's lookup hits the whole turn. Runs forward steps; returns the span
        [start, end) of prompt positions they computed ((0, 0) for none): the request is billed for
        those as computed, not cached. A fault in them drops every pending refill, as a failed
        background refill does (a cache optimisation): (0, 0), and the request computes those tokens."""
        try:
            return self._complete_for(ns, prompt_ids)
        except Exception:
            log.exception("a turn refill failed at admission; pending refills dropped")
            self.drop(lambda ns: True)
            return (0, 0)

    def _complete_for(self, ns: Namespace, prompt_ids: tuple[int, ...]) -> tuple[int, int]:
        span = (0, 0)
        for r in list(self._queue):
            n = r.state.num_tokens
            if r.namespace != ns or len(prompt_ids) <= n or prompt_ids[: n + 1] != r.token_ids[: n + 1]:
                continue
            if self._job is not None and self._job[0] is not r:
                while self._job is not None:  # another refill's chunk or store is under way: finish it first
                    self.run_layer()
            self._to_front(r)
            while r in self._queue:
                self.run_layer()
            same = lcp(prompt_ids, r.token_ids)
            if same - n > span[1] - span[0]:
                span = (n, same)
        return span

    def drop(self, selects: Callable[[Namespace], bool]) -> None:
        """Forget the refills of the namespaces `selects` picks (a flush), or all with `lambda ns: True`."""
        self._queue = deque(r for r in self._queue if not selects(r.namespace))
        if self._job is not None and self._job[0] not in self._queue:
            self._job = None  # its state goes with it


class EagerShare:
    """The engine loop's budget for eager refills while it serves: each step earns EAGER_SHARE of its
    time, spent one layer at a time right after it (a layer may overdraw; the next steps repay it)."""

    def __init__(self, share: float = EAGER_SHARE) -> None:
        self.share = share
        self._credit = 0.0

    def after_step(self, step_seconds: float, run_layer: Callable[[], bool]) -> None:
        """Spend what the step earned on `run_layer` (one eager layer; False: none pending)."""
        self._credit = min(self._credit + self.share * step_seconds, MAX_EAGER_CREDIT_S)
        while self._credit > 0:
            t0 = time.monotonic()
            if not run_layer():
                self._credit = min(self._credit, 0.0)  # nothing owed to work that is not there
                return
            self._credit -= time.monotonic() - t0
