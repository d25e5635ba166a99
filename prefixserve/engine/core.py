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
from prefixserve.engine.detok import IncrementalDetokenizer
from prefixserve.engine.grammar import GrammarCompiler
from prefixserve.engine.protocol import TokenizerLike
from prefixserve.engine.session import Phase, Session
from prefixserve.runner import ModelRunner, StepItem, adjust_logits, make_generator, sample, token_logprob
from prefixserve.types import Delta, FinishReason, InvalidRequest, Request, TokenLogprob

log = logging.getLogger("prefixserve.engine")

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
        """The tokenizer's grammar compiler (built once; needs a transformers tokenizer)."""
        if self._grammars is None:
            hf = getattr(self.tokenizer, "hf", None)
            if hf is None:
                raise InvalidRequest("constrained decoding needs a transformers tokenizer")
            self._grammars = GrammarCompiler(hf, self.runner.decoder.arch.vocab_size)
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
        for s in list(self.waiting) + list(self.running):
            if s in self.waiting:
                self.waiting.remove(s)
            self._finish(s, reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
        if items:
            self.runner.step(items)
            self.counters.num_steps += 1
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

    def _fork(self, s: Session) -> None:
        """n > 1: choice 0 has the prompt's last logits; choices 1..n-1 start from deep copies of its
        state (or pin the same full-hit entry), each with its own generator (seed + index) and its own
        grammar matcher, and sample their first token now. The prompt was prefilled once."""
        s.choices.append(s)
        sp = s.request.sampling
        for index in range(1, s.request.num_choices):
            child = Session(
                request=s.request, detok=IncrementalDetokenizer(self.tokenizer, sp.stop),
                generator=make_generator(None if sp.seed is None else sp.seed + index),
                phase=Phase.DECODE, num_cached=s.num_cached, index=index, choices=s.choices,
                matcher=None if s.matcher is None else s.matcher.fork(),
            )
            if s.state is not None:
                child.state = s.state.clone()
            else:  # a full hit: every choice copies the cache entry itself (each holds its own pin)
                self.cache.pin(s.pending_restore)
                child.pending_restore = s.pending_restore
            s.choices.append(child)
            self.running.append(child)
        for child in s.choices[1:]:
            self._sample(child)

    def _sample(self, s: Session) -> None:
        if s.request.num_choices > 1 and not s.choices:
            self._fork(s)
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
        """Cache prompt + reply so the next turn of the conversation hits its own history. Only when
        decoding gives a token the bits prefilling it would (no 4-bit decode weights): otherwise the
        reply's KV differs from a recomputation's, and the turn's prompt entry is all we may offer."""
        st = s.state
        if not self.config.offer_finished_turns or st is None or st.num_tokens <= s.prompt_len:
            return
        if not self.runner.decoder.decode_matches_prefill:
            return
        ids = tuple(s.request.prompt_ids) + tuple(s.output_ids[: st.num_tokens - s.prompt_len])
        if self.exact_reuse and self.cache.config.max_bytes > 0:
            self.cache.insert(s.request.namespace, ids, st.snapshot())
