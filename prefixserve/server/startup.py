"""`prefixserve serve`'s start-up, told as it happens: on the console and to /health.

    launch ─▶ importing ─▶ loading_model [─▶ native_kernels ─▶ loading_model] ─▶ self_test ─▶ [cache_tiers]
           ─▶ starting_http ─▶ ready

(`native_kernels`: a first start whose kernels still compile when the model loader first needs them.)

`StartupProgress` holds the phase the start-up is in. Each `phase()` prints one line on stdout
(stderr keeps a failed start's one-line error alone): the time since the process was launched, what
it is doing, and how long the same phase took at the last start of this model where that was at
least MIN_ESTIMATE_S (`startup-times.json` beside the prepared-model cache). A phase still running
after `TICK_S` prints a line again every `TICK_S`. `ready()` prints the URL, the total start-up time
and each phase's; a start-up whose log level is above info prints nothing.

`LoadingServer` answers HTTP on the server's socket while the model loads, so /health is observable
from the moment the port is bound: ``GET /health`` is 503 ``{"status": "loading", "phase",
"elapsed_s", "phase_elapsed_s", "detail"}`` (`estimate_s` where known); every other request a 503 in
OpenAI's error shape (code ``model_loading``) with Retry-After. Each response closes its connection.
`hand_over` stops it the moment the app's lifespan start-up completes, just before uvicorn serves
the same socket: connections arriving in between wait in the socket's backlog, none is refused.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any

logger = logging.getLogger("prefixserve.server")

TICK_S = 10.0  # a phase still running says so again this often
MAX_RECORDS = 16  # models (path, dtype, device) whose last start-up times are kept
MIN_ESTIMATE_S = 1.0  # a phase that took less last time is not worth an estimate on the console
MAX_BODY_READ = 1 << 20  # a loading server reads at most this much of a request body before answering
PHASE_LABELS = {"importing": "runtime", "native_kernels": "native kernels", "loading_model": "model",
                "self_test": "self-test", "cache_tiers": "cache tiers", "starting_http": "HTTP"}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def process_age_s() -> float:
    """Seconds since this process was launched (Linux: /proc), so the start-up time includes the
    interpreter's own start and imports; 0.0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class StartupProgress:
    """The start-up's current phase and the time each took. Thread-safe: phases are entered from the
    engine's thread as well as the main one, and read by the loading server's threads.

    `timings_path`: the JSON file holding the last start-up's phase times per `key` (None: no
    estimates, nothing written). `out`: where the lines go (None: nowhere)."""

    def __init__(self, out: IO[str] | None = sys.stdout, timings_path: str | None = None, key: str = "",
                 tick_s: float = TICK_S) -> None:
        self._out = out
        self._lock = threading.Lock()
        self._t0 = time.monotonic() - process_age_s()
        self._timings_path = timings_path
        self._key = key
        self._last = self._read_last()
        self._phase = "starting"
        self._detail = "starting"
        self._phase_t = time.monotonic()
        self._durations: dict[str, float] = {}
        self._ready = False
        self._tick_s = tick_s
        self._wake = threading.Event()
        self._ticker: threading.Thread | None = None
        if out is not None and tick_s > 0:
            self._ticker = threading.Thread(target=self._tick, name="prefixserve-startup-ticker", daemon=True)
            self._ticker.start()

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def phase(self, name: str, detail: str) -> None:
        """End the current phase and enter `name`, doing `detail` (a few words); prints its line. A
        phase entered again (the fp32 retry's model load) adds to its time."""
        with self._lock:
            self._end_phase()
            self._phase, self._detail, self._phase_t = name, detail, time.monotonic()
            estimate = self._last.get(name)
        hint = f" (last start: {estimate:.1f} s)" if estimate is not None and estimate >= MIN_ESTIMATE_S else ""
        self._say(f"{detail}{hint} ...")

    def ready(self, url: str, model: str) -> float:
        """End the start-up: print the URL, the total time and each phase's; record them as the next
        start's estimates. Returns the total seconds."""
        with self._lock:
            self._end_phase()
            self._ready = True  # the phase stays: a loading answer still in flight says "starting_http"
            total = self.elapsed()
            parts = ", ".join(f"{PHASE_LABELS.get(k, k)} {v:.1f} s" for k, v in self._durations.items())
        self._wake.set()
        self._say(f"ready on {url}, serving {model}: started in {total:.1f} s ({parts})")
        self._write_last(total)
        return total

    def close(self) -> None:
        """Stop the ticker (a start-up that failed or was stopped)."""
        self._ready = True
        self._wake.set()

    def snapshot(self) -> dict[str, Any]:
        """What /health answers while loading."""
        with self._lock:
            now = time.monotonic()
            body: dict[str, Any] = {"status": "loading", "phase": self._phase,
                                    "elapsed_s": round(now - self._t0, 2),
                                    "phase_elapsed_s": round(now - self._phase_t, 2), "detail": self._detail}
            if (estimate := self._last.get(self._phase)) is not None:
                body["estimate_s"] = round(estimate, 2)
            return body

    def _end_phase(self) -> None:
        if self._phase != "starting" and not self._ready:
            spent = time.monotonic() - self._phase_t
            self._durations[self._phase] = self._durations.get(self._phase, 0.0) + spent

    def _say(self, text: str) -> None:
        if self._out is None:
            return
        with contextlib.suppress(OSError, ValueError):  # a closed console never stops the server
            print(f"prefixserve: [{self.elapsed():6.1f}s] {text}", file=self._out, flush=True)

    def _tick(self) -> None:
        while not self._wake.wait(self._tick_s):
            if self._ready:
                return
            with self._lock:
                spent, detail = time.monotonic() - self._phase_t, self._detail
                estimate = self._last.get(self._phase)
            if spent >= self._tick_s:
                of = f" of ~{estimate:.0f} s last time" if estimate is not None else ""
                self._say(f"... still {detail} ({spent:.0f} s{of})")

    def _read_last(self) -> dict[str, float]:
        if self._timings_path is None:
            return {}
        try:
            with open(self._timings_path) as f:
                record = json.load(f).get(self._key) or {}
            return {k: float(v) for k, v in record.get("phases", {}).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def _write_last(self, total: float) -> None:
        """Failures are logged, never raised: the file only gives estimates."""
        if self._timings_path is None:
            return
        folder = os.path.dirname(self._timings_path) or "."
        try:
            try:
                with open(self._timings_path) as f:
                    records = json.load(f)
                if not isinstance(records, dict):
                    records = {}
            except (OSError, ValueError):
                records = {}
            records.pop(self._key, None)
            records[self._key] = {"phases": {k: round(v, 3) for k, v in self._durations.items()},
                                  "total": round(total, 3),
                                  "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
            records = dict(list(records.items())[-MAX_RECORDS:])  # insertion order: the newest last
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
            with os.fdopen(fd, "w") as f:
                json.dump(records, f, indent=1)
            os.replace(tmp, self._timings_path)
        except OSError as e:
            logger.warning("start-up: cannot record its times in %s (%s)", self._timings_path, e)


class _Handler(BaseHTTPRequestHandler):
    server: _LoadingHTTPServer
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= MAX_BODY_READ:
            self.rfile.read(int(length))  # read what was sent, so closing does not reset the connection
        state = self.server.progress.snapshot()
        if self.path.split("?", 1)[0] == "/health":
            body = state
        else:
            message = (f"the server is starting ({state['phase']}: {state['detail']}, {state['elapsed_s']:.1f} s); "
                       "retry shortly")
            body = {"error": {"message": message, "type": "service_unavailable", "param": None,
                              "code": "model_loading"}}
        data = json.dumps(body).encode()
        remaining = max(0.0, state.get("estimate_s", 0.0) - state["phase_elapsed_s"])
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Retry-After", str(max(1, min(30, round(remaining)))))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _answer

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("while loading: " + format, *args)


class _LoadingHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, sock: socket.socket, progress: StartupProgress) -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()  # the one the base class made: ours is bound already
        self.socket = sock
        self.progress = progress


class LoadingServer:
    """Serves `progress` on `sock` (bound, see run.bind_socket) from `start()` until `stop()`; the
    socket is left listening and open for uvicorn."""

    def __init__(self, sock: socket.socket, progress: StartupProgress, backlog: int = 2048) -> None:
        sock.listen(backlog)
        self._httpd = _LoadingHTTPServer(sock, progress)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="prefixserve-loading-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop answering (idempotent); returns once no further connection will be accepted here."""
        with self._lock:
            if self._thread is not None:
                self._httpd.shutdown()
                self._thread = None


def hand_over(app: ASGIApp, on_startup_complete: Callable[[], None]) -> ASGIApp:
    """`app`, calling `on_startup_complete` as its lifespan start-up completes or fails, just before
    uvicorn starts serving its sockets."""

    async def wrapped(scope: Scope, receive: Callable[[], Awaitable[Message]],
                      send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def watched(message: Message) -> None:
            if message["type"] in ("lifespan.startup.complete", "lifespan.startup.failed"):
                on_startup_complete()
            await send(message)

        return await app(scope, receive, watched)

    return wrapped
