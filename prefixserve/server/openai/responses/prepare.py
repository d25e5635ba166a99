"""POST /v1/responses: OpenAI's Responses API, as a chat request underneath.

The body is translated to the chat request it means (`instructions` -> a system message; `input`, a
string or a list of message, `function_call` and `function_call_output` items -> messages; function
`tools`, `tool_choice`, `text.format` -> their chat forms; `max_output_tokens` -> max_completion_tokens)
and prepared by server/openai/chat.py: the same template, tools fallback, grammar and sampling checks, so a
conversation is keyed in the prefix cache by the same token ids whichever API sends it. The answer is
a `response` object (output: a message with one `output_text` part, then any `function_call` items;
status `incomplete` with reason `max_output_tokens` when cut), streamed as typed events ending with
`response.completed` / `response.incomplete`, which carries the usage: `input_tokens`,
`input_tokens_details.cached_tokens` (the engine's count, present even when 0), `output_tokens`.

A finished response is kept in memory for its tenant (server/openai/responses/store.py) unless `store` is
false: `previous_response_id` continues its conversation (the stored history, then this request's
`instructions` and `input`, rendered as a client re-sending it all would be, so the cache serves the
history the same way, in the namespace of the response it continues: its `cache_salt`, echoed in the
response object, carries on unless the request names another), GET / DELETE /v1/responses/{id} read
and forget it, and its input items can be listed or replayed by `item_reference`
(server/openai/responses/items.py). `conversation` objects, stored prompt templates and background runs are
refused.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from prefixserve.config import DEFAULT_MAX_TOKENS
from prefixserve.engine.protocol import EngineClient
from prefixserve.server.errors import APIError, bad_request, validation_error
from prefixserve.server.openai import params
from prefixserve.server.openai.chat import prepare_chat
from prefixserve.server.openai.prompt_memo import PromptMemo
from prefixserve.server.openai.responses.items import (
    chat_messages,
    check_call_outputs,
    check_include,
    resolved,
    typed_items,
)
from prefixserve.server.openai.responses.shape import ResponseShape
from prefixserve.server.openai.responses.store import ResponseStore
from prefixserve.server.openai.schemas import ChatCompletionRequest, ResponsesRequest
from prefixserve.server.openai.shapes import ChatShape, Prepared
from prefixserve.types import SamplingParams

LOGPROBS = "message.output_text.logprobs"  # `include`: each output_text part and delta carries its tokens' logprobs


def prepare_response(
    body: ResponsesRequest, engine: EngineClient, tenant_id: str, default_max_tokens: int = DEFAULT_MAX_TOKENS,
    memo: PromptMemo | None = None, store: ResponseStore | None = None, think_split: bool = True,
) -> Prepared:
    """Validate a Responses body for `tenant_id` and prepare it as its chat request. Raises APIError(400)
    naming the Responses field (404 for a `previous_response_id` the tenant has not stored). With a
    `store`, the finished response is kept there unless the body says `store: false`."""
    history, history_items, salt = continued(body, store, tenant_id)
    params.check_absent(body, (("conversation", "conversation objects are not kept: use previous_response_id"),
                               ("prompt", "there are no stored prompt templates"),
                               ("background", "requests run in the foreground"),
                               ("reasoning", "no reasoning options; a thinking model's <think> block is its reasoning")))
    if body.truncation not in (None, "disabled"):
        raise bad_request("truncation must be 'disabled': a prompt that does not fit is an error", "truncation")
    find = (lambda item_id: store.find_item(tenant_id, item_id)) if store is not None else (lambda item_id: None)
    given = resolved(body.input, find)
    check_call_outputs(history, given)
    check_include(body.include)
    params.check_metadata(body.metadata)
    conversation = [*history, *chat_messages(given)]  # what a later request's previous_response_id continues
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = chat_request(body, [*system, *conversation], salt)
    try:
        prepared = prepare_chat(ChatCompletionRequest.model_validate(chat), engine, tenant_id, default_max_tokens, memo,
                                think_split)
    except ValidationError as e:
        raise _renamed(validation_error(list(e.errors())), len(system), len(history)) from None
    except APIError as e:
        raise _renamed(e, len(system), len(history)) from None
    assert isinstance(prepared.shape, ChatShape)
    keeping = store is not None and body.store is not False
    response_id = f"resp_{uuid.uuid4().hex}"
    keep = None
    if keeping:
        assert store is not None

        items = (*history_items, *typed_items(given))  # GET /v1/responses/{id}/input_items

        def keep(response: dict[str, Any]) -> None:
            store.put(tenant_id, response_id, [*conversation, assistant_message(response["output"])], items, response)
    shape = ResponseShape(id=response_id, model=prepared.shape.model, include_usage=True,
                          fingerprint=prepared.shape.fingerprint, logprobs=prepared.shape.logprobs,
                          tools=prepared.shape.tools, echo=echoed(body, prepared.request.sampling, keeping, salt),
                          keep=keep, thinking=prepared.shape.thinking, think_end_id=prepared.shape.think_end_id)
    return replace(prepared, shape=shape)


def continued(body: ResponsesRequest, store: ResponseStore | None, tenant_id: str
              ) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...], str | None]:
    """The conversation `previous_response_id` continues, as chat messages and as typed items, and the
    cache salt the request runs under: its own, else the continued response's (the chain stays in its
    namespace, where its history is cached). Without one: nothing, and the request's salt."""
    if body.previous_response_id is None:
        return (), (), body.cache_salt
    if store is None:
        raise bad_request("this server keeps no responses (--max-stored-responses 0): send the whole "
                          "conversation in input", "previous_response_id")
    found = store.get(tenant_id, body.previous_response_id)
    if found is None:
        raise APIError(404, f"Previous response with id '{body.previous_response_id[:64]}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    salt = body.cache_salt if body.cache_salt is not None else found.response.get("cache_salt")
    return found.messages, (*found.items, *found.response["output"]), salt


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]], salt: str | None) -> dict[str, Any]:
    """The chat completions body the Responses body means, with these `messages` (instructions,
    history, input)."""
    chat: dict[str, Any] = {"messages": messages, "stream": body.stream}
    for name in ("model", "temperature", "top_p", "user", "parallel_tool_calls", "seed", "prompt_cache_key"):
        if (value := getattr(body, name)) is not None:
            chat[name] = value
    if salt is not None:
        chat["cache_salt"] = salt
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
    return chat


def echoed(body: ResponsesRequest, sampling: SamplingParams, keeping: bool, salt: str | None) -> dict[str, Any]:
    """The request fields every response object repeats (`sampling`: the temperature and top_p applied)."""
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {}, "user": body.user,
            "store": keeping, "truncation": "disabled", "reasoning": None,
            "previous_response_id": body.previous_response_id, "cache_salt": salt,
            "prompt_cache_key": body.prompt_cache_key}


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant chat message that continues its conversation."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    thought = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {}),
            **({"reasoning_content": thought} if thought else {})}


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"tool type {kind!r} is not supported (only function tools)", f"tools[{i}].type")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                              "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
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
            if k < num_system:
                e.param = "instructions"
            elif k < num_system + num_history:
                e.param = "previous_response_id"
            else:  # an input item: the message names it as the param does
                item = f"input[{k - num_system - num_history}]"
                e.param, e.message = item + e.param[m.end():], e.message.replace(m.group(0), item)
        for chat, ours in (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                           ("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
                           ("response_format", "text.format")):
            if e.param == chat or e.param.startswith((chat + ".", chat + "[")):
                e.param = ours + e.param[len(chat):]
                if chat != "messages":  # the message names it too (a message's index is another)
                    e.message = e.message.replace(chat, ours)
                break
        if e.param.startswith("tools["):  # a Responses tool is flat: {"type", "name", "parameters"}
            e.param, e.message = e.param.replace(".function.", "."), e.message.replace(".function.", ".")
    return e
