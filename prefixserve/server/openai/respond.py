"""Run one prepared request on the engine and answer it, streaming or not, watching for the client
going away.

Until the response starts, a watcher task waits for ``http.disconnect``; if it comes first, the engine
work is cancelled and its iterator closed, which aborts the request. Streaming hands the iterator to
`SSEResponse` after the first delta, so engine errors raised before any output (PromptTooLong) are
still proper HTTP errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.protocol import EngineClient, InvalidRequest
from prefixserve.server.errors import SHUTTING_DOWN, APIError, unavailable
from prefixserve.server.openai.multi_prompt import Usages, generate_all
from prefixserve.server.openai.shapes import ChoiceOutput, Prepared
from prefixserve.server.openai.streaming import (
    SSE_HEADERS,
    SSEResponse,
    aclose_shielded,
    ended_by_server,
    next_delta,
    sse_events,
)
from prefixserve.server.operator.accounting import RequestTracker
from prefixserve.types import Delta, FinishReason

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody is there to read it


class ClientGone(Exception):
    """The client disconnected before the response started."""


class EndedByServer(Exception):
    """The engine ended the request unfinished (ABORT: the server is shutting down, EngineClient.end_all)."""


async def respond(
    engine: EngineClient, prepared: Prepared, http_request: HTTPRequest, tracker: RequestTracker
) -> Response:
    """Serve `prepared`. Raises what the engine raises before its first delta (PromptTooLong -> 400
    via the app's handlers); answers 500 in OpenAI's shape if the engine fails the request, 503 if it
    ends it before its response started (the server is shutting down)."""
    usages = Usages()
    engine_iter = generate_all(engine, prepared.requests, usages)
    handed_off = False
    try:
        if prepared.stream:
            first = await until_disconnect(http_request, next_delta(engine_iter))
            if first is None:
                raise _engine_failed(tracker, None)
            if first.finish_reason is FinishReason.ABORT:  # ended while queued: nothing was sent yet
                raise EndedByServer(first.error or SHUTTING_DOWN)
            handed_off = True
            return SSEResponse(sse_events(prepared.shape, engine_iter, first, tracker, prepared.num_choices,
                                          lambda: usages.final(engine, prepared.requests)),
                               headers=SSE_HEADERS, stream_end=lambda: ended_by_server(prepared.shape))
        choices, delta = await until_disconnect(http_request, _collect(engine_iter, tracker, prepared.num_choices))
        usage = tracker.finish(FinishReason(delta.finish_reason).value, delta.usage)  # the last choice to finish
        return JSONResponse(prepared.shape.full(prepared.select(choices), usage))
    except ClientGone:
        await aclose_shielded(engine_iter)  # the abort's own usage first: what was really computed
        tracker.finish(FinishReason.ABORT.value, await usages.final(engine, prepared.requests))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except InvalidRequest as e:  # the engine counts choices; a completion's best_of is what it samples
        if e.param == "n" and prepared.num_returned is not None:
            raise InvalidRequest(str(e), "best_of") from None
        raise
    except EndedByServer as e:  # billed as a client's abort is: what was computed
        await aclose_shielded(engine_iter)
        tracker.finish(FinishReason.ABORT.value, await usages.final(engine, prepared.requests))
        raise unavailable(str(e)) from None
    except asyncio.CancelledError:  # the shutdown cancelled it (server/in_flight.py answers): billed the same
        await aclose_shielded(engine_iter)
        if not tracker.finished:
            tracker.finish(FinishReason.ABORT.value, await usages.final(engine, prepared.requests))
        raise
    finally:
        if not handed_off:
            await aclose_shielded(engine_iter)
            if not tracker.finished:
                tracker.discard()  # the engine raised before serving it


async def until_disconnect(http_request: HTTPRequest, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first (then cancel it and raise ClientGone).
    The request body must already have been read."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher: asyncio.Future[None] = asyncio.ensure_future(_wait_disconnect(http_request))
    try:
        pending: set[asyncio.Future[Any]] = {task, watcher}
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for t in (task, watcher):
            t.cancel()
        # Let the cancelled engine work unwind (its generator's cleanup aborts the request).
        await asyncio.shield(asyncio.gather(task, watcher, return_exceptions=True))


async def _wait_disconnect(http_request: HTTPRequest) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(
    engine_iter: AsyncIterator[Delta], tracker: RequestTracker, num_choices: int
) -> tuple[list[ChoiceOutput], Delta]:
    """Every choice's output (by index), and the request's last delta (its usage is the total).
    Raises APIError(500) if the engine failed."""
    choices = [ChoiceOutput(index=i, text="", finish_reason="") for i in range(num_choices)]
    num_left = num_choices
    while True:
        delta = await next_delta(engine_iter)
        if delta is None:
            raise _engine_failed(tracker, None)
        tracker.on_delta(delta)
        choice = choices[delta.index]
        choice.text += delta.text
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            if delta.finish_reason is FinishReason.ABORT:
                raise EndedByServer(delta.error or SHUTTING_DOWN)
            if delta.finish_reason is FinishReason.ERROR or delta.error:
                raise _engine_failed(tracker, delta)
            choice.finish_reason = FinishReason(delta.finish_reason).value
            num_left -= 1
            if num_left == 0:
                return choices, delta


def _engine_failed(tracker: RequestTracker, delta: Delta | None) -> APIError:
    tracker.finish(FinishReason.ERROR.value, delta.usage if delta is not None else None)
    detail = (
        delta.error if delta is not None else None
    ) or "the engine ended the request without finishing it"
    return APIError(500, f"the engine failed this request: {detail}", type="server_error")
