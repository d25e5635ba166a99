"""One engine step as a transaction in effect (docs/architecture.md, "A failed step").

`EngineCore.step` runs in phases (`StepPhase`) and keeps a `StepRecord` of the step under way: which
phase it is in and which sessions the forward was handed, with the decode token taken from each.
Every piece of per-session work runs `guarded`: a fault in one session's admission (its cache
lookup, copy, turn refill, lower-tier load), its deferred restore, its batch item, or after the
forward its sampling, grammar matcher, n > 1 fork or cache inserts (RAM and the tiers' writes) ends
that session's request only (the `fail` it is given, `OutputProcessor.fail_request`: every choice,
with the error and the usage so far), and the step goes on for the others. What is left is shared work
(the forward itself, the plan of the batch): when it raises, `control.recover` reads this step's
record, never an earlier one's, and puts the sessions back as they were before the step, their
decode tokens to feed again, so the step is retried; a token that went out is never fed twice, and
none is dropped.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prefixserve.engine.session import Phase, Session

log = logging.getLogger("prefixserve.engine")


class StepPhase(enum.Enum):
    ADMIT = "admit"  # waiting requests start: lookups, copies, refills, lower-tier loads, full hits' first tokens
    RESTORE = "restore"  # full hits' deferred copies
    BATCH = "batch"  # the forward's items: decode tokens are taken from their sessions (recorded)
    FORWARD = "forward"  # the batched forward: all or nothing
    OUTPUTS = "outputs"  # the forward's results, session by session: sampling, grammar, forks, inserts


@dataclass(eq=False, slots=True)
class StepRecord:
    """What the step under way has done. Engine thread only; a new one each step."""

    phase: StepPhase = StepPhase.ADMIT
    # sessions handed to the forward, in order, each with the decode token taken from it (None: a prefill chunk)
    fed: list[tuple[Session, int | None]] = field(default_factory=list)

    def take_token(self, s: Session) -> int:
        """Take `s`'s pending decode token for this step's forward, recorded so that a failed step
        gives it back (`give_back`)."""
        token = s.pending_token
        assert token is not None
        s.pending_token = None
        self.fed.append((s, token))
        return token

    def give_back(self) -> list[Session]:
        """Before the forward's results were taken: every unfinished session this step fed, its decode
        token pending again (it never reached the model, or its keys are dropped: the caller truncates)."""
        assert self.phase is not StepPhase.OUTPUTS
        out: list[Session] = []
        for s, token in self.fed:
            if s.phase is Phase.FINISHED:
                continue
            if token is not None:
                s.pending_token = token
            out.append(s)
        return out


def stuck(s: Session) -> bool:
    """A session that no later step would move: decoding with no token to feed and no copy pending, or
    prefilling with its prompt all fed (after the forward, before its first token was sampled)."""
    if s.phase is Phase.DECODE:
        return s.pending_token is None
    return s.phase is Phase.PREFILL and s.state is not None and s.remaining_prompt() == 0


Fail = Callable[[Session, str], None]  # ends a session's request with an error (OutputProcessor.fail_request)


@contextlib.contextmanager
def guarded(fail: Fail, s: Session) -> Iterator[None]:
    """Run `s`'s part of the step: an exception in it ends `s`'s request (`fail`, with the error's
    type and message) and is not raised; the step goes on with the other sessions."""
    try:
        yield
    except Exception as e:
        log.exception("request %s failed in the engine step", s.request.request_id)
        fail(s, f"{type(e).__name__}: {e}")
