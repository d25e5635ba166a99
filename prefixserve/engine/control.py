"""Out-of-band control of the engine: forgetting (flush) and recovering from a failed step.

Both run on the engine thread, between steps, on the engine's parts (EngineCore wires them in), except
a flush's Redis part (`flush_shared`), which runs beside the engine on a worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixserve.cache import PrefixCache
from prefixserve.engine.cache_writer import CacheWriter
from prefixserve.engine.outputs import OutputProcessor
from prefixserve.engine.protocol import FlushReport, TierFlush
from prefixserve.engine.scheduler import Scheduler
from prefixserve.engine.session import Phase, Snapshot
from prefixserve.engine.step_record import StepPhase, StepRecord, stuck
from prefixserve.types import FlushScope

if TYPE_CHECKING:  # only a shared tier's server imports it (and redis with it, 0.2 s)
    from prefixserve.cache.shared import SharedTier


def flush(cache: PrefixCache[Snapshot], scheduler: Scheduler, writer: CacheWriter, scope: FlushScope) -> FlushReport:
    """Forget the namespaces `scope` selects in every tier, all on the calling (engine) thread."""
    local = flush_local(cache, scheduler, writer, scope)
    if writer.shared is None:
        return local
    try:
        return FlushReport((*local.tiers, flush_shared(writer.shared, scope)))
    finally:
        scheduler.loads.flushed(scope)


def flush_local(cache: PrefixCache[Snapshot], scheduler: Scheduler, writer: CacheWriter,
                scope: FlushScope) -> FlushReport:
    """Forget the namespaces `scope` selects in RAM and on disk. Sessions of those namespaces already
    running keep what they copied but insert nothing more, so nothing computed before the flush is
    cached after it; their pending turn refills are dropped. With a shared tier, no session reads
    those namespaces from it until the caller's `flush_shared` is done and it calls
    `scheduler.loads.flushed(scope)` (a value not deleted yet must not come back into RAM)."""
    ram = cache.flush(scope.selects)
    writer.refills.drop(scope.selects)
    for s in scheduler.sessions():
        if scope.selects(s.request.namespace):
            s.cacheable = False
    tiers = [TierFlush("ram", ram.num_entries, ram.num_bytes)]
    if writer.disk is not None:
        disk = writer.disk.flush(scope)
        tiers.append(TierFlush("disk", disk.num_entries, disk.num_bytes))
    if writer.shared is not None:
        scheduler.loads.flushing(scope)
    return FlushReport(tuple(tiers))


def flush_shared(shared: SharedTier, scope: FlushScope) -> TierFlush:
    """The Redis part of a flush: a SCAN of the scope's keys, for any thread (SharedTier.flush is
    thread-safe). `complete` False when Redis did not answer (the server's 503 flush_incomplete)."""
    result = shared.flush(scope)
    return TierFlush("redis", result.num_entries, result.num_bytes, result.complete)


def recover(rec: StepRecord, scheduler: Scheduler, writer: CacheWriter, outputs: OutputProcessor,
            message: str) -> None:
    """`EngineCore.step()` raised `message`; `rec`, the failed step's own record, says how far it
    got (engine/step_record.py). Pending refills are dropped (a cache optimisation, never worth a retry).

    Before the forward's results were taken, no session shows the step: each session it fed is put
    back as it was (its decode token pending again, keys a partial forward wrote past its length
    zeroed) and the step is retried. A session that failed alone gets the error (an OpenAI 500
    carrying `message`); the sessions of a failed batch become suspects that run alone, one step
    each, until each either passes or fails alone; sessions not in it are untouched. A recurrent
    (hybrid) state may have been updated in place, so it is never retried.
    After the forward (a fault outside any session's guarded part), the fed sessions whose results
    were not taken cannot go back: those that no step would move on end with the error."""
    writer.refills.drop(lambda ns: True)
    if rec.phase is StepPhase.OUTPUTS:
        for s, _ in rec.fed:
            if s.phase is not Phase.FINISHED and stuck(s):
                outputs.fail_request(s, message)
        return
    involved = rec.give_back()
    for s in list(involved):
        if s.state is not None and not s.state.truncatable:
            involved.remove(s)
            outputs.fail_request(s, message)
            continue
        if s.state is not None:  # a partial forward may have written past the valid keys
            s.state.truncate(s.state.num_tokens, force_zero=True)
    if len(involved) == 1:
        scheduler.passed(involved[0])
        outputs.fail_request(involved[0], message)
    elif involved:
        scheduler.suspect(involved)
