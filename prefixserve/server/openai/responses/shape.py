"""The Responses API's answer: a `response` object, or its stream of typed events (server/openai/responses/prepare.py
prepares the request as the chat request it means; this renders what the engine made of it).

Output items, in order: a thinking model's `reasoning` item (server/openai/reasoning.py), the assistant
`message` with one `output_text` part (status `incomplete` when max_output_tokens cut it), then any
`function_call` items (`incomplete` for a call that max_output_tokens cut). Streamed, each item opens
with `response.output_item.added` and closes with `response.output_item.done`, its text in
`response.reasoning_text.delta` / `response.output_text.delta` events between; the last event,
`response.completed` or `response.incomplete`, carries the whole response and its usage
(`output_tokens_details.reasoning_tokens`: the reasoning item's tokens, server/openai/reasoning.py); a stream
that fails ends with `response.failed`, the response as far as it got (open items incomplete).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixserve.server.openai.reasoning import ReasoningStream, reasoning_tokens, split_reasoning
from prefixserve.server.openai.shapes import ChoiceOutput, Shape
from prefixserve.server.openai.tools import (
    ParsedReply,
    ToolCallOut,
    ToolCallStream,
    ToolSetup,
    parse_tool_calls,
)
from prefixserve.server.openai.tools import finish_reason as replied
from prefixserve.types import TokenLogprob, Usage


def usage_object(usage: Usage, num_reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens}, "total_tokens": usage.total_tokens}


@dataclass(slots=True)
class ResponseShape(Shape):
    """A `response` object, or its stream of typed events (one choice: the Responses API has no `n`)."""

    ends_with_done = False  # OpenAI's Responses stream ends with its response.completed event
    named_events = True
    tools: ToolSetup | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields every response object repeats
    keep: Callable[[dict[str, Any]], None] | None = None  # given the finished response (server/openai/responses/store.py)
    thinking: bool | None = None  # a thinking model's reasoning as a reasoning item (server/openai/reasoning.py)
    think_end_id: int | None = None  # the </think> token, for usage's reasoning_tokens
    _seq: int = 0
    _stream: ToolCallStream | None = None
    _thought: ReasoningStream | None = None
    _reasoning_id: str = ""  # the streamed reasoning item while open
    _reasoning: str = ""
    _message_id: str = ""  # the streamed message item, once opened
    _at: int = 0  # its output_index
    _text: str = ""
    _pending: list[TokenLogprob] = field(default_factory=list)  # logprobs of tokens whose text is not out yet
    _sent: list[dict[str, Any]] = field(default_factory=list)  # logprobs that went out with the message's text
    _output: list[dict[str, Any]] = field(default_factory=list)
    _finish: str = "stop"

    def full(self, choices: list[ChoiceOutput], usage: Usage) -> dict[str, Any]:
        c = choices[0]
        reasoning, text = (None, c.text) if self.thinking is None else split_reasoning(c.text, self.thinking)
        reply = parse_tool_calls(text, self.tools, c.finish_reason == "length") if self.tools else ParsedReply(text, ())
        cut = c.finish_reason == "length" and not reply.calls
        lps = self._rendered(c.logprobs) if not reply.calls else []  # a reply with calls: no text logprobs
        output = [_reasoning_item(f"rs_{uuid.uuid4().hex}", reasoning)] if reasoning else []
        output += [] if reply.content is None and reply.calls else [
            _message(f"msg_{uuid.uuid4().hex}", reply.content or "", cut, lps)]
        output += [_call(call) for call in reply.calls]
        num_reasoning = 0 if reasoning is None else reasoning_tokens(c.token_ids, self.think_end_id)
        return self._kept(self._response(output, usage, replied(reply, c.finish_reason), num_reasoning))

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._response([], None, None)),
                self._event("response.in_progress", response=self._response([], None, None))]

    def chunks(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...], finish_reason: str | None,
               prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
               token_ids: tuple[int, ...] = ()) -> list[dict[str, Any]]:
        if self.tools is not None and self._stream is None:
            self._stream = ToolCallStream(self.tools)
        self._pending += logprobs
        out = []
        if self.thinking is not None:
            if self._thought is None:
                self._thought = ReasoningStream(self.thinking, self.think_end_id)
            self._thought.count(token_ids)
            reasoning, text = self._thought.feed(text)
            if finish_reason is not None:
                more, rest = self._thought.finish()
                reasoning, text = reasoning + more, text + rest
            out += self._reason(reasoning, done=bool(text) or finish_reason is not None)
        out += self._delta(self._stream.feed(text) if self._stream is not None else text)
        if finish_reason is None:
            return out
        self._finish = finish_reason
        calls: tuple[ToolCallOut, ...] = ()
        if self._stream is not None:
            reply = self._stream.finish(cut=finish_reason == "length")
            out += self._delta(reply.content or "")
            calls = reply.calls
            self._finish = replied(reply, finish_reason)  # as chat's finish_reason
        if self._message_id or not calls:  # an empty reply is still one (empty) message
            if not self._message_id:
                out += self._open_message()
            lps = [] if calls else self._sent
            item = _message(self._message_id, self._text, self._finish == "length", lps)
            part = item["content"][0]
            ids = {"item_id": self._message_id, "output_index": self._at}
            out += [self._event("response.output_text.done", **ids, content_index=0, text=self._text, logprobs=lps),
                    self._event("response.content_part.done", **ids, content_index=0, part=part),
                    self._event("response.output_item.done", output_index=self._at, item=item)]
            self._output.append(item)
        for call in calls:
            item = _call(call)
            at = {"item_id": item["id"], "output_index": len(self._output)}
            out += [self._event("response.output_item.added", output_index=at["output_index"],
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", **at, delta=call.arguments),
                    self._event("response.function_call_arguments.done", **at, name=call.name, arguments=call.arguments),
                    self._event("response.output_item.done", output_index=at["output_index"], item=item)]
            self._output.append(item)
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last event: the whole response, with its usage."""
        response = self._kept(self._response(self._output, usage, self._finish, self.num_reasoning_tokens()))
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(done, response=response)

    def num_reasoning_tokens(self) -> int:
        return 0 if self._thought is None else self._thought.num_tokens

    def _kept(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.keep is not None:
            self.keep(response)
        return response

    def failure(self, message: str, type: str = "server_error", code: str | None = None,
                usage: Usage | None = None) -> dict[str, Any]:
        """response.failed: the response so far, status failed, with the error (as OpenAI ends such a stream).
        Items the stream opened and never closed are in it as far as they went, status incomplete, so a
        client that keeps the last event's response keeps the text it was shown. It is stored as a
        finished one is (OpenAI keeps failed responses too): GET answers it, a continuation goes on from
        the text shown. `usage`: what it was billed, where known (the server ended it)."""
        output = list(self._output)
        if self._reasoning_id:
            output.append({**_reasoning_item(self._reasoning_id, self._reasoning), "status": "incomplete"})
        if self._message_id and all(item["id"] != self._message_id for item in output):
            output.append(_message(self._message_id, self._text, True, self._sent))
        response = {**self._response(output, usage, None, self.num_reasoning_tokens()), "status": "failed",
                    "error": {"code": code or type, "message": message}}
        return self._event("response.failed", response=self._kept(response))

    def _delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out = [] if self._message_id else self._open_message()
        self._text += text
        lps = self._rendered(self._pending)
        self._pending = []
        self._sent += lps
        return [*out, self._event("response.output_text.delta", item_id=self._message_id, output_index=self._at,
                                  content_index=0, delta=text, logprobs=lps)]

    def _reason(self, text: str, done: bool) -> list[dict[str, Any]]:
        """The reasoning item's events: opened with its first text, closed (`done`) when the answer
        starts or the reply ends."""
        out = []
        if text:
            if not self._reasoning_id:
                self._reasoning_id = f"rs_{uuid.uuid4().hex}"
                item = {**_reasoning_item(self._reasoning_id, ""), "content": [], "status": "in_progress"}
                out.append(self._event("response.output_item.added", output_index=len(self._output), item=item))
            self._reasoning += text
            out.append(self._event("response.reasoning_text.delta", item_id=self._reasoning_id,
                                   output_index=len(self._output), content_index=0, delta=text))
        if done and self._reasoning_id:
            ids = {"item_id": self._reasoning_id, "output_index": len(self._output)}
            item = _reasoning_item(self._reasoning_id, self._reasoning)
            out += [self._event("response.reasoning_text.done", **ids, content_index=0, text=self._reasoning),
                    self._event("response.output_item.done", output_index=len(self._output), item=item)]
            self._output.append(item)
            self._reasoning_id = ""
        return out

    def _rendered(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        """OpenAI's logprobs entries ({token, logprob, bytes, top_logprobs}), when the request asked for them."""
        return [] if self.logprobs is None or not entries else self.logprobs.chat(entries)["content"]

    def _open_message(self) -> list[dict[str, Any]]:
        self._message_id, self._at = f"msg_{uuid.uuid4().hex}", len(self._output)
        item = {**_message(self._message_id, ""), "status": "in_progress", "content": []}
        return [self._event("response.output_item.added", output_index=self._at, item=item),
                self._event("response.content_part.added", item_id=self._message_id, output_index=self._at, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _response(self, output: list[dict[str, Any]], usage: Usage | None, finish: str | None,
                  num_reasoning_tokens: int = 0) -> dict[str, Any]:
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, **self.echo,
                "usage": None if usage is None else usage_object(usage, num_reasoning_tokens)}


def _message(item_id: str, text: str, cut: bool = False, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An assistant message item; `cut`: max_output_tokens ended it (status incomplete, as OpenAI)."""
    return {"type": "message", "id": item_id, "status": "incomplete" if cut else "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    """A thinking model's reasoning, as OpenAI's reasoning item carries a model's raw reasoning text."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _call(call: ToolCallOut) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed" if call.complete else "incomplete"}
