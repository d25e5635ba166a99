"""Server-sent events for streaming responses, and closing the engine's iterator on every exit path.

`SSEResponse` guarantees that its body iterator is closed however the response ends: normally, when
Starlette cancels it because the client disconnected (ASGI < 2.4 servers listen for the disconnect),
or when `send` fails (ASGI >= 2.4). `sse_events` closes the engine iterator in its own `finally`, so
closing the body closes the engine request, which aborts it and frees its session.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from prefixserve.server.errors import SHUTTING_DOWN, unavailable
from prefixserve.server.in_flight import on_stream_start
from prefixserve.server.openai.shapes import Shape
from prefixserve.server.operator.accounting import RequestTracker
from prefixserve.types import Delta, FinishReason, Usage

logger = logging.getLogger("prefixserve.server")

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """`stream_end`: what ends this stream if the shutdown must cut it (`ended_by_server`), registered
    as the response starts (server/in_flight.py)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None,
                 stream_end: Callable[[], str] | None = None) -> None:
        super().__init__(content, headers=headers)
        self.stream_end = stream_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.stream_end is not None:
            on_stream_start(self.stream_end)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await aclose_shielded(self.body_iterator)


async def sse_events(
    shape: Shape, engine_iter: AsyncIterator[Delta], first: Delta, tracker: RequestTracker, num_choices: int = 1,
    abandoned_usage: Callable[[], Awaitable[Usage | None]] | None = None,
) -> AsyncIterator[str]:
    """The SSE body: opening chunks, chunks per delta (each with its choice's `index`), each choice's
    finish chunk, the usage chunk (when asked for), then ``data: [DONE]`` (not for the Responses API,
    whose stream ends with its last event, `Shape.ends_with_done`). An engine failure becomes
    an OpenAI error event, and so does a request the engine ended (ABORT: the server is shutting down,
    a 503's error). A stream cut short or ended so is recorded as an abort with `abandoned_usage()`
    (asked once the engine iterator is closed: the abort's worker truth), else the last usage seen."""
    done = DONE if shape.ends_with_done else ""
    named = shape.named_events

    async def finish_aborted() -> Usage:
        """Record the request as an abort with the engine's worker truth, asked once its iterator is closed."""
        await aclose_shielded(engine_iter)
        return tracker.finish(FinishReason.ABORT.value, None if abandoned_usage is None else await abandoned_usage())

    try:
        # each delta's chunks go out as one write (the opening chunks with the first delta's, the
        # last delta's with the usage chunk and [DONE]): a write is a syscall and a wake-up of the
        # client, and on 2 cores its cost is the first token's
        out = [sse(obj, named) for obj in shape.opening(num_choices)]
        delta: Delta | None = first
        num_left = num_choices
        while delta is not None:
            tracker.on_delta(delta)
            if delta.finish_reason is FinishReason.ABORT:  # ended by the server: the text it had, then the error
                out.extend(sse(obj, named) for obj in shape.chunks(delta.index, delta.text, delta.logprobs, None,
                                                                   delta.prompt_logprobs, delta.token_ids))
                break
            if delta.finish_reason is FinishReason.ERROR or delta.error:
                break
            reason = None if delta.finish_reason is None else FinishReason(delta.finish_reason).value
            chunks = shape.chunks(delta.index, delta.text, delta.logprobs, reason, delta.prompt_logprobs,
                                  delta.token_ids)
            out.extend(sse(obj, named) for obj in chunks)
            if reason is not None:
                num_left -= 1
                if num_left == 0:
                    break
            if out:
                yield "".join(out)
                out = []
            delta = await next_delta(engine_iter)
        if delta is not None and delta.finish_reason is FinishReason.ABORT:  # ended by the server: shutting down
            logger.info("request %s (%s) ended by the server: %s", tracker.http_id, tracker.request_id,
                        delta.error or SHUTTING_DOWN)
            usage = await finish_aborted()  # billed, and told to the client
            yield "".join(out) + ended_by_server(shape, delta.error or SHUTTING_DOWN, usage)
            return
        if delta is None or delta.finish_reason is FinishReason.ERROR or delta.error:
            message = (
                delta.error if delta is not None else None
            ) or "the engine ended the request without finishing it"
            tracker.finish(FinishReason.ERROR.value, delta.usage if delta is not None else None)
            logger.error("request %s failed in the engine: %s", tracker.request_id, message)
            yield "".join(out) + sse(shape.failure(message), named) + done
            return
        usage = tracker.finish(FinishReason(delta.finish_reason).value, delta.usage)  # the last choice to finish
        if shape.include_usage:
            out.append(sse(shape.usage_chunk(usage), named))
        yield "".join(out) + done
    except Exception as e:  # never a broken stream without a reason: report, then end it properly
        logger.exception("streaming request %s failed", tracker.request_id)
        tracker.finish(FinishReason.ERROR.value)
        yield sse(shape.failure(f"internal error: {type(e).__name__}"), named)
        yield done
    finally:
        if tracker.finished:
            await aclose_shielded(engine_iter)
        else:  # the stream was cut short
            await finish_aborted()


def ended_by_server(shape: Shape, message: str = SHUTTING_DOWN, usage: Usage | None = None) -> str:
    """The end of a stream the server ended (shutting down): the usage billed for it where known (its
    usage chunk when the client asked for one; in `response.failed`'s response on the Responses API),
    then the error event in the shape's form (an OpenAI error object; `response.failed`) with the
    503's type and code, then `[DONE]` where the shape ends with it."""
    err = unavailable(message)
    head = sse(shape.usage_chunk(usage)) if usage is not None and shape.include_usage and shape.ends_with_done else ""
    return head + sse(shape.failure(err.message, err.type, err.code, usage), shape.named_events) + \
        (DONE if shape.ends_with_done else "")


def sse(obj: dict[str, Any], named: bool = False) -> str:
    """One SSE event; `named`: with an `event:` line giving the object's `type` (the Responses API's
    typed events, as OpenAI sends them, for SSE consumers that dispatch on the event name)."""
    data = f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
    return f"event: {obj['type']}\n{data}" if named and "type" in obj else data


async def next_delta(it: AsyncIterator[Delta]) -> Delta | None:
    """The next delta, or None when the iterator ends (an engine bug: the last delta must finish)."""
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def aclose_shielded(it: Any) -> None:
    """Close an async iterator even inside a cancelled scope (a disconnect cancels the response task).
    Closing an engine iterator aborts its request; closing twice is harmless."""
    aclose = getattr(it, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:
            logger.exception("closing an engine iterator failed")
