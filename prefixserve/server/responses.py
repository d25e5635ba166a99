"""Response bodies in OpenAI's shapes, for both endpoints, streaming and not.

A `Shape` knows one response's id, creation time and model, and turns engine output into the dicts
OpenAI clients parse. `usage_dict` is the single place usage is rendered: `cached_tokens` is always
present, and every number is the engine's (worker truth), never re-counted here.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixserve.types import Request, Usage


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class Shape:
    """Base: the fields every body shares. Subclasses fill in `object` names and choice layout."""

    id: str
    model: str
    include_usage: bool = False  # streaming: usage: null on chunks, a final usage-only chunk
    created: int = field(default_factory=lambda: int(time.time()))

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before any output (chat: the assistant role)."""
        return []

    def chunks(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage_dict(usage)}

    chunk_object = ""

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = {**self._head(self.chunk_object), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body


class CompletionShape(Shape):
    chunk_object = "text_completion"

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage_dict(usage)}

    def chunks(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        return [self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason})]


class ChatShape(Shape):
    chunk_object = "chat.completion.chunk"

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage_dict(usage)}

    def opening(self) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None)]

    def chunks(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        out = [self._delta({"content": text}, None)] if text else []
        if finish_reason is not None:
            out.append(self._delta({}, finish_reason))
        return out

    def _delta(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason})


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, ready for the engine: what to run and how to answer."""

    request: Request
    shape: Shape
    stream: bool
    tenant_id: str
