"""The synchronous engine: scheduler step, cache lookups and inserts, sampling, stop handling.

Driven by exactly one thread (see async_engine.py). Every cache and runner call happens here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prefixserve.cache import Hit, PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.cache.shared import SharedTier
from prefixserve.config import EngineConfig
from prefixserve.engine.detok import IncrementalDetokenizer
from prefixserve.engine.disk_loads import DiskLoads
from prefixserve.engine.protocol import FlushReport, TierFlush, TokenizerLike
from prefixserve.engine.refill import TurnRefills
from prefixserve.engine.session import Phase, Session
from prefixserve.runner import ModelRunner, SessionState, StepItem, make_generator, sample
from prefixserve.runner.pieces import PieceStore
from prefixserve.types import Delta, FinishReason, FlushScope, Namespace, Request

log = logging.getLogger("prefixserve.engine")

GROW_TOKENS = 256  # output room reserved at admission; the KV grows (doubling) beyond it
MIN_BOUNDARY_TOKENS = 16  # shorter common prefixes (a chat template's header) are not worth an entry

Emit = Callable[[str, Delta], None]


@dataclass(slots=True)
class EngineCounters:
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_steps: int = 0


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: TokenizerLike,
        cache: PrefixCache,
        config: EngineConfig,
        max_model_len: int,
        emit: Emit,
        exact_reuse: bool = True,
        disk: DiskTier | None = None,
        shared: SharedTier | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.cache = cache
        self.config = config
        self.max_model_len = max_model_len
        self.emit = emit
        self.exact_reuse = exact_reuse  # False: the self-test failed, so never reuse across requests
        self.waiting: deque[Session] = deque()
        self.running: list[Session] = []
        self._pending: dict[str, int] = {}  # request_id -> sampled token not yet fed to the model
        self.suspects: list[Session] = []  # sessions of a failed batch, run alone until cleared (faults)
        self._last_step: list[tuple[Session, int | None]] = []  # (session, its fed decode token) of the last step
        self._reserved_bytes = 0  # KV bytes admitted sessions may grow to (max_session_bytes bounds it)
        self.refills = TurnRefills(runner, config.prefill_chunk_tokens, self._store)  # 4-bit-decoded turns
        self.counters = EngineCounters()
        self.pieces = PieceStore()  # KV shared between cache entries, stored once (docs/cache.md)
        self.disk = disk  # the disk tier (docs/cache.md), None when off
        self.shared = shared  # the shared tier on Redis (docs/cache.md), None when off
        self.loads = DiskLoads(disk, cache, self.pieces, shared)  # sessions waiting on a lower tier's load

    # ---- public -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a validated request (its prompt fits: len(prompt) < max_model_len)."""
        sp = request.sampling
        self.waiting.append(Session(
            request=request,
            detok=IncrementalDetokenizer(self.tokenizer, sp.stop),
            generator=make_generator(sp.seed),
        ))
        self.counters.num_requests += 1

    def abort(self, request_id: str) -> None:
        """Finish the request now with ABORT (usage = what was actually computed). Unknown ids: no-op."""
        for s in self.waiting:
            if s.request.request_id == request_id:
                self.waiting.remove(s)
                self._finish(s, FinishReason.ABORT)
                return
        for s in self.running:
            if s.request.request_id == request_id:
                self._finish(s, FinishReason.ABORT)
                return
        if (parked := self.loads.take(request_id)) is not None:
            self._finish(parked, FinishReason.ABORT)

    def abort_all(self, reason: FinishReason = FinishReason.ABORT) -> None:
        self.refills.drop(lambda ns: True)
        for s in list(self.waiting) + list(self.running) + self.loads.take_all():
            if s in self.waiting:
                self.waiting.remove(s)
            self._finish(s, reason)

    def flush(self, scope: FlushScope) -> FlushReport:
        """Forget the namespaces `scope` selects in every tier. Sessions of those namespaces already
        running keep what they copied but insert nothing more, so nothing computed before the flush
        is cached after it."""
        ram = self.cache.flush(scope.selects)
        self.refills.drop(scope.selects)
        for s in [*self.waiting, *self.running, *self.loads.sessions()]:
            if scope.selects(s.request.namespace):
                s.cacheable = False
        tiers = [TierFlush("ram", ram.num_entries, ram.num_bytes)]
        if self.disk is not None:
            disk = self.disk.flush(scope)
            tiers.append(TierFlush("disk", disk.num_entries, disk.num_bytes))
        if self.shared is not None:
            shared = self.shared.flush(scope)
            tiers.append(TierFlush("redis", shared.num_entries, shared.num_bytes))
        return FlushReport(tuple(tiers))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loads or self.refills)

    def step(self) -> None:
        """Admit waiting requests, run one batched forward (decode rows + prefill chunks), sample.

        If it raises, the caller hands the error to `on_step_failure` (the sessions are left as
        they were before the forward, their fed decode tokens recorded in `_last_step`)."""
        self._admit()
        for s in self.running:
            if s.pending_restore is not None:
                self._restore(s)
        items: list[StepItem] = []
        prefill_ends: list[tuple[Session, int, int]] = []
        decoding: list[Session] = []
        budget = self.config.max_batch_tokens
        self.suspects = [s for s in self.suspects if s.phase is not Phase.FINISHED]
        active = self.suspects[:1] or self.running  # a suspect runs alone (see on_step_failure)
        self._last_step = []
        for s in active:
            if s.phase is Phase.DECODE and s.request.request_id in self._pending:
                token = self._pending.pop(s.request.request_id)
                items.append(StepItem(s.state, [token], decode=True))  # type: ignore[arg-type]
                decoding.append(s)
                self._last_step.append((s, token))
                budget -= 1
        for s in active:
            if s.phase is not Phase.PREFILL or budget <= 0:
                continue
            start, end = s.next_prefill_chunk(min(self.config.prefill_chunk_tokens, budget))
            items.append(StepItem(s.state, s.request.prompt_ids[start:end], want_logits=end == s.prompt_len))  # type: ignore[arg-type]
            prefill_ends.append((s, start, end))
            self._last_step.append((s, None))
            budget -= end - start
        quiet = not prefill_ends and not self.waiting and not self.suspects
        refill = self.refills.next_item(budget) if quiet else None
        if refill is not None:
            items.append(refill)
        if items:
            self.runner.step(items)
            self.counters.num_steps += 1
        if self.suspects and self._last_step:
            self.suspects.remove(self._last_step[0][0])  # it ran alone and passed
        if refill is not None:
            self.refills.after_step()
        for s, start, end in prefill_ends:
            self.counters.num_computed_prompt_tokens += end - start
            if end == s.boundary < s.prompt_len and s.state is not None and not s.state.truncatable:
                self._insert(s, end)  # a snapshot-only state exists at this length only now (docs/hybrid.md)
                s.to_insert.remove(end)
            if end == s.prompt_len:
                s.phase = Phase.DECODE
                s.to_insert.append(end)
                self._sample(s)  # the first token goes out before the snapshot copies below
                self._flush_inserts(s)
        for s in decoding:
            if s.phase is Phase.DECODE:
                self._sample(s)

    def on_step_failure(self, message: str) -> None:
        """The last `step` raised `message`. A session that failed alone gets the error (an OpenAI
        500 carrying `message`); the sessions of a failed batch become suspects that run alone, one
        step each, until each one either passes or fails alone; sessions not in it are untouched.
        Pending refills are dropped (a cache optimisation, never worth a retry)."""
        involved = [(s, t) for s, t in self._last_step if s.phase is not Phase.FINISHED]
        self._last_step = []
        self.refills.drop(lambda ns: True)
        for s, token in list(involved):
            if s.state is not None and not s.state.truncatable:
                # a recurrent state may have been updated in place by the partial forward: no retry
                involved.remove((s, token))
                self._finish(s, FinishReason.ERROR, error=message)
                continue
            if token is not None:
                self._pending[s.request.request_id] = token  # not fed: feed it again
            if s.state is not None:  # a partial forward may have written past the valid keys
                s.state.truncate(s.state.num_tokens, force_zero=True)
        if not involved:
            return
        if len(involved) == 1 and self.suspects[:1] == [involved[0][0]]:
            self.suspects.pop(0)
            self._finish(involved[0][0], FinishReason.ERROR, error=message)
        elif len(involved) == 1:
            self._finish(involved[0][0], FinishReason.ERROR, error=message)
        else:
            self.suspects = [s for s, _ in involved] + [s for s in self.suspects if all(s is not x for x, _ in involved)]

    def fail_all(self, message: str) -> None:
        """End every request (waiting, running, parked) with an error carrying `message`."""
        self.refills.drop(lambda ns: True)
        self.suspects = []
        for s in list(self.waiting) + list(self.running) + self.loads.take_all():
            if s in self.waiting:
                self.waiting.remove(s)
            self._finish(s, FinishReason.ERROR, error=message)

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def oldest_wait_s(self) -> float:
        """How long the oldest waiting request has waited for admission (0 when none waits)."""
        return time.monotonic() - self.waiting[0].arrival if self.waiting else 0.0

    # ---- admission: cache lookup and restore --------------------------------------------------

    def _admit(self) -> None:
        if self.loads:  # loaded from disk: back to the front of the queue, their entries in RAM now
            self.waiting.extendleft(reversed(self.loads.ready(block=not self.running and not self.waiting)))
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            need = self.session_bytes(self.waiting[0].request)
            if self.running and self._reserved_bytes + need > self.config.max_session_bytes:
                break  # waits until running sessions finish and free their share
            s = self.waiting.popleft()
            s.reserved_bytes = need
            self._reserved_bytes += need
            if self.exact_reuse and self.loads.park(s):
                continue
            self.running.append(s)
            self._start(s)

    def _start(self, s: Session) -> None:
        req = s.request
        if self.refills:
            self.refills.complete_for(req.namespace, tuple(req.prompt_ids))
        hit = self.cache.lookup(req.namespace, req.prompt_ids) if self.exact_reuse else None
        if isinstance(hit, Hit):
            self.cache.pin(hit.entry)  # held until the copy is made (now, or next step for a full hit)
            s.pending_restore = hit.entry
            s.num_cached = hit.num_cached_tokens
        lcp = 0 if hit is None else hit.lcp_len
        if MIN_BOUNDARY_TOKENS <= lcp < s.prompt_len and not (isinstance(hit, Hit) and hit.entry.num_tokens == lcp):
            s.boundary = lcp
            s.to_insert.append(lcp)
        self.counters.num_prompt_tokens += s.prompt_len
        self.counters.num_cached_tokens += s.num_cached
        if s.num_cached == s.prompt_len:
            # full hit: the entry's stored logits give the first token now; the KV copy waits a step
            s.phase = Phase.DECODE
            self._sample(s)
            return
        self._restore(s)
        s.phase = Phase.PREFILL
        # usage known so far, so that a request aborted mid-prefill is billed with its cached tokens
        self.emit(req.request_id, Delta(text="", token_ids=(), usage=s.usage()))

    def session_bytes(self, request: Request) -> int:
        """The KV bytes a session may grow to (prompt + max_tokens, within the context): what
        admission reserves against `max_session_bytes`. Its KV is allocated as it grows."""
        sp = request.sampling
        num_tokens = min(self.max_model_len, len(request.prompt_ids) + sp.max_tokens)
        return num_tokens * self.runner.kv_bytes_per_token()

    def _restore(self, s: Session) -> None:
        """Give the session its own state: a deep copy of the pinned hit, or a fresh one, with room for
        the prompt and a first stretch of output (it grows as it decodes)."""
        room = s.prompt_len + min(s.request.sampling.max_tokens, self.max_model_len - s.prompt_len, GROW_TOKENS)
        entry = s.pending_restore
        if entry is None:
            s.state = self.runner.new_state(room)
            return
        try:
            s.state = entry.state.restore(s.num_cached, room - s.num_cached)  # type: ignore[attr-defined]
        finally:
            s.pending_restore = None
            self.cache.unpin(entry)

    def _flush_inserts(self, s: Session) -> None:
        """Offer the session's state at each pending length (boundary, full prompt) to the cache."""
        if s.state is None:
            s.to_insert.clear()
            return
        for num_tokens in s.to_insert:
            if s.state.truncatable or num_tokens == s.state.num_tokens:  # snapshot-only: its own length only
                self._insert(s, num_tokens)
        s.to_insert.clear()

    def _insert(self, s: Session, num_tokens: int) -> None:
        if not self.exact_reuse or self.cache.config.max_bytes == 0 or not s.cacheable:
            return
        assert s.state is not None and num_tokens <= s.state.num_tokens
        self._store(s.request.namespace, tuple(s.request.prompt_ids[:num_tokens]), s.state)

    def _store(self, ns: Namespace, key: tuple[int, ...], state: SessionState) -> None:
        """Cache `state`'s first len(key) tokens (shared pieces in RAM, write-through to disk and Redis)."""
        # piece edges at the cached entries on this key's path: their pieces are shared, not copied
        snap = self.pieces.snapshot(state, key, ns, self.cache.entry_lengths(ns, key))
        if self.cache.insert(ns, key, snap).stored and snap.truncatable:  # no hybrid files or values yet
            for tier in (self.disk, self.shared):  # write-through, on each tier's writer thread
                if tier is not None:
                    tier.offer(ns, key, snap)

    # ---- decode: sampling, stopping, finishing ------------------------------------------------

    def _sample(self, s: Session) -> None:
        if s.state is not None:
            logits = s.state.logits
        else:  # a full hit whose copy is still pending
            logits = s.pending_restore.state.logits  # type: ignore[union-attr]
        assert logits is not None
        sp = s.request.sampling
        try:
            token = sample(logits, sp, s.generator)
        except (RuntimeError, ValueError) as e:  # one request's sampling must never fail the batch
            log.warning("sampling failed for %s: %s", s.request.request_id, e)
            self._finish(s, FinishReason.ERROR)
            return
        if s.first_token_at is None:
            s.first_token_at = time.monotonic()
        s.output_ids.append(token)
        self.counters.num_completion_tokens += 1
        reason: FinishReason | None = None
        text = ""
        if (token in self.tokenizer.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            reason = FinishReason.STOP
        else:
            text = s.detok.add(token)
            if s.detok.stopped:
                reason = FinishReason.STOP
        if reason is None and (
            len(s.output_ids) >= sp.max_tokens or s.prompt_len + len(s.output_ids) >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is None:
            self._pending[s.request.request_id] = token
            self.emit(s.request.request_id, Delta(text=text, token_ids=(token,), usage=s.usage()))
        else:
            self._finish(s, reason, text, (token,))

    def _finish(
        self, s: Session, reason: FinishReason, text: str = "", token_ids: tuple[int, ...] = (), error: str | None = None
    ) -> None:
        if s.phase is Phase.FINISHED:
            return
        usage = s.usage()  # before the phase changes: an unfinished prompt bills what was processed
        s.phase = Phase.FINISHED
        s.finish_reason = reason
        self._pending.pop(s.request.request_id, None)
        if s in self.running:
            self.running.remove(s)
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.counters.num_finished += 1
            self._flush_inserts(s)
            self._offer_turn(s)
        else:
            self.counters.num_aborted += 1
        if s.pending_restore is not None:
            self.cache.unpin(s.pending_restore)
            s.pending_restore = None
        if s.reserved_bytes:
            self._reserved_bytes -= s.reserved_bytes
            s.reserved_bytes = 0
        text += s.detok.flush()
        self.emit(s.request.request_id,
                  Delta(text=text, token_ids=token_ids, finish_reason=reason, usage=usage, error=error))
        s.state = None  # free the session's KV now

    def _offer_turn(self, s: Session) -> None:
        """Cache prompt + reply so the next turn of the conversation hits its own history.

        Dense decode runs the prefill calls, so the session's state is exact as it is (the reply's
        last token was never fed). With 4-bit decode rows the reply's KV has other bits than a
        recomputation's: the state goes to `self.refills` (engine/refill.py) to be re-fed by prefill."""
        st = s.state
        if not self.config.offer_finished_turns or st is None or not s.output_ids or not s.cacheable:
            return
        if not self.exact_reuse or self.cache.config.max_bytes == 0:
            return
        if self.runner.decoder.decode_matches_prefill:
            if st.num_tokens > s.prompt_len:
                ids = tuple(s.request.prompt_ids) + tuple(s.output_ids[: st.num_tokens - s.prompt_len])
                self._store(s.request.namespace, ids, st)
            return
        self.refills.offer(s.request.namespace, tuple(s.request.prompt_ids) + tuple(s.output_ids), st, s.prompt_len)
