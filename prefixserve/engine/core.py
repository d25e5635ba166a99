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
from prefixserve.config import EngineConfig
from prefixserve.engine.choices import fork_choices
from prefixserve.engine.detok import IncrementalDetokenizer
from prefixserve.engine.grammar import GrammarCompiler
from prefixserve.engine.protocol import TokenizerLike
from prefixserve.engine.session import Phase, Session, TurnRefill
from prefixserve.runner import ModelRunner, StepItem, adjust_logits, make_generator, sample, token_logprob
from prefixserve.types import Delta, FinishReason, InvalidRequest, Request, TokenLogprob

log = logging.getLogger("prefixserve.engine")

MIN_BOUNDARY_TOKENS = 16  # shorter common prefixes (a chat template's header) are not worth an entry
MAX_PENDING_REFILLS = 8  # finished turns waiting to be re-fed (each holds its session's KV); oldest dropped

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
        self._pending: dict[tuple[str, int], int] = {}  # Session.key -> sampled token not yet fed to the model
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self.refills: deque[TurnRefill] = deque()  # finished 4-bit-decoded turns to re-feed, oldest first
        self.counters = EngineCounters()

    # ---- public -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a validated request (its prompt fits: len(prompt) < max_model_len)."""
        sp = request.sampling
        s = Session(request=request, detok=IncrementalDetokenizer(self.tokenizer, sp.stop),
                    generator=make_generator(sp.seed))
        self.counters.num_requests += 1
        if sp.constraint is not None:
            try:
                s.matcher = self.grammars().matcher(sp.constraint)
            except InvalidRequest as e:  # the server checked the grammar; this is a last resort
                log.warning("constraint of %s refused: %s", request.request_id, e)
                self._finish(s, FinishReason.ERROR)
                return
        self.waiting.append(s)

    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar compiler (built once, on the first constrained request)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self.runner.decoder.arch.vocab_size)
        return self._grammars

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

    def abort_all(self, reason: FinishReason = FinishReason.ABORT) -> None:
        self.refills.clear()
        for s in list(self.waiting) + list(self.running):
            if s in self.waiting:
                self.waiting.remove(s)
            self._finish(s, reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.refills)

    def step(self) -> None:
        """Admit waiting requests, run one batched forward (decode rows + prefill chunks), sample."""
        self._admit()
        for s in self.running:
            if s.pending_restore is not None:
                self._restore(s)
        items: list[StepItem] = []
        prefill_ends: list[tuple[Session, int, int]] = []
        decoding: list[Session] = []
        budget = self.config.max_batch_tokens
        for s in self.running:
            if s.phase is Phase.DECODE and s.key in self._pending:
                items.append(StepItem(s.state, [self._pending.pop(s.key)], decode=True))  # type: ignore[arg-type]
                decoding.append(s)
                budget -= 1
        for s in self.running:
            if s.phase is not Phase.PREFILL or budget <= 0:
                continue
            start, end = s.next_prefill_chunk(min(self.config.prefill_chunk_tokens, budget))
            items.append(StepItem(s.state, s.request.prompt_ids[start:end], want_logits=end == s.prompt_len))  # type: ignore[arg-type]
            prefill_ends.append((s, start, end))
            budget -= end - start
        refill = self._refill_item(budget) if not prefill_ends and not self.waiting else None
        if refill is not None:
            items.append(refill)
        if items:
            self.runner.step(items)
            self.counters.num_steps += 1
        if refill is not None:
            self._finish_refill()
        for s, start, end in prefill_ends:
            self.counters.num_computed_prompt_tokens += end - start
            if end == s.prompt_len:
                s.phase = Phase.DECODE
                s.to_insert.append(end)
                self._sample(s)  # the first token goes out before the snapshot copies below
                self._flush_inserts(s)
        for s in decoding:
            if s.phase is Phase.DECODE:
                self._sample(s)

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- admission: cache lookup and restore --------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            s = self.waiting.popleft()
            self.running.append(s)
            self._start(s)

    def _start(self, s: Session) -> None:
        req = s.request
        if self.refills:
            self._complete_refills_for(req)
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

    def _restore(self, s: Session) -> None:
        """Give the session its own state: a deep copy of the pinned hit, or a fresh one."""
        room = s.prompt_len + min(s.request.sampling.max_tokens, self.max_model_len - s.prompt_len)
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
            self._insert(s, num_tokens)
        s.to_insert.clear()

    def _insert(self, s: Session, num_tokens: int) -> None:
        if not self.exact_reuse or self.cache.config.max_bytes == 0:
            return
        assert s.state is not None and num_tokens <= s.state.num_tokens
        self.cache.insert(s.request.namespace, s.request.prompt_ids[:num_tokens], s.state.snapshot(num_tokens))

    # ---- decode: sampling, stopping, finishing ------------------------------------------------

    def _sample(self, s: Session) -> None:
        if s.request.num_choices > 1 and not s.choices:  # n > 1: fork the others (engine/choices.py)
            for child in fork_choices(s, self.tokenizer, self.cache):
                self.running.append(child)
                self._sample(child)
        if s.state is not None:
            logits = s.state.logits
        else:  # a full hit whose copy is still pending
            logits = s.pending_restore.state.logits  # type: ignore[union-attr]
        assert logits is not None
        sp = s.request.sampling
        allowed = None if s.matcher is None else s.matcher.allowed()
        if allowed is not None and not bool(allowed.any()):  # the grammar admits nothing more
            self._finish(s, FinishReason.STOP)
            return
        try:
            token = sample(adjust_logits(logits, sp, s.output_ids, allowed), sp, s.generator)
        except (RuntimeError, ValueError) as e:  # one request's sampling must never fail the batch
            log.warning("sampling failed for %s: %s", s.request.request_id, e)
            self._finish(s, FinishReason.ERROR)
            return
        if s.matcher is not None:
            s.matcher.consume(token)
        if s.first_token_at is None:
            s.first_token_at = time.monotonic()
        s.output_ids.append(token)
        self.counters.num_completion_tokens += 1
        reason: FinishReason | None = None
        text = ""
        logprobs: tuple[TokenLogprob, ...] = ()
        if (token in self.tokenizer.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            reason = FinishReason.STOP  # a stop token is not output: no text, no logprob entry
        else:
            text = s.detok.add(token)
            if sp.num_logprobs is not None:
                logprobs = (token_logprob(logits, token, sp.num_logprobs),)
            if s.detok.stopped or (s.matcher is not None and s.matcher.done):
                reason = FinishReason.STOP
        if reason is None and (
            len(s.output_ids) >= sp.max_tokens or s.prompt_len + len(s.output_ids) >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is None:
            self._pending[s.key] = token
            self.emit(s.request.request_id, Delta(text=text, token_ids=(token,), usage=s.usage(), index=s.index,
                                                  logprobs=logprobs))
        else:
            self._finish(s, reason, text, (token,), logprobs)

    def _finish(self, s: Session, reason: FinishReason, text: str = "", token_ids: tuple[int, ...] = (),
                logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if s.phase is Phase.FINISHED:
            return
        s.phase = Phase.FINISHED
        s.finish_reason = reason
        self._pending.pop(s.key, None)
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
        text += s.detok.flush()
        self.emit(s.request.request_id, Delta(text=text, token_ids=token_ids, finish_reason=reason, usage=s.usage(),
                                              index=s.index, logprobs=logprobs))
        s.state = None  # free the session's KV now

    def _offer_turn(self, s: Session) -> None:
        """Cache prompt + reply so the next turn of the conversation hits its own history.

        Dense decode runs the prefill calls, so the session's state is exact as it is (the reply's
        last token was never fed). With 4-bit decode rows the reply's KV has other bits than a
        recomputation's: the state is cut back to its exact prompt and the whole reply is queued to
        be re-fed by prefill (`TurnRefill`), off the steps that serve prompts."""
        st = s.state
        if not self.config.offer_finished_turns or st is None or not s.output_ids:
            return
        if not self.exact_reuse or self.cache.config.max_bytes == 0:
            return
        if self.runner.decoder.decode_matches_prefill:
            if st.num_tokens > s.prompt_len:
                ids = tuple(s.request.prompt_ids) + tuple(s.output_ids[: st.num_tokens - s.prompt_len])
                self.cache.insert(s.request.namespace, ids, st.snapshot())
            return
        st.truncate(s.prompt_len)
        self.refills.append(TurnRefill(s.request.namespace, tuple(s.request.prompt_ids) + tuple(s.output_ids), st))
        if len(self.refills) > MAX_PENDING_REFILLS:
            self.refills.popleft()

    def _refill_item(self, budget: int) -> StepItem | None:
        """The next chunk of the oldest pending refill, within `budget` tokens (None: nothing to do)."""
        if not self.refills or budget <= 0:
            return None
        r = self.refills[0]
        start = r.state.num_tokens
        end = min(len(r.token_ids), start + min(self.config.prefill_chunk_tokens, budget))
        return StepItem(r.state, r.token_ids[start:end], want_logits=end == len(r.token_ids))

    def _complete_refills_for(self, req: Request) -> None:
        """A new prompt that continues a pending refill's turn (the next message of that chat) would
        compute the same reply tokens itself: finish that refill now, so the prompt hits all of it."""
        for r in list(self.refills):
            if r.namespace != req.namespace or len(req.prompt_ids) <= r.state.num_tokens:
                continue
            if req.prompt_ids[: r.state.num_tokens + 1] != r.token_ids[: r.state.num_tokens + 1]:
                continue
            self.refills.remove(r)
            self.refills.appendleft(r)
            while self.refills and self.refills[0] is r:
                item = self._refill_item(self.config.prefill_chunk_tokens)
                assert item is not None
                self.runner.step([item])
                self._finish_refill()

    def _finish_refill(self) -> None:
        """After a step that fed the oldest refill: insert it once it covers the whole turn."""
        r = self.refills[0]
        if r.state.num_tokens == len(r.token_ids):
            self.refills.popleft()
            self.cache.insert(r.namespace, r.token_ids, r.state.snapshot())
