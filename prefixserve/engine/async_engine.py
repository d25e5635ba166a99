"""The async face of the engine: one engine thread runs steps; asyncio callers stream Deltas."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from prefixserve.engine import admission, control, metrics_snapshot
from prefixserve.engine.core import EngineCore
from prefixserve.engine.protocol import EngineHealth, FlushReport, TokenizerLike
from prefixserve.engine.refill import EagerShare
from prefixserve.engine.streams import Streams
from prefixserve.engine.torch_thread import TorchThread, release_free_memory
from prefixserve.engine.validate import kv_bytes, validate
from prefixserve.runner.identity import runtime_identity
from prefixserve.types import (
    Delta,
    FinishReason,
    FlushScope,
    InvalidRequest,
    Request,
    Unavailable,
    Usage,
)

log = logging.getLogger("prefixserve.engine")
T = TypeVar("T")
MAX_FAILED_STEPS = 3  # failed steps in a row (no progress) after which every request is failed
# idle this long after work, the engine hands glibc's free pages back (torch_thread.release_free_memory):
# not between back-to-back requests, whose next allocations would fault those pages in again
TRIM_AFTER_IDLE_S = 2.0


class AsyncEngine:
    """Implements engine.protocol.EngineClient.

    Thread model: `core` is touched only by the engine thread. Callers hand work over through a
    thread-safe inbox; the engine thread hands Deltas back with `loop.call_soon_threadsafe`.
    """

    def __init__(self, core: EngineCore, model_id: str, tokenizer: TokenizerLike, selftest_detail: str,
                 vocab_size: int, thread: TorchThread | None = None, model_source: str = "") -> None:
        self.core = core
        self.model_id = model_id
        self.max_model_len = core.max_model_len
        self.max_session_tokens = core.max_session_tokens
        self.session_budget_tokens = core.session_budget_tokens
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._selftest_detail = selftest_detail
        self._model_source = model_source  # the weights' path (fingerprinted), "" when not known
        self._fingerprint = self._digest()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # the inbox's requests and the core's room: what waits, what is queued (engine/admission.py)
        self._admission = admission.AdmissionQueue(core.room())
        self._wake = threading.Event()
        self._eager = EagerShare()  # a busy engine's time for eager turn refills (engine/refill.py)
        self._streams = Streams()
        self._accepting = True
        self._stop = False
        self._last_failure: str | None = None  # the last failed step (its requests failed; serving went on)
        self._dead: str | None = None  # why the engine loop cannot continue; then every request ends at once
        # held by the engine thread while it touches the core (inbox work, a step); never taken by a
        # reader: /metrics reads the snapshot published at the end of each (engine/metrics_snapshot.py)
        self._core_lock = threading.Lock()
        self._snapshot = metrics_snapshot.take(core)
        core.emit = self._emit
        self._thread = thread or TorchThread()
        self._thread.run_last(self._run)
        # a process that exits without shutdown() (a script, a test) must not leave the engine thread
        # inside a torch op while the interpreter finalises: std::terminate kills the process (rc 134)
        atexit.register(self._stop_at_exit)

    # ---- EngineClient -------------------------------------------------------------------------

    async def generate(self, request: Request) -> AsyncIterator[Delta]:
        self.validate(request)
        matcher = None
        if request.sampling.constraint is not None:  # compiled beside the step (InvalidRequest: a 400), never in it
            matcher = await asyncio.to_thread(self.core.compile, request.sampling.constraint)
        rid = request.request_id
        # the stream first, then the checks: an engine dying after this ends it (`_die` sees it), and
        # one that died before it is seen here; never a stream that nothing will end
        q = self._streams.open(rid)
        try:
            if self._dead is not None:
                raise Unavailable(f"the engine has stopped: {self._dead}")
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            # counted into the inbox, or Overloaded past --max-queued-requests
            self._admission.submit(admission.Waiting(rid, kv_bytes(self.core, request), request.num_choices,
                                                     request.namespace.tenant_id), self.core.config.max_queued_requests)
        except BaseException:
            self._streams.close(rid, q, 0, early=False)
            raise
        self._submit("add", (request, matcher))
        finished = False  # every choice finished, or the request failed
        num_left = request.num_choices
        try:
            while True:
                delta = await q.get()
                if delta.finish_reason is not None:
                    num_left -= 1
                    finished = num_left == 0 or delta.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
                yield delta
                if finished:
                    return
        finally:
            self._streams.close(rid, q, num_left, early=not finished)  # early: the abort's usage is kept
            if num_left > 0:  # the client went away, or one choice failed: stop the others
                self._admission.forget(rid)  # a request still waiting counts no more
                self._submit("abort", rid)

    async def abandoned_usage(self, request_id: str) -> Usage | None:
        """The final usage of a request whose stream was closed early: what its abort found computed
        (a request still queued: nothing). Waits for the engine (it drains its inbox between steps),
        boundedly (engine/streams.py); once per request; None when unknown."""
        return await self._streams.abandoned_usage(request_id)

    def validate(self, request: Request) -> None:
        """Raises PromptTooLong / InvalidRequest before any work is queued (engine/validate.py)."""
        validate(self.core, self.vocab_size, request)

    async def flush_cache(self, scope: FlushScope) -> FlushReport:
        """Forget what `scope` selects in every tier (the caller checked who may): RAM and disk on the
        engine thread, between steps; then Redis's SCAN on a worker thread while the engine serves
        on, its sessions kept from reading the scope there until it ends (engine/control.py)."""
        fut: Future[FlushReport] = Future()
        self._submit("call", (lambda: self.core.flush_local(scope), fut))
        local = await asyncio.wrap_future(fut)
        shared = self.core.shared
        if shared is None:
            return local
        try:
            redis = await asyncio.to_thread(control.flush_shared, shared, scope)
        finally:
            self._submit("call", (lambda: self.core.loads.flushed(scope), Future()))
        return FlushReport((*local.tiers, redis))

    def health(self) -> EngineHealth:
        """Lock-free: the counts the admission queue last published, and values fixed at start."""
        counts = self._admission.counts()
        return EngineHealth(
            ok=self._thread.is_alive() and self._dead is None,
            exact_reuse=self.core.exact_reuse,
            detail=self._selftest_detail + (f"; last failed step: {self._last_failure}" if self._last_failure else "")
            + (f"; ENGINE STOPPED: {self._dead}" if self._dead else ""),
            num_running=self.core.num_running(),
            num_waiting=counts.num_waiting,
            num_queued=counts.num_queued,
            decode_kernel=self.core.runner.decoder.decode_kernel,
            fingerprint=self._fingerprint,
            dtype=str(self.core.runner.decoder.dtype).removeprefix("torch."),
            tiles=str(self.core.runner.decoder.tiles),
        )

    def fingerprint(self) -> str:
        """`system_fingerprint`: a digest of everything that decides the bits of an output here: the
        model, the self-test's verdict and the runtime's identity (runner/identity.py, as the tiers').
        Fixed at start."""
        return self._fingerprint

    def _digest(self) -> str:
        d = self.core.runner.decoder
        parts = (self.model_id, self._model_source, d.arch.arch, str(d.arch.vocab_size), str(d.dtype), d.decode_kernel,
                 str(d.tiles), str(self.core.exact_reuse), self._selftest_detail, runtime_identity(d).digest())
        return "fp_" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:12]

    def metrics(self) -> dict[str, float]:
        """The figures the engine thread published after its last locked section (never waits for a
        step: a prefill step holds the lock for seconds); the peak, oldest wait and tiers read live, and
        the waiting and queued requests as /health counts them (engine/admission.py)."""
        out = metrics_snapshot.read(self.core, self._snapshot, self._admission.peak)
        counts = self._admission.counts()
        return out | {"waiting": float(counts.num_waiting), "queued": float(counts.num_queued)}

    def _publish(self) -> None:
        """On the engine thread, between mutations: replace the snapshot /metrics reads and the room the
        queue bound reads. A failure keeps the last ones (a metrics bug must not stop the engine)."""
        try:
            self._snapshot = metrics_snapshot.take(self.core)
            self._admission.publish(self.core.room())
        except Exception:
            log.exception("publishing the engine's metrics failed")

    def end_all(self, error: str) -> None:
        """Refuse new requests from now on (Unavailable) and end every request the engine holds,
        running, queued or still in the inbox, at the engine thread's next turn (after the step in
        progress): each choice's final Delta has finish_reason ABORT, `error` for the client, and the
        usage computed so far, as a client's abort bills. The engine keeps running (shutdown drains
        it); calling again ends whatever came in since. For the bounded shutdown (server/shutdown.py)."""
        self._accepting = False
        self._submit("abort_all", error)

    def build_grammars_soon(self) -> None:
        """Build the tokenizer's grammar compiler (tools, response_format) on a thread of its own, now
        that the server serves: its build holds the GIL for ~0.5 s (llguidance's LLTokenizer), which
        at start-up kept a second start's `/health` waiting that long. A constrained request arriving
        meanwhile waits for the same build (`EngineCore.grammars`); one whose tokenizer can have no
        compiler, or whose build failed (logged), gets the error, or builds again, itself."""

        def build() -> None:
            try:
                self.core.grammars()
            except InvalidRequest:
                pass
            except Exception:
                log.exception("building the grammar compiler failed; the first constrained request tries again")

        threading.Thread(target=build, name="prefixserve-grammar-build", daemon=True).start()

    def _stop_at_exit(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(10.0)

    async def shutdown(self, drain: bool = True) -> None:
        atexit.unregister(self._stop_at_exit)
        self._accepting = False
        if drain:
            while self._dead is None and self._thread.is_alive() and (self.core.has_work() or not self._inbox.empty()):
                await asyncio.sleep(0.05)
        else:
            self._submit("abort_all", None)
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10.0)
        if self.core.disk is not None:  # land the queued write-through files before exiting
            await asyncio.to_thread(self.core.disk.close, 30.0)
        if self.core.shared is not None:  # send the queued values (a dead Redis drops them at once)
            await asyncio.to_thread(self.core.shared.close, 30.0)

    # ---- engine thread ------------------------------------------------------------------------

    def _submit(self, kind: str, arg: Any) -> None:
        self._inbox.put((kind, arg))
        self._wake.set()

    def _emit(self, request_id: str, delta: Delta) -> None:
        if delta.finish_reason is not None:  # a client that saw its request end finds it in /metrics
            self._publish()
        self._streams.emit(request_id, delta)

    @contextlib.contextmanager
    def _mutating(self) -> Iterator[None]:
        """The engine thread's hold on the core: its lock; /metrics' snapshot republished as it is let go."""
        with self._core_lock:
            try:
                yield
            finally:
                self._publish()

    def _run(self) -> None:
        """The engine loop. A failed step fails only the requests it concerns (engine/step_record.py,
        EngineCore.recover); a failure of the loop's own bookkeeping, or MAX_FAILED_STEPS failed steps
        in a row, stops the engine: /health turns 503 and every open request ends with the error."""
        failed_in_a_row, worked, last_work = 0, False, 0.0
        try:
            while not self._stop:
                with self._core_lock:
                    if self._drain_inbox():
                        self._publish()
                    idle = not self.core.has_work()
                if idle:
                    if self._background():
                        last_work = time.monotonic()
                        continue  # one layer at a time: the inbox is looked at again after each
                    if worked and time.monotonic() - last_work >= TRIM_AFTER_IDLE_S:
                        worked = False
                        release_free_memory()
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    started = time.monotonic()
                    with self._mutating():
                        self.core.step()
                    failed_in_a_row, worked, last_work = 0, True, time.monotonic()
                    self._eager.after_step(last_work - started, lambda: self._background(eager=True))
                except Exception as e:  # a bug or OOM in one batch: isolate it, keep serving the rest
                    failed_in_a_row += 1
                    message = f"{type(e).__name__}: {e}"
                    log.exception("engine step failed")
                    self._last_failure = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {message}"
                    with self._mutating():
                        if failed_in_a_row >= MAX_FAILED_STEPS:
                            self.core.abort_all(FinishReason.ERROR, error=message)
                            failed_in_a_row = 0
                        else:
                            self.core.recover(message)
        except Exception as e:  # the loop itself broke: nothing can be trusted to run any more
            log.exception("the engine loop stopped")
            self._die(f"{type(e).__name__}: {e}")

    def _background(self, eager: bool = False) -> bool:
        """One layer of background work while idle, or `eager` between steps (engine/refill.py); False when
        none. A failure drops the background work (a cache optimisation) and serving goes on."""
        try:
            with self._mutating():
                return self.core.background(eager)
        except Exception:
            log.exception("a turn refill failed; pending refills dropped")
            with self._mutating():
                self.core.refills.drop(lambda ns: True)
            return False

    def _die(self, message: str) -> None:
        """Stop serving: refuse new requests and end every open stream with the error now."""
        self._dead = message
        self._accepting = False
        rids = self._streams.ids()
        for rid in rids:
            self._emit(rid, Delta(text="", token_ids=(), finish_reason=FinishReason.ERROR,
                                  error=f"the engine stopped: {message}"))

    def _drain_inbox(self) -> bool:
        """Take in what callers handed over; False when there was nothing."""
        drained = False
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            if kind == "add":  # arg: (the request, its compiled constraint or None)
                request, matcher = arg
                try:  # out of the inbox and into the core's queue as one change for the readers
                    self._admission.take(self.core, request, matcher)
                except Exception as e:  # this request only: it cannot be queued
                    log.exception("could not queue request %s", request.request_id)
                    self._emit(request.request_id, Delta(text="", token_ids=(), finish_reason=FinishReason.ERROR,
                                                     usage=Usage(0, 0, 0), error=f"{type(e).__name__}: {e}"))
            elif kind == "abort":
                try:
                    self.core.abort(arg)
                except Exception:  # its session may be half-finished; the loop goes on
                    log.exception("aborting request %s failed", arg)
            elif kind == "abort_all":  # arg: the error each request ends with (None: none)
                self.core.abort_all(FinishReason.ABORT, error=arg)
            elif kind == "call":  # a function to run on this thread, its result to a Future
                fn, fut = arg
                try:
                    result = fn()
                except Exception as e:  # noqa: BLE001 - handed to the awaiting caller
                    self._publish()
                    fut.set_exception(e)
                else:
                    self._publish()  # e.g. a flush: its caller's next scrape sees the cache without it
                    fut.set_result(result)
