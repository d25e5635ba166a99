"""The SSE body's writes (server/openai/streaming.py): one per delta, the opening chunks with the first
delta's, the last delta's with the usage chunk and [DONE]; the events are the same either way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from prefixserve.server.openai.shapes import ChatShape
from prefixserve.server.openai.streaming import sse_events
from prefixserve.server.operator.accounting import RequestTracker
from prefixserve.server.operator.metrics import ServerMetrics
from prefixserve.types import Delta, FinishReason, Usage


def events(write: str) -> list[Any]:
    assert write.endswith("\n\n")
    out = []
    for block in write.split("\n\n")[:-1]:
        assert block.startswith("data: ")
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def writes(deltas: list[Delta], include_usage: bool = True) -> list[list[Any]]:
    async def body() -> list[str]:
        async def engine() -> AsyncIterator[Delta]:
            for d in deltas[1:]:
                yield d

        tracker = RequestTracker(ServerMetrics(), None, request_id="r", tenant_id="t", model="m", prompt_len=7)
        shape = ChatShape(id="chatcmpl-1", model="m", include_usage=include_usage)
        return [w async for w in sse_events(shape, engine(), deltas[0], tracker)]

    return [events(w) for w in asyncio.run(body())]


def content(event: Any) -> Any:
    return event["choices"][0]["delta"].get("content") if event != "[DONE]" and event["choices"] else None


def test_one_write_per_delta_the_first_with_the_opening_the_last_with_usage_and_done() -> None:
    u = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=6)
    got = writes([Delta("a", (1,), usage=u), Delta("b", (2,), usage=u),
                  Delta("c", (3,), finish_reason=FinishReason.LENGTH, usage=u)])
    assert len(got) == 3
    assert [e["choices"][0]["delta"] for e in got[0]] == [{"role": "assistant", "content": ""}, {"content": "a"}]
    assert [content(e) for e in got[1]] == ["b"]
    last = got[2]
    assert content(last[0]) == "c" and last[1]["choices"][0]["finish_reason"] == "length"
    assert last[2]["choices"] == [] and last[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 6, "audio_tokens": 0}
    assert last[3] == "[DONE]" and len(last) == 4


def test_an_engine_error_ends_the_write_with_an_error_event_and_done() -> None:
    got = writes([Delta("a", (1,)), Delta("", (), finish_reason=FinishReason.ERROR, error="boom")])
    assert [content(e) for e in got[0]] == ["", "a"]
    assert got[1][0]["error"]["message"] == "boom" and got[1][1] == "[DONE]" and len(got) == 2
