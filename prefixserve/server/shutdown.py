"""A bounded graceful shutdown: uvicorn's server with a grace period (docs/architecture.md, "Shutdown").

    signal ──▶ stop accepting, close idle connections ──▶ in-flight requests finish ... up to grace_s
                                         second signal, or grace_s passed ──▶ engine.end_all(...)
           ──▶ streams end with an error event, others get a 503, each billed what was computed
           ──▶ a request still running SETTLE_S later gets its last word (server/in_flight.py), then its
               task is cancelled ──▶ lifespan: drain engine, close ledger

uvicorn's own handler is replaced: it re-raises the signal once the server is done (a death by
SIGTERM, exit status 143) and, on a second Ctrl-C, sets `force_exit`, which skips the app's lifespan
shutdown, so the engine would not drain and the ledger would not close. Requests are ended through
the engine rather than by cancelling their tasks, so that every body ends properly and the ledger
sees each one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from prefixserve.engine.protocol import EngineClient
from prefixserve.server.errors import SHUTTING_DOWN
from prefixserve.server.in_flight import Endings

logger = logging.getLogger("prefixserve.server")

# after the engine has ended the requests: how long their responses may take to go out (a final
# event, a 503) before the connections still open are cancelled (a client that stopped reading)
SETTLE_S = 5.0
POLL_S = 0.05


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose shutdown gives requests in flight `grace_s` seconds, then has `engine`
    end the rest (`EngineClient.end_all`); a second SIGTERM / SIGINT ends them at once. The app's
    lifespan shutdown always runs. `engine` None: nothing to end (an app without one)."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient | None, grace_s: float,
                 endings: Endings | None = None, on_started: Callable[[], Any] | None = None) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self.endings = endings  # the app's (app.state.endings): the last word of a request cancelled
        self.on_started = on_started  # once the sockets accept (run.py: the start-up's last line)
        self.signals: list[str] = []  # the names of the signals received, in order

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the signal's context: only records (the shutdown task reads it and logs)."""
        self.signals.append(signal.Signals(sig).name)
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        bound = asyncio.ensure_future(self._bound())
        try:
            await super().shutdown(sockets=sockets)
        finally:
            bound.cancel()

    async def _bound(self) -> None:
        """Wait up to grace_s (or until a second signal) for the requests in flight, then end them."""
        tasks = self.server_state.tasks  # one per HTTP request being served
        first = self.signals[0] if self.signals else "shutdown"
        if not tasks:
            logger.info("%s: shutting down: no requests in flight", first)
            return
        logger.info("%s: shutting down: %d request(s) in flight, waiting up to %g s (signal again to stop them "
                    "now)", first, len(tasks), self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while tasks and len(self.signals) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if not tasks:
            return
        if len(self.signals) >= 2:
            logger.warning("%s, a second signal: stopping the %d request(s) in flight now", self.signals[1], len(tasks))
        else:
            logger.warning("shutdown timeout of %g s reached: stopping the %d request(s) still in flight",
                           self.grace_s, len(tasks))
        if self.engine is not None:
            self.engine.end_all(SHUTTING_DOWN)
        deadline = time.monotonic() + SETTLE_S
        while tasks and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if not tasks:
            return
        # their last word first (a 503, a stream's error event), from tasks of its own: a cancelled
        # request may still wait for the engine (an abort's usage) before its task ends
        stuck = list(tasks)
        told = sum(self.endings.end(task) for task in stuck) if self.endings is not None else 0
        logger.error("cancelling %d request(s) that did not end within %g s of being stopped; %d of them get a 503 "
                     "or their stream's error event first", len(stuck), SETTLE_S, told)
        for task in stuck:
            task.cancel()
        await asyncio.sleep(SETTLE_S)
        for connection in list(self.server_state.connections):  # uvicorn waits for every one to close
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.close()
