"""Out-of-band control of the engine: forgetting (flush) and recovering from a failed step.

Both run on the engine thread, between steps, with the same access to the core as the step itself,
except a flush's Redis part (`flush_shared`), which runs beside the engine on a worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixserve.cache.shared import SharedTier
from prefixserve.engine.protocol import FlushReport, TierFlush
from prefixserve.engine.session import Phase
from prefixserve.engine.step_record import StepPhase, StepRecord, fail_request, stuck
from prefixserve.types import FlushScope

if TYPE_CHECKING:
    from prefixserve.engine.core import EngineCore


def flush(core: EngineCore, scope: FlushScope) -> FlushReport:
    """Forget the namespaces `scope` selects in every tier, all on the calling (engine) thread."""
    local = flush_local(core, scope)
    if core.shared is None:
        return local
    try:
        return FlushReport((*local.tiers, flush_shared(core.shared, scope)))
    finally:
        core.loads.flushed(scope)


def flush_local(core: EngineCore, scope: FlushScope) -> FlushReport:
    """Forget the namespaces `scope` selects in RAM and on disk. Sessions of those namespaces already
    running keep what they copied but insert nothing more, so nothing computed before the flush is
    cached after it; their pending turn refills are dropped. With a shared tier, no session reads
    those namespaces from it until the caller's `flush_shared` is done and it calls
    `core.loads.flushed(scope)` (a value not deleted yet must not come back into RAM)."""
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
        core.loads.flushing(scope)
    return FlushReport(tuple(tiers))


def flush_shared(shared: SharedTier, scope: FlushScope) -> TierFlush:
    """The Redis part of a flush: a SCAN of the scope's keys, for any thread (SharedTier.flush is
    thread-safe). `complete` False when Redis did not answer (the server's 503 flush_incomplete)."""
    result = shared.flush(scope)
    return TierFlush("redis", result.num_entries, result.num_bytes, result.complete)


def recover(core: EngineCore, message: str) -> None:
    """`core.step()` raised `message`; `core.record`, the failed step's own record, says how far it
    got (engine/step_record.py). Pending refills are dropped (a cache optimisation, never worth a retry).

    Before the forward's results were taken, no session shows the step: each session it fed is put
    back as it was (its decode token pending again, keys a partial forward wrote past its length
    zeroed) and the step is retried. A session that failed alone gets the error (an OpenAI 500
    carrying `message`); the sessions of a failed batch become suspects that run alone, one step
    each, until each either passes or fails alone; sessions not in it are untouched. A recurrent
    (hybrid) state may have been updated in place, so it is never retried.
    After the forward (a fault outside any session's guarded part), the fed sessions whose results
    were not taken cannot go back: those that no step would move on end with the error."""
    rec = core.record
    core.record = StepRecord()
    core.refills.drop(lambda ns: True)
    if rec.phase is StepPhase.OUTPUTS:
        for s, _ in rec.fed:
            if s.phase is not Phase.FINISHED and stuck(s):
                fail_request(core, s, message)
        return
    involved = rec.give_back()
    for s in list(involved):
        if s.state is not None and not s.state.truncatable:
            involved.remove(s)
            fail_request(core, s, message)
            continue
        if s.state is not None:  # a partial forward may have written past the valid keys
            s.state.truncate(s.state.num_tokens, force_zero=True)
    if len(involved) == 1:
        core.suspects = [x for x in core.suspects if x is not involved[0]]
        fail_request(core, involved[0], message)
    elif involved:
        rest = [s for s in core.suspects if all(s is not x for x in involved)]
        core.suspects = involved + rest
