"""The last word of a request the shutdown has to cancel (docs/architecture.md, "Shutdown").

The bounded shutdown ends requests through the engine, and each one answers for itself: a 503 or,
for a stream, the error event. A request that has still not ended a few seconds later (its engine
step has not returned, it waits for a body the client never sends, its client stopped reading) has
its task cancelled, and uvicorn answers a cancelled task with a plain-text 500, or cuts a stream that
had started without its final event. `EndingsMiddleware` prevents it: for each request, `Endings`
knows whether the response has started and, for a stream, what its last event is (`on_stream_start`,
registered by streaming.SSEResponse: the error event in the stream's own shape, then `[DONE]` where
the shape ends with it). `Endings.end(task)` writes that last word from a task of
its own, first, before the request's task is cancelled, so that nothing the cancelled request still
waits for (an engine step, an abort's usage) can delay or prevent it; the app's later writes are
dropped, and the cancellation is absorbed once the last word is out.

What cannot get a last word: a non-streaming body already partly written (nothing may follow it),
and any response whose client stopped reading until the socket buffers filled (uvicorn writes
nothing more until it reads: the last word waits until the server closes the connection).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.server.errors import SHUTTING_DOWN, error_response, unavailable

logger = logging.getLogger("prefixserve.server")


class InFlight:
    """One HTTP request: how far its response got, and the last word the shutdown may write for it."""

    __slots__ = ("_send", "complete", "ended", "farewell", "started", "stream_end")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False  # http.response.start sent
        self.complete = False  # the response's last body message sent
        self.stream_end: Callable[[], str] | None = None  # a started stream's last event(s)
        self.ended = False  # taken over by the shutdown: the app's writes are dropped from now on
        self.farewell: asyncio.Future[None] | None = None  # the last word being written

    async def send(self, message: Message) -> None:
        if self.ended:
            return
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def last_word(self) -> None:
        """A 503 in OpenAI's shape if nothing was sent yet, else the stream's last event(s)."""
        try:
            if not self.started:
                response = error_response(unavailable(SHUTTING_DOWN))
                await self._send({"type": "http.response.start", "status": response.status_code,
                                  "headers": response.raw_headers})
                await self._send({"type": "http.response.body", "body": response.body})
            elif self.stream_end is not None:
                await self._send({"type": "http.response.body", "body": self.stream_end().encode(),
                                  "more_body": False})
            self.complete = True
        except (OSError, RuntimeError) as e:  # the connection is gone, or the server refuses the message
            logger.info("the last word of a request ended by the shutdown was not sent: %r", e)


_current: ContextVar[InFlight | None] = ContextVar("prefixserve_in_flight", default=None)


def on_stream_start(stream_end: Callable[[], str]) -> None:
    """Called as a stream's response starts: `stream_end()` gives what ends it if the shutdown must
    (the error event in its shape, then `[DONE]` where the shape sends it)."""
    flight = _current.get()
    if flight is not None:
        flight.stream_end = stream_end


class Endings:
    """The requests in flight, each by the task serving it (uvicorn's, as the shutdown sees them in
    `server_state.tasks`); `EndingsMiddleware` keeps it. One per app (`app.state.endings`)."""

    def __init__(self) -> None:
        self._by_task: weakref.WeakKeyDictionary[asyncio.Task[object], InFlight] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        """How many requests the app is serving now."""
        return len(self._by_task)

    def end(self, task: asyncio.Task[object]) -> bool:
        """Take over the request `task` serves before the shutdown cancels it: start writing its last
        word now, drop what the app writes later. False: it can get none (a plain body partly written,
        or not a request seen here)."""
        flight = self._by_task.get(task)
        if flight is None:
            return False
        flight.ended = True
        if flight.complete:
            return True
        if flight.started and flight.stream_end is None:
            return False
        flight.farewell = asyncio.ensure_future(flight.last_word())
        return True

    def track(self, task: asyncio.Task[object], flight: InFlight) -> None:
        """`task` serves the request `flight` stands for, until `untrack`."""
        self._by_task[task] = flight

    def untrack(self, task: asyncio.Task[object]) -> None:
        self._by_task.pop(task, None)


class EndingsMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): each HTTP request's `InFlight` in
    `endings` while it runs; the shutdown's cancellation of one it ended is absorbed once the last
    word is out (uvicorn would log it as an error and, for a response not started, send its 500)."""

    def __init__(self, app: ASGIApp, endings: Endings) -> None:
        self.app = app
        self.endings = endings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or task is None:
            await self.app(scope, receive, send)
            return
        flight = InFlight(send)
        self.endings.track(task, flight)
        token = _current.set(flight)
        try:
            await self.app(scope, receive, flight.send)
        except asyncio.CancelledError:
            if not flight.ended:  # not the shutdown's cancellation
                raise
            task.uncancel()
        finally:
            _current.reset(token)
            self.endings.untrack(task)
        if flight.farewell is not None:
            await flight.farewell
