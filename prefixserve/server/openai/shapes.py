"""Completions and chat completions bodies in OpenAI's shapes, streaming and not, and `Prepared`: a
request ready for the engine with the `Shape` that answers it (the Responses API's: responses/shape.py).

A `Shape` knows one response's id, creation time, model, fingerprint and options (logprobs, tools),
and turns engine output into the dicts OpenAI clients parse. `usage_dict` is the single place usage
is rendered: `cached_tokens` is always present, and every number is the engine's (worker truth),
never re-counted here; `reasoning_tokens` is counted on the token ids the engine generated
(server/openai/reasoning.py). With n > 1 choices, `usage` counts the prompt once and sums the choices.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from prefixserve.server.errors import error_body
from prefixserve.server.openai.logprobs import LogprobRenderer, TextOffsets
from prefixserve.server.openai.reasoning import ReasoningStream, reasoning_tokens, split_reasoning
from prefixserve.server.openai.tools import ParsedReply, ToolCallStream, ToolSetup, parse_tool_calls
from prefixserve.server.openai.tools import finish_reason as replied
from prefixserve.types import Request, TokenLogprob, Usage


def usage_dict(usage: Usage, num_reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's `CompletionUsage` (chat and completions share it) with every details field OpenAI sends;
    those of features served nowhere here (audio, predicted outputs) are 0, and so is reasoning_tokens
    on completions, which never split reasoning off."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": num_reasoning_tokens, "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0, "audio_tokens": 0},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ChoiceOutput:
    """One choice's whole output (non-streaming)."""

    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # completions' echo with logprobs
    token_ids: list[int] = field(default_factory=list)  # every generated token (a stop token too)


@dataclass(slots=True)
class Shape:
    """Base: the fields every body shares. Subclasses fill in `object` names and choice layout.
    `logprobs`: a renderer when the request asked for logprobs, else None."""

    id: str
    model: str
    include_usage: bool = False  # streaming: usage: null on chunks, a final usage-only chunk
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = ""
    logprobs: LogprobRenderer | None = None

    def full(self, choices: list[ChoiceOutput], usage: Usage) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        """Chunks sent before any output (chat: the assistant role of each choice)."""
        return []

    def chunks(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...], finish_reason: str | None,
               prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
               token_ids: tuple[int, ...] = ()) -> list[dict[str, Any]]:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage_dict(usage, self.num_reasoning_tokens())}

    def num_reasoning_tokens(self) -> int:
        """Streamed: the reasoning tokens of every choice so far (0 where reasoning is never split off)."""
        return 0

    def failure(self, message: str, type: str = "server_error", code: str | None = None,
                usage: Usage | None = None) -> dict[str, Any]:
        """The event that ends a stream the server could not finish (OpenAI's error object; the usage
        billed for it goes in its own chunk before it, `streaming.ended_by_server`)."""
        return error_body(message, type, code=code)

    chunk_object = ""
    ends_with_done = True  # the stream's last line is `data: [DONE]` (chat and completions, as OpenAI)
    named_events = False  # each event with an `event: <type>` line (the Responses API, as OpenAI)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = {**self._head(self.chunk_object), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body


@dataclass(slots=True)
class CompletionShape(Shape):
    """`echo`: per prompt, its text and first token id (empty: no echo); prompt k's choices are
    k * per_prompt .. k * per_prompt + per_prompt - 1. With echo and logprobs a choice's logprobs start
    with its prompt's tokens (the first with null logprob and top_logprobs, as OpenAI), which the
    engine sends before the choice's first token: streamed, the echoed text goes out with them."""

    chunk_object = "text_completion"
    echo: tuple[tuple[str, int], ...] = ()
    per_prompt: int = 1
    _offsets: dict[int, TextOffsets] = field(default_factory=dict)  # streaming: each choice's text offsets so far

    def full(self, choices: list[ChoiceOutput], usage: Usage) -> dict[str, Any]:
        body = [{"index": c.index, "text": self._prefix(c.index) + c.text,
                 "logprobs": self._logprobs(c.index, c.logprobs, c.prompt_logprobs), "finish_reason": c.finish_reason}
                for c in choices]
        return {**self._head("text_completion"), "choices": body, "usage": usage_dict(usage)}

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        if not self.echo or self.logprobs is not None:  # with logprobs the text goes with the prompt's
            return []
        return [self._chunk({"index": i, "text": self._prefix(i), "logprobs": None, "finish_reason": None})
                for i in range(num_choices)]

    def chunks(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...], finish_reason: str | None,
               prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
               token_ids: tuple[int, ...] = ()) -> list[dict[str, Any]]:
        out = []
        if prompt_logprobs is not None and self.echo and self.logprobs is not None:
            out.append(self._chunk({"index": index, "text": self._prefix(index),
                                    "logprobs": self._logprobs(index, (), prompt_logprobs), "finish_reason": None}))
        if text or logprobs or finish_reason is not None:
            out.append(self._chunk({"index": index, "text": text, "logprobs": self._logprobs(index, logprobs),
                                    "finish_reason": finish_reason}))
        return out

    def _prefix(self, index: int) -> str:
        return self._echoed(index)[0] if self.echo else ""

    def _echoed(self, index: int) -> tuple[str, int]:
        """The text and first token id of the prompt choice `index` belongs to."""
        return self.echo[min(index // self.per_prompt, len(self.echo) - 1)]

    def _logprobs(self, index: int, entries: list[TokenLogprob] | tuple[TokenLogprob, ...],
                  prompt: tuple[TokenLogprob, ...] | None = None) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if index not in self._offsets:  # the generated tokens' text starts after the echoed prompt's
            self._offsets[index] = self.logprobs.offsets(len(self._prefix(index)))
        out = self.logprobs.completion(entries, self._offsets[index])
        if prompt is not None and self.echo:
            out = {k: v + out[k] for k, v in self.logprobs.prompt(self._echoed(index)[1], prompt).items()}
        return out


@dataclass(slots=True)
class ChatShape(Shape):
    chunk_object = "chat.completion.chunk"
    tools: ToolSetup | None = None  # parse tool calls out of the replies
    thinking: bool | None = None  # split reasoning out (server/openai/reasoning.py); True: the prompt opened <think>
    think_end_id: int | None = None  # the </think> token, for usage's reasoning_tokens
    _streams: dict[int, ToolCallStream] = field(default_factory=dict)
    _thoughts: dict[int, ReasoningStream] = field(default_factory=dict)

    def full(self, choices: list[ChoiceOutput], usage: Usage) -> dict[str, Any]:
        body = []
        num_reasoning = 0
        for c in choices:
            cut = c.finish_reason == "length"
            reasoning, text = (None, c.text) if self.thinking is None else split_reasoning(c.text, self.thinking)
            num_reasoning += 0 if reasoning is None else reasoning_tokens(c.token_ids, self.think_end_id)
            reply = parse_tool_calls(text, self.tools, cut) if self.tools else ParsedReply(text, ())
            message = {"role": "assistant", "content": reply.content, "refusal": None,
                       "tool_calls": [call.as_dict() for call in reply.calls] or None}
            if self.thinking is not None:
                message["reasoning_content"] = reasoning
            body.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.logprobs),
                         "finish_reason": replied(reply, c.finish_reason)})
        return {**self._head("chat.completion"), "choices": body, "usage": usage_dict(usage, num_reasoning)}

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        return [self._delta(i, {"role": "assistant", "content": ""}, None) for i in range(num_choices)]

    def chunks(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...], finish_reason: str | None,
               prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
               token_ids: tuple[int, ...] = ()) -> list[dict[str, Any]]:
        out = []
        if self.thinking is not None:
            thought = self._thoughts.setdefault(index, ReasoningStream(self.thinking, self.think_end_id))
            thought.count(token_ids)
            reasoning, text = thought.feed(text)
            if finish_reason is not None:
                more, rest = thought.finish()
                reasoning, text = reasoning + more, text + rest
            if reasoning:
                out.append(self._delta(index, {"reasoning_content": reasoning}, None))
        if self.tools is not None:
            text = self._stream(index).feed(text)
        if text or logprobs:
            out.append(self._delta(index, {"content": text}, None, logprobs))
        if finish_reason is not None:
            if self.tools is not None:
                reply = self._stream(index).finish(cut=finish_reason == "length")
                if reply.content:
                    out.append(self._delta(index, {"content": reply.content}, None))
                for i, call in enumerate(reply.calls):  # OpenAI: name first, then the arguments
                    head = {"index": i, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}}
                    out.append(self._delta(index, {"tool_calls": [head]}, None))
                    out.append(self._delta(index, {"tool_calls": [
                        {"index": i, "function": {"arguments": call.arguments}}]}, None))
                finish_reason = replied(reply, finish_reason)
            out.append(self._delta(index, {}, finish_reason))
        return out

    def num_reasoning_tokens(self) -> int:
        return sum(thought.num_tokens for thought in self._thoughts.values())

    def _stream(self, index: int) -> ToolCallStream:
        assert self.tools is not None
        return self._streams.setdefault(index, ToolCallStream(self.tools))

    def _logprobs(self, entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.logprobs.chat(entries)

    def _delta(self, index: int, delta: dict[str, Any], finish_reason: str | None,
               logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        return self._chunk({"index": index, "delta": delta, "logprobs": self._logprobs(logprobs) if logprobs else None,
                            "finish_reason": finish_reason})


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, ready for the engine: what to run and how to answer."""

    request: Request
    shape: Shape
    stream: bool
    tenant_id: str
    num_returned: int | None = None  # best_of > n: the request samples more choices than it returns
    more: tuple[Request, ...] = ()  # completions with a list of prompts: the 2nd, 3rd, ... (server/openai/multi_prompt.py)

    @property
    def requests(self) -> tuple[Request, ...]:
        return (self.request, *self.more)

    @property
    def num_choices(self) -> int:
        """Choices the engine produces for the whole response (every prompt's n)."""
        return sum(r.num_choices for r in self.requests)

    def select(self, choices: list[ChoiceOutput]) -> list[ChoiceOutput]:
        """best_of: the `num_returned` choices with the highest cumulative logprob, re-indexed from 0
        in that order (the engine computed logprobs for this); otherwise all of them."""
        if self.num_returned is None or len(choices) <= self.num_returned:
            return choices
        best = sorted(choices, key=lambda c: -sum(e.logprob for e in c.logprobs))[: self.num_returned]
        return [replace(c, index=i) for i, c in enumerate(best)]
