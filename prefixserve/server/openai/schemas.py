"""Request bodies of the OpenAI endpoints, as pydantic models, and `parse_body`.

Types are checked strictly (``"5"`` is not an int, ``true`` is not a number); unknown fields are
ignored as OpenAI-compatible servers do. Fields whose valid shapes are a union (``prompt``, ``stop``,
``cache_salt``, message ``content``) are typed ``Any`` here and checked in `params` / `chat`, so that
their errors name the field plainly. Fields we do not support are declared so that a non-default value
can be refused by name instead of silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from prefixserve.server.errors import bad_request, format_loc, validation_error

MAX_BODY_BYTES = 16 << 20

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
_PASS_THROUGH = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

M = TypeVar("M", bound=BaseModel)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT

    model: str | None = None  # None = the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; -1 or 0 = off
    seed: int | None = None
    stop: Any = None  # str | list[str]
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool | None = None  # extension
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: Any = None  # non-empty str of at most 256 characters
    prompt_cache_key: Any = None  # str: a placement hint for a gateway, never part of the cache namespace
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    repetition_penalty: float | None = None  # accepted only at its neutral value


class CompletionRequest(SamplingFields):
    prompt: Any = None  # str | list[int] | [str] | [list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # extension (vLLM): a raw completion held to JSON


class FunctionCall(BaseModel):
    model_config = _PASS_THROUGH
    name: str
    arguments: Any = None  # a JSON string (OpenAI) or an object


class ToolCall(BaseModel):
    model_config = _PASS_THROUGH
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str | list[{"type": "text", "text": str}] | None (assistant with tool_calls)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, as this server returns it


class FunctionDef(BaseModel):
    model_config = _PASS_THROUGH
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = _PASS_THROUGH
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM, llama.cpp): template variables
    functions: Any = None  # the legacy API; refused
    metadata: dict[str, Any] | None = None  # OpenAI's bounds checked (params.check_metadata), then unused
    modalities: Any = None  # only ["text"]
    audio: Any = None  # refused: text output only
    function_call: Any = None
    # OpenAI fields for features this server does not have: refused by name unless null
    reasoning_effort: Any = None
    prediction: Any = None
    web_search_options: Any = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses (server/openai/responses/prepare.py translates it to its chat request)."""

    model_config = _STRICT
    model: str | None = None
    input: Any = None  # str | [message, function_call or function_call_output items]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # extension, as on chat
    stream: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: Any = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    metadata: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: Any = None
    prompt_cache_key: Any = None  # as on chat; echoed in the response object
    store: bool | None = None  # false: the response is not kept for previous_response_id
    previous_response_id: str | None = None
    truncation: str | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" is the one acted on
    top_logprobs: int | None = None
    # refused unless neutral: features this server does not have
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    reasoning: Any = None  # {"effort": ...}: refused unless empty


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's two forms): `prompt` (as /v1/completions takes one) or `messages` (+ `tools`);
    the fields' meanings and defaults: server/openai/tokenize.py."""

    model_config = _STRICT
    model: str | None = None
    prompt: Any = None  # str | list[int]
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool | None = None  # messages: default true (false with continue_final_message)
    continue_final_message: bool | None = None  # messages: end with the last message's content, open
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # prompt: default true (what /v1/completions encodes); messages: false
    return_token_strs: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: Any = None  # list[int]


def parse_body(raw: bytes, model: type[M]) -> M:
    """Bytes of a request body -> a validated model. Raises APIError(400) for invalid UTF-8, malformed
    JSON (a lone surrogate's `\\u` escape named with its field), a non-object body and type errors (the
    first, with its field as `param`)."""
    if len(raw) > MAX_BODY_BYTES:
        raise bad_request(f"the request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(
            f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        errors = list(e.errors())
        # json.loads took the body, pydantic's parser did not: a \ud800-style escape of half a UTF-16
        # pair, which its message calls "unexpected end of hex escape"
        found = _lone_surrogate(data) if errors and errors[0].get("type") == "json_invalid" else None
        if found is not None:
            param, code = found
            raise bad_request(f"{param + ': ' if param else ''}the string contains an invalid \\u escape: "
                              f"\\u{code:04x} is a lone surrogate (half of a UTF-16 pair), not a character",
                              param) from None
        raise validation_error(errors) from None


def _lone_surrogate(data: Any) -> tuple[str | None, int] | None:
    """(where, code point) of the first string in parsed JSON `data` (a key: where its object is) that
    holds a lone surrogate, which a `\\u` escape can write but UTF-8 cannot hold; None if none does."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:  # not recursive: json.loads takes nesting deeper than Python's stack
        loc, value = stack.pop()
        if isinstance(value, str):
            texts, children = [value], []
        elif isinstance(value, dict):
            texts, children = list(value), list(value.items())
        elif isinstance(value, list):
            texts, children = [], list(enumerate(value))
        else:
            continue
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                return format_loc(loc), ord(text[e.start])
        stack.extend((loc + (k,), v) for k, v in reversed(children))
    return None
