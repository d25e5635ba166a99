"""The synchronous engine: it wires the scheduler (engine/scheduler.py: queue, fairness, reservations,
admission), the cache writer (engine/cache_writer.py: inserts, turn refills, tier writes) and the output
processor (engine/outputs.py: sampling, stops, finishing), and runs the step, a transaction in effect
(engine/step_record.py): admit, restore, batch, forward, outputs. Cache lookups and restores happen
here, as a session starts; flush and recovery are engine/control.py.

Driven by exactly one thread (see async_engine.py). Every cache and runner call happens there.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

from prefixserve.cache import Hit, PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.config import EngineConfig, session_tokens
from prefixserve.engine import control
from prefixserve.engine.admission import Room
from prefixserve.engine.cache_writer import CacheWriter
from prefixserve.engine.counters import EngineCounters
from prefixserve.engine.detok import IncrementalDetokenizer
from prefixserve.engine.disk_loads import DiskLoads
from prefixserve.engine.grammar import GrammarCompiler, TokenMatcher
from prefixserve.engine.outputs import Emit, OutputProcessor
from prefixserve.engine.protocol import FlushReport, TokenizerLike
from prefixserve.engine.refill import TurnRefills
from prefixserve.engine.scheduler import Scheduler
from prefixserve.engine.session import Phase, Session, Snapshot, tokens_needed
from prefixserve.engine.step_record import StepPhase, StepRecord, guarded
from prefixserve.runner import ModelRunner, StepItem, make_generator
from prefixserve.runner.pieces import PieceStore
from prefixserve.types import Constraint, FinishReason, FlushScope, Request

if TYPE_CHECKING:  # only a shared tier's server imports it (and redis with it, 0.2 s)
    from prefixserve.cache.shared import SharedTier

log = logging.getLogger("prefixserve.engine")

GROW_TOKENS = 256  # output room reserved at admission; the KV grows (doubling) beyond it


class EngineCore:
    """One engine: its parts (`scheduler`, `writer`, `outputs`), the resources they share (`runner`,
    `tokenizer`, `cache`, `pieces`, `counters`) and the step that drives them. Engine thread only,
    except `compile` and `grammars` (any thread)."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: TokenizerLike,
        cache: PrefixCache[Snapshot],
        config: EngineConfig,
        max_model_len: int,
        emit: Emit,
        exact_reuse: bool = True,
        disk: DiskTier | None = None,
        shared: SharedTier | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`grammars`: the tokenizer's grammar compiler when it was built already; else it is built on
        first use (`grammars`: the server asks for it once it serves). `emit` gets
        every Delta (settable later as `emit`); `exact_reuse` False (the self-test failed): never reuse
        across requests."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.cache = cache
        self.config = config
        self.max_model_len = max_model_len
        # the most tokens one session may reserve (prompt + max_tokens); a budget below a small request's is refused
        self.session_budget_tokens = session_tokens(config.max_session_bytes, runner.kv_bytes_per_token())
        self.max_session_tokens = min(max_model_len, self.session_budget_tokens)
        self.exact_reuse = exact_reuse
        self._grammars = grammars
        self._grammars_lock = threading.Lock()  # `grammars` may be called off the engine thread
        self.record = StepRecord()  # what the step under way has done (engine/step_record.py)
        self.counters = EngineCounters()
        self.pieces = PieceStore()  # KV shared between cache entries, stored once (docs/cache.md)
        self.writer = CacheWriter(runner, tokenizer, cache, config, exact_reuse, self.pieces, disk, shared)
        loads = DiskLoads(disk, cache, self.pieces, shared)  # sessions waiting on a lower tier's load
        self.scheduler = Scheduler(config, runner, cache, loads, self.writer.refills, max_model_len, exact_reuse)
        self.outputs = OutputProcessor(runner, tokenizer, cache, self.scheduler, self.writer, self.counters,
                                       max_model_len, emit)

    # ---- the parts' state, read through --------------------------------------------------------

    @property
    def emit(self) -> Emit:
        """Where every Delta goes (the output processor's)."""
        return self.outputs.emit

    @emit.setter
    def emit(self, emit: Emit) -> None:
        self.outputs.emit = emit

    @property
    def waiting(self) -> deque[Session]:
        """The scheduler's queue (read it; change it through the scheduler)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Session]:
        """The scheduler's running sessions (read them; change them through the scheduler)."""
        return self.scheduler.running

    @property
    def loads(self) -> DiskLoads:
        """The sessions parked on a lower tier's load (the scheduler's)."""
        return self.scheduler.loads

    @property
    def refills(self) -> TurnRefills:
        """The pending turn refills (the cache writer's)."""
        return self.writer.refills

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier (the cache writer's), None when off."""
        return self.writer.disk

    @property
    def shared(self) -> SharedTier | None:
        """The shared tier on Redis (the cache writer's), None when off."""
        return self.writer.shared

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def room(self) -> Room:
        """The admission state now (engine/admission.py), between mutations."""
        return self.scheduler.room()

    # ---- public -------------------------------------------------------------------------------

    def add(self, request: Request, matcher: TokenMatcher | None = None) -> None:
        """Queue a validated request (its prompt fits: len(prompt) < max_model_len). `matcher`: its
        constraint compiled already (`compile`, off the engine thread: AsyncEngine does); without one a
        constrained request is compiled here, on the caller's thread."""
        sp = request.sampling
        s = Session(request=request, detok=IncrementalDetokenizer(self.tokenizer, sp.stop, sp.stop_skip),
                    generator=make_generator(sp.seed), matcher=matcher)
        self.counters.num_requests += 1
        if sp.constraint is not None and matcher is None:
            try:
                s.matcher = self.compile(sp.constraint)
            except Exception as e:  # the server checked the grammar; this is a last resort
                log.exception("constraint of %s refused", request.request_id)
                self.outputs.finish(s, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
                return
        self.scheduler.queue(s)

    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar compiler, built once on first use unless given to the constructor.
        Thread-safe: a second caller waits for the build under way. Its build holds the GIL throughout
        (~0.45 s, llguidance's LLTokenizer), so even on a worker thread it would pause the engine thread's
        Python for as long: the server has it built as soon as it serves, before any request is likely
        (AsyncEngine.build_grammars_soon; docs/architecture.md, "Admission")."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self.runner.decoder.arch.vocab_size)
            return self._grammars

    def compile(self, constraint: Constraint) -> TokenMatcher:
        """A fresh matcher for `constraint` (building the compiler first if need be). Touches no session:
        any thread may call it, and AsyncEngine does on a worker thread, beside the step. Raises
        InvalidRequest for a grammar that does not compile."""
        return self.grammars().matcher(constraint)

    @property
    def has_grammars(self) -> bool:
        return self._grammars is not None

    def abort(self, request_id: str) -> None:
        """Finish the request (every choice) now with ABORT (usage = what was actually computed).
        Unknown ids and finished requests: no-op."""
        for s in self.scheduler.take(request_id):
            self.outputs.finish(s, FinishReason.ABORT)

    def abort_all(self, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        """End every request (waiting, running, parked) with `reason` (and `error` for the client)."""
        self.writer.refills.drop(lambda ns: True)
        for s in self.scheduler.take_all():
            self.scheduler.unqueue(s)
            self.outputs.finish(s, reason, error=error)

    def flush(self, scope: FlushScope) -> FlushReport:
        """Forget the namespaces `scope` selects in every tier (engine/control.py)."""
        return control.flush(self.cache, self.scheduler, self.writer, scope)

    def flush_local(self, scope: FlushScope) -> FlushReport:
        """Forget the namespaces `scope` selects in RAM and on disk; the caller then flushes the shared
        tier and calls `loads.flushed(scope)` (engine/control.py)."""
        return control.flush_local(self.cache, self.scheduler, self.writer, scope)

    def recover(self, message: str) -> None:
        """`step()` raised `message`: put the sessions of the failed step back or end their requests,
        as its record tells (engine/control.py `recover`); the next step starts a new record."""
        rec, self.record = self.record, StepRecord()
        control.recover(rec, self.scheduler, self.writer, self.outputs, message)

    def has_work(self) -> bool:
        """Requests to serve (waiting, running, loading). Turn refills are background work: the
        engine loop runs them a layer at a time while this is False, eager ones between steps too."""
        return self.scheduler.has_work()

    def background(self, eager: bool = False) -> bool:
        """One layer of background work (a turn refill, engine/refill.py); False when there is none.
        `eager`: only work towards an eager refill (the engine loop's share of a busy engine's time)."""
        refills = self.writer.refills
        if eager:
            return refills.run_eager_layer()
        if not refills:
            return False
        refills.run_layer()
        return True

    def step(self) -> None:
        """Admit waiting requests, run one batched forward (decode rows + prefill chunks), sample.

        A transaction in effect (engine/step_record.py): a fault in one session's part ends only its
        request, and the step goes on; when the step raises (the forward, shared work), the caller
        hands the error to `recover`, which reads `self.record`, this step's record, and puts every
        session back as it was before the step."""
        self.record = rec = StepRecord()
        fail = self.outputs.fail_request
        self.scheduler.admit(self._start, fail)
        rec.phase = StepPhase.RESTORE
        for s in [s for s in self.scheduler.running if s.pending_restore is not None]:
            with guarded(fail, s):
                self._restore(s)
        rec.phase = StepPhase.BATCH
        items: list[StepItem] = []
        prefill_ends: list[tuple[Session, int, int, StepItem]] = []
        decoding: list[Session] = []
        budget = self.config.max_batch_tokens
        active = self.scheduler.active()  # a suspect runs alone (engine/control.py recover)
        for s in active:
            if s.phase is Phase.DECODE and s.pending_token is not None:
                with guarded(fail, s):
                    assert s.state is not None, "a decoding session without its state"
                    items.append(StepItem(s.state, [rec.take_token(s)], decode=True))
                    decoding.append(s)
                    budget -= 1
        for s, limit in self.scheduler.prefill_plan([s for s in active if s.phase is Phase.PREFILL], budget):
            with guarded(fail, s):
                start, end = s.next_prefill_chunk(limit)
                assert s.state is not None, "a prefilling session without its state"
                item = StepItem(s.state, s.request.prompt_ids[start:end], want_logits=end == s.prompt_len)
                if (num_top := s.request.sampling.prompt_logprobs) is not None:
                    item.targets, item.num_top = s.request.prompt_ids[start + 1 : end + 1], num_top
                items.append(item)
                prefill_ends.append((s, start, end, item))
                rec.fed.append((s, None))
                budget -= end - start
        rec.phase = StepPhase.FORWARD
        if items:
            self.runner.step(items)
            self.counters.num_steps += 1
        rec.phase = StepPhase.OUTPUTS
        if self.scheduler.has_suspects() and rec.fed:
            self.scheduler.passed(rec.fed[0][0])  # it ran alone and passed
        self.outputs.after_forward(prefill_ends, decoding)

    # ---- a session starts: cache lookup and restore ---------------------------------------------

    def _start(self, s: Session) -> None:
        """Look the prompt up (finishing the turn refills it continues first) and copy the hit, or take a
        full hit's first token from its entry. The counters and the PREFILL / DECODE phase change only
        once all of that worked: a session that fails here served nothing."""
        req = s.request
        reuse = self.scheduler.reuses(req)
        refills = self.writer.refills
        refilled = refills.complete_for(req.namespace, tuple(req.prompt_ids)) if refills and reuse else (0, 0)
        hit = self.cache.lookup(req.namespace, req.prompt_ids) if reuse else None
        if isinstance(hit, Hit):
            self.cache.pin(hit.entry)  # held until the copy is made (now, or in this step's restores for a full hit)
            s.pending_restore = hit.entry
            s.num_cached = hit.num_cached_tokens
            # tokens a pending refill computed just now, for this prompt: served from the cache, billed as computed
            s.num_refilled = max(0, min(s.num_cached, refilled[1]) - refilled[0])
        full = s.num_cached == s.prompt_len
        if not full:
            self._restore(s)
            self.writer.plan(s, hit)  # where prefill stops for the cache: boundary, checkpoints
        s.phase = Phase.DECODE if full else Phase.PREFILL
        self.counters.num_prompt_tokens += s.num_cached  # the rest as prefill computes it (step)
        self.counters.num_cached_tokens += s.num_cached - s.num_refilled
        self.counters.num_computed_prompt_tokens += s.num_refilled
        if full:  # the entry's stored logits give the first token now; the KV copy is made with the step's restores
            self.outputs.sample_next(s)
        else:  # usage known so far, so that a request aborted mid-prefill is billed with its cached tokens
            self.outputs.emit_usage(s)

    def _restore(self, s: Session) -> None:
        """Give the session its own state: a deep copy of the pinned hit, or a fresh one, with room for
        the prompt and a first stretch of output (it grows as it decodes)."""
        room = s.prompt_len + min(s.request.sampling.max_tokens, self.max_model_len - s.prompt_len, GROW_TOKENS)
        entry = s.pending_restore
        if entry is None:
            s.state = self.runner.new_state(room)
        else:
            try:
                s.state = entry.state.restore(s.num_cached, room - s.num_cached, self.runner.kv_pool)
            finally:
                s.pending_restore = None
                self.cache.unpin(entry)
        s.state.grow_limit = tokens_needed(s.request, self.max_model_len)  # what admission reserved for it
