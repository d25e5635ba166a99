"""POST /v1/responses: OpenAI's Responses API, as a chat request underneath.

The body is translated to the chat request it means (`instructions` -> a system message; `input`, a
string or a list of message, `function_call` and `function_call_output` items -> messages; function
`tools`, `tool_choice`, `text.format` -> their chat forms; `max_output_tokens` -> max_completion_tokens)
and prepared by server/chat.py: the same template, tools fallback, grammar and sampling checks, so a
conversation is keyed in the prefix cache by the same token ids whichever API sends it. The answer is
a `response` object (output: a message with one `output_text` part, then any `function_call` items;
status `incomplete` with reason `max_output_tokens` when cut), streamed as typed events ending with
`response.completed` / `response.incomplete`, which carries the usage: `input_tokens`,
`input_tokens_details.cached_tokens` (the engine's count, present even when 0), `output_tokens`.

A finished response is kept in memory for its tenant (server/response_store.py) unless `store` is
false: `previous_response_id` continues its conversation (the stored history, then this request's
`instructions` and `input`, rendered as a client re-sending it all would be, so the cache serves the
history the same way), GET / DELETE /v1/responses/{id} read and forget it, and its input items can be
listed or replayed by `item_reference` (server/response_items.py). `conversation` objects,
stored prompt templates and background runs are refused.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from prefixserve.config import DEFAULT_MAX_TOKENS
from prefixserve.engine.protocol import EngineClient
from prefixserve.server.chat import prepare_chat
from prefixserve.server.errors import APIError, bad_request, validation_error
from prefixserve.server.prompt_memo import PromptMemo
from prefixserve.server.response_items import (
    chat_messages,
    check_call_outputs,
    check_include,
    check_metadata,
    resolved,
    typed_items,
)
from prefixserve.server.response_store import ResponseStore
from prefixserve.server.responses import ChatShape, ChoiceOutput, Prepared, Shape
from prefixserve.server.schemas import ChatCompletionRequest, ResponsesRequest
from prefixserve.server.tools import ParsedReply, ToolCallOut, ToolCallStream, ToolSetup, parse_tool_calls
from prefixserve.server.tools import finish_reason as replied
from prefixserve.types import TokenLogprob, Usage

LOGPROBS = "message.output_text.logprobs"  # `include`: each output_text part and delta carries its tokens' logprobs


def prepare_response(
    body: ResponsesRequest, engine: EngineClient, tenant_id: str, default_max_tokens: int = DEFAULT_MAX_TOKENS,
    memo: PromptMemo | None = None, store: ResponseStore | None = None,
) -> Prepared:
    """Validate a Responses body for `tenant_id` and prepare it as its chat request. Raises APIError(400)
    naming the Responses field (404 for a `previous_response_id` the tenant has not stored). With a
    `store`, the finished response is kept there unless the body says `store: false`."""
    history: tuple[dict[str, Any], ...] = ()
    history_items: tuple[dict[str, Any], ...] = ()
    if body.previous_response_id is not None:
        if store is None:
            raise bad_request("this server keeps no responses (--max-stored-responses 0): send the whole "
                              "conversation in input", "previous_response_id")
        found = store.get(tenant_id, body.previous_response_id)
        if found is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id[:64]}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        history, history_items = found.messages, (*found.items, *found.response["output"])
    for name, why in (("conversation", "conversation objects are not kept: use previous_response_id"),
                      ("prompt", "there are no stored prompt templates"), ("background", "requests run in the foreground")):
        if getattr(body, name) not in (None, False, 0):
            raise bad_request(f"{name} is not supported here ({why})", name)
    if body.truncation not in (None, "disabled"):
        raise bad_request("truncation must be 'disabled': a prompt that does not fit is an error", "truncation")
    find = (lambda item_id: store.find_item(tenant_id, item_id)) if store is not None else (lambda item_id: None)
    given = resolved(body.input, find)
    check_call_outputs(history, given)
    check_include(body.include)
    check_metadata(body.metadata)
    conversation = [*history, *chat_messages(given)]  # what a later request's previous_response_id continues
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {"messages": [*system, *conversation], "stream": body.stream}
    for name in ("model", "temperature", "top_p", "user", "cache_salt", "parallel_tool_calls", "seed"):
        if (value := getattr(body, name)) is not None:
            chat[name] = value
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if (fmt := _format(body.text)) is not None:
        chat["response_format"] = fmt
    if LOGPROBS in (body.include or []) or body.top_logprobs is not None:
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs or 0
    try:
        prepared = prepare_chat(ChatCompletionRequest.model_validate(chat), engine, tenant_id, default_max_tokens, memo)
    except ValidationError as e:
        raise _renamed(validation_error(list(e.errors())), len(system), len(history)) from None
    except APIError as e:
        raise _renamed(e, len(system), len(history)) from None
    assert isinstance(prepared.shape, ChatShape)
    keeping = store is not None and body.store is not False
    sampling = prepared.request.sampling
    echo = {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {}, "user": body.user,
            "store": keeping, "truncation": "disabled", "reasoning": None,
            "previous_response_id": body.previous_response_id}
    response_id = f"resp_{uuid.uuid4().hex}"
    keep = None
    if keeping:
        assert store is not None

        items = (*history_items, *typed_items(given))  # GET /v1/responses/{id}/input_items

        def keep(response: dict[str, Any]) -> None:
            store.put(tenant_id, response_id, [*conversation, assistant_message(response["output"])], items, response)
    shape = ResponseShape(id=response_id, model=prepared.shape.model, include_usage=True,
                          fingerprint=prepared.shape.fingerprint, logprobs=prepared.shape.logprobs,
                          tools=prepared.shape.tools, echo=echo, keep=keep)
    return replace(prepared, shape=shape)


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant chat message that continues its conversation."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"tool type {kind!r} is not supported (only function tools)", f"tools[{i}].type")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none" / "auto" / "required", or refused by the chat checks


def _format(text: Any) -> dict[str, Any] | None:
    """`text.format` -> chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


def _renamed(e: APIError, num_system: int, num_history: int) -> APIError:
    """The chat checks name chat fields; the client sent Responses fields (the chat messages are the
    instructions' `num_system`, the previous response's `num_history`, then input's)."""
    if e.param is not None:
        if m := re.match(r"messages\[(\d+)\]", e.param):
            k = int(m.group(1))
            where = ("instructions" if k < num_system else "previous_response_id" if k < num_system + num_history
                     else f"input[{k - num_system - num_history}]" + e.param[m.end():])
            e.param = where
        for chat, ours in (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                           ("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
                           ("response_format", "text.format")):
            if e.param == chat or e.param.startswith((chat + ".", chat + "[")):
                e.param = ours + e.param[len(chat):]
                if chat.startswith("max_"):  # the message names it too
                    e.message = e.message.replace(chat, ours)
                break
        e.param = e.param.replace(".function.", ".")
    return e


def usage_object(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


@dataclass(slots=True)
class ResponseShape(Shape):
    """A `response` object, or its stream of typed events (one choice: the Responses API has no `n`)."""

    ends_with_done = False  # OpenAI's Responses stream ends with its response.completed event
    named_events = True
    tools: ToolSetup | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields every response object repeats
    keep: Callable[[dict[str, Any]], None] | None = None  # given the finished response (server/response_store.py)
    _seq: int = 0
    _stream: ToolCallStream | None = None
    _message_id: str = ""  # the streamed message item, once opened
    _text: str = ""
    _pending: list[TokenLogprob] = field(default_factory=list)  # logprobs of tokens whose text is not out yet
    _sent: list[dict[str, Any]] = field(default_factory=list)  # logprobs that went out with the message's text
    _output: list[dict[str, Any]] = field(default_factory=list)
    _finish: str = "stop"

    def full(self, choices: list[ChoiceOutput], usage: Usage) -> dict[str, Any]:
        c = choices[0]
        reply = parse_tool_calls(c.text, self.tools, c.finish_reason == "length") if self.tools else ParsedReply(c.text, ())
        cut = c.finish_reason == "length" and not reply.calls
        lps = self._rendered(c.logprobs) if not reply.calls else []  # a reply with calls: no text logprobs
        output = [] if reply.content is None and reply.calls else [
            _message(f"msg_{uuid.uuid4().hex}", reply.content or "", cut, lps)]
        output += [_call(call) for call in reply.calls]
        return self._kept(self._response(output, usage, replied(reply, c.finish_reason)))

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._response([], None, None)),
                self._event("response.in_progress", response=self._response([], None, None))]

    def chunks(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...],
               finish_reason: str | None, prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> list[dict[str, Any]]:
        if self.tools is not None and self._stream is None:
            self._stream = ToolCallStream(self.tools)
        self._pending += logprobs
        out = self._delta(self._stream.feed(text) if self._stream is not None else text)
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
            ids = {"item_id": self._message_id, "output_index": 0}
            out += [self._event("response.output_text.done", **ids, content_index=0, text=self._text, logprobs=lps),
                    self._event("response.content_part.done", **ids, content_index=0, part=part),
                    self._event("response.output_item.done", output_index=0, item=item)]
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
        response = self._kept(self._response(self._output, usage, self._finish))
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(done, response=response)

    def _kept(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.keep is not None:
            self.keep(response)
        return response

    def failure(self, message: str) -> dict[str, Any]:
        """response.failed: the response so far, status failed, with the error (as OpenAI ends such a stream)."""
        response = {**self._response(self._output, None, None), "status": "failed",
                    "error": {"code": "server_error", "message": message}}
        return self._event("response.failed", response=response)

    def _delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out = [] if self._message_id else self._open_message()
        self._text += text
        lps = self._rendered(self._pending)
        self._pending = []
        self._sent += lps
        return [*out, self._event("response.output_text.delta", item_id=self._message_id, output_index=0,
                                  content_index=0, delta=text, logprobs=lps)]

    def _rendered(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        """OpenAI's logprobs entries ({token, logprob, bytes, top_logprobs}), when the request asked for them."""
        return [] if self.logprobs is None or not entries else self.logprobs.chat(entries)["content"]

    def _open_message(self) -> list[dict[str, Any]]:
        self._message_id = f"msg_{uuid.uuid4().hex}"
        item = {**_message(self._message_id, ""), "status": "in_progress", "content": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self._message_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _response(self, output: list[dict[str, Any]], usage: Usage | None, finish: str | None) -> dict[str, Any]:
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, **self.echo,
                "usage": None if usage is None else usage_object(usage)}


def _message(item_id: str, text: str, cut: bool = False, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An assistant message item; `cut`: max_output_tokens ended it (status incomplete, as OpenAI)."""
    return {"type": "message", "id": item_id, "status": "incomplete" if cut else "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _call(call: ToolCallOut) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed" if call.complete else "incomplete"}
