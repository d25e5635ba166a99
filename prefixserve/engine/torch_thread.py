"""The one OS thread that does all of a model's torch work (see TorchThread)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger("prefixserve.engine")
T = TypeVar("T")


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`), once the engine has
    been idle a while (AsyncEngine, TRIM_AFTER_IDLE_S): the KV of finished sessions and evicted
    entries is freed into glibc's arenas, which keep it, so after a burst of long prompts RSS stayed
    ~900 MiB above what the server held (QA, default malloc settings). On the engine thread, only
    between bursts."""
    if _TRIM is not None:
        _TRIM(0)


class TorchThread:
    """The one OS thread that does all of a model's torch work: loading, self-test, engine loop.

    With OpenMP, every thread that runs parallel torch ops gets its own worker team; once the
    teams together hold more threads than there are cores, libgomp stops spinning and sleeps
    between regions, and a 2-thread decode step on 2 cores took 26 ms instead of 13 (measured:
    model loaded on the main thread, stepped on another). Keeping everything on this thread
    keeps one team."""

    def __init__(self, name: str = "prefixserve-engine") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller of call()
                fut.set_exception(e)

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the thread; wait for its result (or exception)."""
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def run_last(self, fn: Callable[[], Any]) -> None:
        """Run fn on the thread without waiting; the thread ends when it returns (an exception it
        raises is logged: nobody waits for its result)."""
        fut: Future[Any] = Future()
        fut.add_done_callback(_log_failure)
        self._jobs.put((fn, fut))
        self._jobs.put(None)

    def close(self) -> None:
        """End the thread after the jobs already queued."""
        self._jobs.put(None)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def _log_failure(fut: Future[Any]) -> None:
    if (e := fut.exception()) is not None:
        log.error("the engine thread ended with %s: %s", type(e).__name__, e, exc_info=e)
