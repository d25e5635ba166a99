"""Finished 4-bit-decoded turns, re-fed by prefill so that prompt + reply can be cached exactly.

A 4-bit decoded token's KV has other bits than prefilling it would give (docs/exactness.md), so a
finished turn's own state is not offered to the cache. Its state is cut back to the exact prompt and
the reply re-fed in prefill chunks: in spare budget of steps that prefill no prompt, or at once when
the chat's next message arrives (that request would compute the same tokens itself).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from prefixserve.engine.session import TurnRefill
from prefixserve.runner import ModelRunner, SessionState, StepItem
from prefixserve.types import Namespace

MAX_PENDING_REFILLS = 8  # each holds its session's KV; past this the oldest is dropped

Store = Callable[[Namespace, tuple[int, ...], SessionState], None]


class TurnRefills:
    """The queue of pending refills, oldest first. Engine-thread only."""

    def __init__(self, runner: ModelRunner, chunk_tokens: int, store: Store) -> None:
        self.runner = runner
        self.chunk_tokens = chunk_tokens
        self.store = store  # caches a finished refill's state (the engine's insert path)
        self._queue: deque[TurnRefill] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[TurnRefill]:
        return iter(self._queue)

    def offer(self, ns: Namespace, token_ids: tuple[int, ...], state: SessionState, num_exact: int) -> None:
        """Queue a finished turn: `state` is the session's own (taken over), exact up to `num_exact`."""
        state.truncate(num_exact)
        self._queue.append(TurnRefill(ns, token_ids, state))
        if len(self._queue) > MAX_PENDING_REFILLS:
            self._queue.popleft()

    def next_item(self, budget: int) -> StepItem | None:
        """The next chunk of the oldest refill within `budget` tokens; None when there is nothing to do.
        After the step that ran it, call `after_step`."""
        if not self._queue or budget <= 0:
            return None
        r = self._queue[0]
        start = r.state.num_tokens
        end = min(len(r.token_ids), start + min(self.chunk_tokens, budget))
        # no logits: the next turn always extends the entry, so they could never serve a full hit
        return StepItem(r.state, r.token_ids[start:end], want_logits=False)

    def after_step(self) -> None:
        """Store the oldest refill once it covers its whole turn."""
        r = self._queue[0]
        if r.state.num_tokens == len(r.token_ids):
            self._queue.popleft()
            self.store(r.namespace, r.token_ids, r.state)

    def complete_for(self, ns: Namespace, prompt_ids: tuple[int, ...]) -> None:
        """Finish now every refill that the prompt continues (same namespace, same tokens past its
        exact part), so the prompt's lookup hits the whole turn. Runs forward steps."""
        for r in list(self._queue):
            n = r.state.num_tokens
            if r.namespace != ns or len(prompt_ids) <= n or prompt_ids[: n + 1] != r.token_ids[: n + 1]:
                continue
            self._queue.remove(r)
            self._queue.appendleft(r)
            while self._queue and self._queue[0] is r:
                item = self.next_item(self.chunk_tokens)
                assert item is not None
                self.runner.step([item])
                self.after_step()

    def drop(self, selects: Callable[[Namespace], bool]) -> None:
        """Forget the refills of the namespaces `selects` picks (a flush), or all with `lambda ns: True`."""
        self._queue = deque(r for r in self._queue if not selects(r.namespace))
