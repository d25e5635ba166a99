"""The synchronous engine: admission and the scheduler step, cache lookups and restores. Sampling,
stops and finishing are engine/outputs.py; cache offers engine/inserts.py; recovery engine/control.py.

Driven by exactly one thread (see async_engine.py). Every cache and runner call happens here.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prefixserve.cache import Hit, PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.cache.shared import SharedTier
from prefixserve.config import EngineConfig, session_tokens
from prefixserve.engine import admission, control, inserts, outputs
from prefixserve.engine.detok import IncrementalDetokenizer
from prefixserve.engine.disk_loads import DiskLoads
from prefixserve.engine.grammar import GrammarCompiler, TokenMatcher
from prefixserve.engine.protocol import FlushReport, TokenizerLike
from prefixserve.engine.refill import TurnRefills
from prefixserve.engine.session import Phase, Session, Snapshot, kv_bytes_needed, slots_needed, tokens_needed
from prefixserve.engine.step_record import StepPhase, StepRecord, guarded
from prefixserve.runner import (
    ModelRunner,
    StepItem,
    make_generator,
)
from prefixserve.runner.pieces import PieceStore
from prefixserve.types import (
    Constraint,
    Delta,
    FinishReason,
    FlushScope,
    Request,
    TokenLogprob,
)

log = logging.getLogger("prefixserve.engine")

GROW_TOKENS = 256  # output room reserved at admission; the KV grows (doubling) beyond it
CHUNK_GRAIN = 64  # prompt chunks shrink in steps of this many tokens (the dense tile's rows)
LONG_CONTEXT_KEYS = 2048  # in a step shared with other sessions, a chunk deep in a long prompt does at most
SHARED_GRAIN = 16  # a quarter of the attention work of a full one at this many keys, down to this many rows
LONE_CONTEXT_KEYS = 8192  # alone in its step, at most the work of a full chunk at this many keys

Emit = Callable[[str, Delta], None]


@dataclass(slots=True)
class EngineCounters:
    """Since start. The prompt counters count what was served, as usage bills it: a request aborted
    mid-prefill adds the tokens it reached, not its prompt's length (prompt = cached + computed)."""

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
        cache: PrefixCache[Snapshot],
        config: EngineConfig,
        max_model_len: int,
        emit: Emit,
        exact_reuse: bool = True,
        disk: DiskTier | None = None,
        shared: SharedTier | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`grammars`: the tokenizer's grammar compiler when it was built already (build_engine builds it
        beside the self-test); else the first constrained request builds it (`grammars`)."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.cache = cache
        self.config = config
        self.max_model_len = max_model_len
        # the most tokens one session may reserve (prompt + max_tokens); a budget below a small request's is refused
        self.session_budget_tokens = session_tokens(config.max_session_bytes, runner.kv_bytes_per_token())
        self.max_session_tokens = min(max_model_len, self.session_budget_tokens)
        self.emit = emit
        self.exact_reuse = exact_reuse  # False: the self-test failed, so never reuse across requests
        self.waiting: deque[Session] = deque()  # in arrival order; started in admission.FairShare's
        self.fair = admission.FairShare()
        self.running: list[Session] = []
        self._grammars = grammars
        self._grammars_lock = threading.Lock()  # `grammars` may be called off the engine thread
        self.suspects: list[Session] = []  # sessions of a failed batch, run alone until cleared (engine/control.py)
        self.record = StepRecord()  # what the step under way has done (engine/step_record.py)
        self._reserved_bytes = 0  # KV bytes admitted sessions may grow to (max_session_bytes bounds it)
        self.refills = TurnRefills(runner, config.prefill_chunk_tokens, lambda ns, key, st: inserts.store_steps(self, ns, key, st))  # finished turns, re-fed
        self.counters = EngineCounters()
        self.pieces = PieceStore()  # KV shared between cache entries, stored once (docs/cache.md)
        self.disk = disk  # the disk tier (docs/cache.md), None when off
        self.shared = shared  # the shared tier on Redis (docs/cache.md), None when off
        self.loads = DiskLoads(disk, cache, self.pieces, shared)  # sessions waiting on a lower tier's load

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
                self._finish(s, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
                return
        self.waiting.append(s)

    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar compiler, built once on first use unless given to the constructor.
        Thread-safe. Its build holds the GIL throughout (~0.45 s, llguidance's LLTokenizer), so even on a
        worker thread it would pause the engine thread's Python for as long: build_engine builds it at
        start, beside the self-test (docs/architecture.md, "Admission")."""
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
        for s in self.waiting:
            if s.request.request_id == request_id:
                self.waiting.remove(s)
                self._finish(s, FinishReason.ABORT)
                return
        for s in [s for s in self.running if s.request.request_id == request_id]:
            self._finish(s, FinishReason.ABORT)
        if (parked := self.loads.take(request_id)) is not None:
            self._finish(parked, FinishReason.ABORT)

    def abort_all(self, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        """End every request (waiting, running, parked) with `reason` (and `error` for the client)."""
        self.refills.drop(lambda ns: True)
        self.suspects = []
        for s in list(self.waiting) + list(self.running) + self.loads.take_all():
            if s in self.waiting:
                self.waiting.remove(s)
            self._finish(s, reason, error=error)

    def flush(self, scope: FlushScope) -> FlushReport:
        """Forget the namespaces `scope` selects in every tier (engine/control.py)."""
        return control.flush(self, scope)

    def has_work(self) -> bool:
        """Requests to serve (waiting, running, loading). Turn refills are background work: the
        engine loop runs them a layer at a time while this is False, eager ones between steps too."""
        return bool(self.waiting or self.running or self.loads)

    def background(self, eager: bool = False) -> bool:
        """One layer of background work (a turn refill, engine/refill.py); False when there is none.
        `eager`: only work towards an eager refill (the engine loop's share of a busy engine's time)."""
        if eager:
            return self.refills.run_eager_layer()
        if not self.refills:
            return False
        self.refills.run_layer()
        return True

    def step(self) -> None:
        """Admit waiting requests, run one batched forward (decode rows + prefill chunks), sample.

        A transaction in effect (engine/step_record.py): a fault in one session's part ends only its
        request, and the step goes on; when the step raises (the forward, shared work), the caller
        hands the error to `control.recover`, which reads `self.record`, this step's record, and puts
        every session back as it was before the step."""
        self.record = rec = StepRecord()
        self._admit()
        rec.phase = StepPhase.RESTORE
        for s in [s for s in self.running if s.pending_restore is not None]:
            with guarded(self, s):
                self._restore(s)
        rec.phase = StepPhase.BATCH
        items: list[StepItem] = []
        prefill_ends: list[tuple[Session, int, int, StepItem]] = []
        decoding: list[Session] = []
        budget = self.config.max_batch_tokens
        self.suspects = [s for s in self.suspects if s.phase is not Phase.FINISHED]
        active = self.suspects[:1] or list(self.running)  # a suspect runs alone (engine/control.py recover)
        for s in active:
            if s.phase is Phase.DECODE and s.pending_token is not None:
                with guarded(self, s):
                    assert s.state is not None, "a decoding session without its state"
                    items.append(StepItem(s.state, [rec.take_token(s)], decode=True))
                    decoding.append(s)
                    budget -= 1
        for s, limit in self._prefill_plan([s for s in active if s.phase is Phase.PREFILL], budget):
            with guarded(self, s):
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
        if self.suspects and rec.fed:
            self.suspects = [x for x in self.suspects if x is not rec.fed[0][0]]  # it ran alone and passed
        outputs.after_forward(self, prefill_ends, decoding)

    def _prefill_plan(self, prefilling: list[Session], budget: int) -> list[tuple[Session, int]]:
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

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- admission: cache lookup and restore --------------------------------------------------

    def _admit(self) -> None:
        if self.loads:  # loaded from disk: back to the front of the queue, their entries in RAM now
            self.waiting.extendleft(reversed(self.loads.ready(block=not self.running and not self.waiting)))
        taken = sum(slots_needed(r) for r in self.running)
        for s in self.fair.order(self.running, self.waiting):  # fair between tenants (admission.FairShare)
            if taken >= self.config.max_num_seqs or (self.running and taken + slots_needed(s) > self.config.max_num_seqs):
                break  # n > 1 takes n slots: any n while nothing runs
            with guarded(self, s):  # a fault in its admission ends its request only
                if admission.follows(self, s):  # waits, in its place, for a prompt under way that will serve it
                    continue
                need = kv_bytes_needed(s.request, self.max_model_len, self.runner.kv_bytes_per_token()) - s.reserved_bytes
                if self.running and self._reserved_bytes + need > self.config.max_session_bytes:
                    break  # waits until running sessions finish and free their share
                self.waiting.remove(s)
                self.fair.started(s)
                s.reserved_bytes += need
                self._reserved_bytes += need
                self.refills.shed(self.config.max_session_bytes - self._reserved_bytes)  # before its KV is allocated
                if not (self._reuses(s.request) and self.loads.park(s)):
                    self.running.append(s)
                    self._start(s)
                taken += slots_needed(s)
        # pooled buffers (runner/state.py KVPool), pending turn refills and the admitted sessions' KV share
        # the session budget: the server's memory bound (docs/operations.md, "Memory") holds with the pool full
        self.runner.kv_pool.trim(self.config.max_session_bytes - self._reserved_bytes - self.refills.nbytes())

    def _start(self, s: Session) -> None:
        """Look the prompt up (finishing the turn refills it continues first) and copy the hit, or take a
        full hit's first token from its entry. The counters and the PREFILL / DECODE phase change only
        once all of that worked: a session that fails here served nothing."""
        req = s.request
        reuse = self._reuses(req)
        refilled = self.refills.complete_for(req.namespace, tuple(req.prompt_ids)) if self.refills and reuse else (0, 0)
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
            inserts.plan(self, s, hit)  # where prefill stops for the cache: boundary, checkpoints
        s.phase = Phase.DECODE if full else Phase.PREFILL
        self.counters.num_prompt_tokens += s.num_cached  # the rest as prefill computes it (step)
        self.counters.num_cached_tokens += s.num_cached - s.num_refilled
        self.counters.num_computed_prompt_tokens += s.num_refilled
        if full:  # the entry's stored logits give the first token now; the KV copy is made with the step's restores
            self._sample(s)
        else:  # usage known so far, so that a request aborted mid-prefill is billed with its cached tokens
            self.emit(req.request_id, Delta(text="", token_ids=(), usage=s.usage()))

    def _reuses(self, req: Request) -> bool:
        """Whether `req` may be served from any cache tier. Not where the self-test refused reuse, and
        not with prompt logprobs: they need the logits of every prompt position, which no entry holds."""
        return self.exact_reuse and req.sampling.prompt_logprobs is None

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

    # ---- decode: sampling, stopping, finishing (engine/outputs.py) -------------------------------

    def _sample(self, s: Session) -> None:
        outputs.sample_next(self, s)

    def _finish(
        self, s: Session, reason: FinishReason, text: str = "", token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (), error: str | None = None,
    ) -> None:
        outputs.finish(self, s, reason, text, token_ids, logprobs, error)
