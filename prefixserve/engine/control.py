"""Out-of-band control of the engine: forgetting (flush) and recovering from a failed step.

Both run on the engine thread, between steps, with the same access to the core as the step itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixserve.engine.protocol import FlushReport, TierFlush
from prefixserve.engine.session import Phase
from prefixserve.types import FinishReason, FlushScope

if TYPE_CHECKING:
    from prefixserve.engine.core import EngineCore


def flush(core: EngineCore, scope: FlushScope) -> FlushReport:
    """Forget the namespaces `scope` selects in every tier. Sessions of those namespaces already
    running keep what they copied but insert nothing more, so nothing computed before the flush is
    cached after it; their pending turn refills are dropped."""
    ram = core.cache.flush(scope.selects)
    core.refills.drop(scope.selects)
    for s in [*core.waiting, *core.running, *core.loads.sessions()]:
        if scope.selects(s.request.namespace):
            s.cacheable = False
    tiers = [TierFlush("ram", ram.num_entries, ram.num_bytes)]
    if core.disk is not None:
        disk = core.disk.flush(scope)
        tiers.append(TierFlush("disk", disk.num_entries, disk.num_bytes))
    if core.shared is not None:
        shared = core.shared.flush(scope)
        tiers.append(TierFlush("redis", shared.num_entries, shared.num_bytes, shared.complete))
    return FlushReport(tuple(tiers))


def recover(core: EngineCore, message: str) -> None:
    """The last `core.step()` raised `message`. A session that failed alone gets the error (an
    OpenAI 500 carrying `message`); the sessions of a failed batch become suspects that run alone,
    one step each, until each either passes or fails alone; sessions not in it are untouched. A
    recurrent (hybrid) state may have been updated in place, so it is never retried. Pending
    refills are dropped (a cache optimisation, never worth a retry)."""
    involved = [(s, t) for s, t in core._last_step if s.phase is not Phase.FINISHED]
    core._last_step = []
    core.refills.drop(lambda ns: True)
    for s, token in list(involved):
        if s.state is not None and not s.state.truncatable:
            involved.remove((s, token))
            core._finish(s, FinishReason.ERROR, error=message)
            continue
        if token is not None:
            s.pending_token = token  # not fed: feed it again
        if s.state is not None:  # a partial forward may have written past the valid keys
            s.state.truncate(s.state.num_tokens, force_zero=True)
    if len(involved) == 1:
        if core.suspects[:1] == [involved[0][0]]:
            core.suspects.pop(0)
        core._finish(involved[0][0], FinishReason.ERROR, error=message)
    elif involved:
        rest = [s for s in core.suspects if all(s is not x for x, _ in involved)]
        core.suspects = [s for s, _ in involved] + rest
