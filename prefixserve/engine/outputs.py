"""The output processor: what happens to a session's logits once a step has produced them (sampling,
stops, detokenising, logprobs), and how a session ends (finishing, failing).

Engine-thread only, like the rest of the engine (engine/core.py drives it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prefixserve.cache import PrefixCache
from prefixserve.engine.cache_writer import CacheWriter
from prefixserve.engine.choices import fork_choices
from prefixserve.engine.counters import EngineCounters
from prefixserve.engine.protocol import TokenizerLike
from prefixserve.engine.scheduler import Scheduler
from prefixserve.engine.session import Phase, Session, Snapshot
from prefixserve.engine.step_record import guarded
from prefixserve.runner import ModelRunner, StepItem, adjust_logits, sample, scored_logprobs, token_logprob
from prefixserve.types import Delta, FinishReason, TokenLogprob

log = logging.getLogger("prefixserve.engine")

Emit = Callable[[str, Delta], None]  # hands a request's Delta to its stream


class OutputProcessor:
    """Samples, stops and finishes sessions, and hands each Delta to `emit` (request id, Delta: a
    public attribute, set by whoever streams them, AsyncEngine). A finishing session leaves the
    scheduler (its slot and reservation) and makes its cache offers through the writer."""

    def __init__(self, runner: ModelRunner, tokenizer: TokenizerLike, cache: PrefixCache[Snapshot],
                 scheduler: Scheduler, writer: CacheWriter, counters: EngineCounters, max_model_len: int,
                 emit: Emit) -> None:
        self.emit = emit
        self._runner = runner
        self._tokenizer = tokenizer
        self._cache = cache
        self._scheduler = scheduler
        self._writer = writer
        self._counters = counters
        self._max_model_len = max_model_len

    def after_forward(self, prefill_ends: list[tuple[Session, int, int, StepItem]], decoding: list[Session]) -> None:
        """The step's forward went through: take its results session by session (a prompt's chunk with
        its checkpoints and scored logprobs, a finished prompt's first token and cache inserts, the decode
        rows' next tokens). Each session's part is `guarded`: a fault in it ends its request only."""
        for s, start, end, item in prefill_ends:
            self._counters.num_computed_prompt_tokens += end - start
            self._counters.num_prompt_tokens += end - start
            with guarded(self.fail_request, s):
                self._writer.after_chunk(s, end)  # a snapshot-only state's boundary and checkpoints
                if item.scores is not None:
                    s.prompt_logprobs.extend(scored_logprobs(item.targets, item.scores))
                if end == s.prompt_len:
                    s.phase = Phase.DECODE
                    s.to_insert.append(end)
                    if s.request.sampling.prompt_logprobs is not None:
                        self.emit_prompt_logprobs(s)
                    self.sample_next(s)  # the first token goes out before the snapshot copies below
                    self._writer.flush_inserts(s)
        for s in decoding:
            if s.phase is Phase.DECODE:
                with guarded(self.fail_request, s):
                    self.sample_next(s)

    def sample_next(self, s: Session) -> None:
        """Sample the session's next token from its last logits; emit it, or finish the session (EOS,
        a stop string or token, the grammar's end, max_tokens, the context). The token is fed to the
        model by the next step (`Session.pending_token`). Raises when a fork, the grammar matcher or
        the sampler fails (the caller's `guarded` ends the request); nothing has gone out then."""
        if s.request.sampling.max_tokens == 0:  # the prompt only (fed, and scored where asked)
            self.finish(s, FinishReason.LENGTH)
            return
        if s.request.num_choices > 1 and not s.choices:  # n > 1: fork the others (engine/choices.py)
            for child in fork_choices(s, self._tokenizer, self._cache):
                self._scheduler.add_running(child)
                self.sample_next(child)
        if s.state is not None:
            logits = s.state.logits
        else:  # a full hit whose copy is still pending
            assert s.pending_restore is not None
            logits = s.pending_restore.state.logits
        assert logits is not None
        sp = s.request.sampling
        allowed = None if s.matcher is None else s.matcher.allowed()
        if allowed is not None and not bool(allowed.any()):  # the grammar admits nothing more
            self.finish(s, FinishReason.STOP)
            return
        try:
            token = sample(adjust_logits(logits, sp, s.output_ids, allowed), sp, s.generator)
        except (RuntimeError, ValueError) as e:  # one request's sampling must never fail the batch
            log.warning("sampling failed for %s: %s", s.request.request_id, e)
            self.finish(s, FinishReason.ERROR, error=f"sampling failed: {type(e).__name__}: {e}")
            return
        if s.matcher is not None:
            s.matcher.consume(token)
        if s.first_token_at is None:
            s.first_token_at = time.monotonic()
        s.output_ids.append(token)
        self._counters.num_completion_tokens += 1
        reason: FinishReason | None = None
        text = ""
        if (token in self._tokenizer.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            reason = FinishReason.STOP  # a stop token is not output: no text, no logprob entry
        else:
            text = s.detok.add(token)
            if sp.num_logprobs is not None:
                s.held_logprobs.append(token_logprob(logits, token, sp.num_logprobs))
            if s.detok.stopped or (s.matcher is not None and s.matcher.done):
                reason = FinishReason.STOP
        if reason is None and (
            len(s.output_ids) >= sp.max_tokens or s.prompt_len + len(s.output_ids) >= self._max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is None:
            s.pending_token = token
            self.emit(s.request.request_id, Delta(text=text, token_ids=(token,), usage=s.usage(), index=s.index,
                                                  logprobs=settled_logprobs(s)))
        else:
            self.finish(s, reason, text, (token,))

    def emit_usage(self, s: Session) -> None:
        """The usage known so far, in an empty Delta (a request aborted mid-prefill is billed its
        cached tokens)."""
        self.emit(s.request.request_id, Delta(text="", token_ids=(), usage=s.usage()))

    def emit_prompt_logprobs(self, s: Session) -> None:
        """The prompt's logprobs, scored while it was prefilled, once for each choice (before any of
        them samples: choices fork from this session after it)."""
        entries = tuple(s.prompt_logprobs)
        s.prompt_logprobs = []
        for index in range(s.request.num_choices):
            self.emit(s.request.request_id, Delta(text="", token_ids=(), usage=s.usage(), index=index,
                                                  prompt_logprobs=entries))

    def finish(
        self, s: Session, reason: FinishReason, text: str = "", token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (), error: str | None = None,
    ) -> None:
        """End the session with `reason`: its usage (what was computed), the cache offers of a normal
        finish, its KV freed, the final Delta emitted. The Delta always goes out: a fault in the cache
        offers turns a normal finish into ERROR with the fault (an abort stays one). It leaves the
        running sessions; a queued one the caller takes out of the queue first. Finished: no-op."""
        if s.phase is Phase.FINISHED:
            return
        usage = s.usage()  # before the phase changes: an unfinished prompt bills what was processed
        prefilling = s.phase is Phase.PREFILL
        s.phase = Phase.FINISHED
        s.pending_token = None
        self._scheduler.stop_running(s)
        try:
            if reason in (FinishReason.STOP, FinishReason.LENGTH):
                self._writer.flush_inserts(s)
                self._writer.offer_turn(s)
            elif reason is FinishReason.ABORT and prefilling:
                self._writer.keep_computed(s)
        except Exception as e:
            log.exception("the cache offers of %s failed", s.request.request_id)
            if reason is not FinishReason.ABORT:
                reason, error = FinishReason.ERROR, f"{type(e).__name__}: {e}"
        s.finish_reason = reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._counters.num_finished += 1
        else:
            self._counters.num_aborted += 1
        if s.pending_restore is not None:
            self._cache.unpin(s.pending_restore)
            s.pending_restore = None
        self._scheduler.release(s)
        text += s.detok.flush()
        logprobs += settled_logprobs(s)
        self.emit(s.request.request_id, Delta(text=text, token_ids=token_ids, finish_reason=reason, usage=usage,
                                              index=s.index, logprobs=logprobs, error=error))
        refills = self._writer.refills
        if s.state is not None and not refills.owns(s.state):
            self._runner.recycle(s.state)  # its buffer serves the next session (runner/state.py KVPool)
        s.state = None  # free the session's KV now
        # its reservation is free and its state may wait for a refill: the two may differ (a pooled buffer is
        # up to a quarter larger), and the session budget holds them both (only now: a state a refill drops
        # here is recycled once, by the refill)
        refills.shed(self._scheduler.free_bytes())

    def fail_request(self, s: Session, message: str) -> None:
        """End `s`'s request, every choice of it, with ERROR and `message` (an OpenAI 500 for its client);
        each final Delta carries the usage so far. Wherever its sessions are (queued, half admitted,
        running, suspect), they leave, free their reservation, pins and KV. A session that never finished
        its admission served nothing: usage 0. No-op for finished sessions."""
        for c in list(s.choices or [s]):
            self._scheduler.unqueue(c)
            if c.phase is Phase.WAITING and c.state is not None:  # copied, but never served
                self._runner.recycle(c.state)
                c.state = None
            self.finish(c, FinishReason.ERROR, error=message)
        self._scheduler.drop_finished_suspects()


def settled_logprobs(s: Session) -> tuple[TokenLogprob, ...]:
    """The held logprob entries whose tokens' text is settled (engine/detok.py num_settled): an
    entry goes out with the delta that carries its token's text (part of a character waits for the
    rest), and the entries of a stop string's tokens, whose text was cut, never go out."""
    if not s.held_logprobs:  # no logprobs asked for (the common case): nothing to look up
        return ()
    n = min(s.detok.num_settled - s.num_logprobs_out, len(s.held_logprobs))
    if n <= 0:
        return ()
    out = tuple(s.held_logprobs[:n])
    del s.held_logprobs[:n]
    s.num_logprobs_out += n
    return out
