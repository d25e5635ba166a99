"""More threads for the big matmuls than for everything else, without ever changing a bit.

torch runs on one thread on 2 cores (engine.default_num_threads): an OpenMP team waits at each of
a forward's ~1,000 parallel regions for all its threads, so with every core in the team, a core
taken by another process stalls every region (docs/architecture.md, "Threads"). But a forward's
time is mostly a few large calls: the 4-bit decode matmuls and the dense prefill tiles. Those
calls, and only those, run on `threads` (every usable core by default, `--decode-threads`); the
native attention kernel's calls are split by rows into that many parts run at once (`parallel`).

Exactness: these kernels split their output columns between threads and reduce each output in
one fixed loop, so on the machines measured their bits do not depend on the thread count (bf16
tiles of 64 and 16 rows and the int4 kernel, Intel Xeon AMX: 1 and 2 threads equal). That is a
property of the BLAS build and the CPU, not a promise, so the start-up self-test checks every call
shape in use at both counts (runner/selftest.py `check_threads`), and a kind of call runs on more
threads only once it passed (`allow`). The native attention computes each row on its own
(attention.c), so a split by rows cannot change a bit (checked all the same).

Stalls: each threaded call is timed; one that takes STALL_FACTOR times the fastest of its kind
(same call site and shape) plus STALL_SLACK_S (about a scheduler time slice: what waiting for a
taken core costs) is a stall. STALLS_TO_BACK_OFF stalls within STALL_WINDOW_S mean another process
holds a core: then nearly every call stalls (hundreds a second). Fewer are the server's own other
threads or the VM: an idle 2-core VM showed one or two 1-2.5 ms stalls a second, a server
streaming one 256-token answer over HTTP up to 6 a second (its event loop and the client share
the second core); backing off at 5 a second cost that stream 86 -> 69 tokens/s. Calls then run on
torch's count for BACKOFF_S seconds before trying again. Switching costs ~0.2 us and no bits.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), at least one: the default team for the big calls."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


class KernelThreads:
    STALL_FACTOR = 4.0
    STALL_SLACK_S = 1e-3
    STALLS_TO_BACK_OFF = 20
    STALL_WINDOW_S = 1.0
    BACKOFF_S = 2.0

    def __init__(self) -> None:
        self.threads = 1
        # kinds the self-test showed thread-count invariant: "int4" (the 4-bit decode matmuls), "dense"
        # (the dense tiles and lm_head), "attention" (native attention calls split by rows, `parallel`)
        self.allowed: set[str] = set()
        self.backoff_until = 0.0
        self.stalls = 0
        self.backoffs = 0
        self._recent_stalls: deque[float] = deque(maxlen=self.STALLS_TO_BACK_OFF)
        self._fastest: dict[Hashable, float] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def configure(self, threads: int) -> None:
        """Threads for the allowed kinds; nothing is allowed until `allow` (the self-test)."""
        self.threads = max(1, threads)
        self.allowed = set()
        self._fastest.clear()

    def parallel_ways(self, kind: str) -> int:
        """How many parts `parallel` would run at once for `kind` now (1: all on this thread)."""
        if kind not in self.allowed or self.threads <= 1 or time.monotonic() < self.backoff_until:
            return 1
        return self.threads

    def parallel(self, fns: list[Callable[[], None]]) -> None:
        """Run independent parts at once (each writes its own output; ctypes calls, which release the
        GIL): fns[0] on this thread, the others on a pool. The pool's parts finishing more than
        STALL_FACTOR times this thread's time plus STALL_SLACK_S after it count as a stall, as in `run`."""
        if len(fns) == 1:
            fns[0]()
            return
        if self._pool is None or self._pool_size < len(fns) - 1:
            if self._pool is not None:
                self._pool.shutdown(wait=False)  # idle: its threads exit
            # a new thread's MKL and OpenMP counts are their defaults (every core), not what torch set on
            # this one (mkl_set_num_threads_local, omp_set_num_threads are per thread): set them alike
            base = torch.get_num_threads()
            self._pool = ThreadPoolExecutor(len(fns) - 1, thread_name_prefix="prefixserve-kernel",
                                            initializer=torch.set_num_threads, initargs=(base,))
            self._pool_size = len(fns) - 1
        futures = [self._pool.submit(f) for f in fns[1:]]
        t0 = time.perf_counter()
        try:
            fns[0]()
        finally:
            mine = time.perf_counter() - t0
            for f in futures:
                f.result()
        if time.perf_counter() - t0 - mine > self.STALL_FACTOR * mine + self.STALL_SLACK_S:
            self._stalled()

    def allow(self, kinds: set[str]) -> None:
        self.allowed = set(kinds)

    def describe(self) -> str:
        """For /health and the log: which calls run on how many threads."""
        base = torch.get_num_threads()
        if self.threads <= base or not self.allowed:
            return f"{base} threads"
        return f"{base} threads ({', '.join(sorted(self.allowed))} calls on {self.threads})"

    def run(self, kind: str, key: Hashable, fn: Callable[[], T]) -> T:
        base = torch.get_num_threads()
        if kind not in self.allowed or self.threads <= base or time.monotonic() < self.backoff_until:
            return fn()
        torch.set_num_threads(self.threads)
        try:
            t0 = time.perf_counter()
            y = fn()
            took = time.perf_counter() - t0
        finally:
            torch.set_num_threads(base)
        self._timed(key, took)
        return y

    def team(self, kind: str, key: Hashable, fn: Callable[[int], T], ways: int | None = None) -> T:
        """fn(ways) for a native call that runs on a team of `ways` threads (decode.c): what `kind` is
        allowed now, timed like `run` (its stall rule, keyed by call site and shape); or exactly
        `ways` when given (the self-test's comparisons), untimed."""
        if ways is not None:
            return fn(ways)
        ways = self.parallel_ways(kind)
        if ways <= 1:
            return fn(1)
        t0 = time.perf_counter()
        y = fn(ways)
        self._timed(key, time.perf_counter() - t0)
        return y

    def _timed(self, key: Hashable, took: float) -> None:
        fastest = self._fastest.get(key)
        if fastest is None or took < fastest:
            self._fastest[key] = took
        elif took > self.STALL_FACTOR * fastest + self.STALL_SLACK_S:
            self._stalled()

    def _stalled(self) -> None:
        self.stalls += 1
        now = time.monotonic()
        self._recent_stalls.append(now)
        if len(self._recent_stalls) == self.STALLS_TO_BACK_OFF and now - self._recent_stalls[0] < self.STALL_WINDOW_S:
            self.backoffs += 1
            self.backoff_until = now + self.BACKOFF_S
            self._recent_stalls.clear()

    def on(self, threads: int, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on exactly `threads` threads (the self-test's comparisons)."""
        base = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(base)


KERNEL_THREADS = KernelThreads()
