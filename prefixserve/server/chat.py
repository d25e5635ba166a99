"""POST /v1/chat/completions: messages (+ tools) -> chat template -> prompt token ids.

The template runs in the engine's tokenizer (`render_chat`), so a tools request is keyed in the cache
by exactly the token ids the model sees, like any other prompt.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from prefixserve.engine.protocol import EngineClient, TemplateError
from prefixserve.server import params
from prefixserve.server.completions import check_chars, check_fits, prepared
from prefixserve.server.errors import bad_request
from prefixserve.server.responses import ChatShape, Prepared
from prefixserve.server.schemas import ChatCompletionRequest, ChatMessage

logger = logging.getLogger("prefixserve.server")


def prepare_chat(body: ChatCompletionRequest, engine: EngineClient, tenant_id: str) -> Prepared:
    """Validate a chat body for `tenant_id` and render its prompt. Raises APIError(400)."""
    model = params.check_model(body.model, engine.model_id)
    salt = params.check_salt(body.cache_salt)
    params.check_unsupported(body)
    if body.logprobs:
        raise bad_request("logprobs is not supported", "logprobs")
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported", "top_logprobs")
    if body.functions is not None or body.function_call is not None:
        raise bad_request("the legacy functions API is not supported; use tools", "functions")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    tools = check_tools(body)
    messages = render_messages(body.messages)
    prompt_ids = render_prompt(engine, messages, tools)
    check_fits(len(prompt_ids), engine.max_model_len)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    remaining = max(1, engine.max_model_len - len(prompt_ids))  # no limit given: until the context fills
    sampling = params.sampling_params(body, max_tokens, remaining, engine.max_model_len)
    return prepared(engine, body, prompt_ids, sampling, tenant_id, salt, model, "chatcmpl", ChatShape)


def check_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools to render, or None. tool_choice 'auto' (default) and 'none' are supported; with 'none'
    the tools are left out of the prompt. Forcing a call ('required', a named function) is not."""
    choice = body.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise bad_request(
            "tool_choice must be 'auto' or 'none' (forced tool calls are not supported)", "tool_choice"
        )
    if not body.tools or choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def render_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validated messages as plain dicts for the chat template. Text parts are joined with newlines;
    assistant tool-call arguments given as JSON strings are parsed to objects, as templates expect."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if msg.role == "developer" else msg.role
        item: dict[str, Any] = {"role": role, "content": message_text(msg.content, where, msg)}
        if msg.name is not None:
            item["name"] = params.check_text(msg.name, f"{where}.name")
        if msg.tool_calls:
            if msg.role != "assistant":
                raise bad_request("only assistant messages may carry tool_calls", f"{where}.tool_calls")
            item["tool_calls"] = [_tool_call(tc.model_dump(exclude_none=True)) for tc in msg.tool_calls]
        if msg.role == "tool":
            if msg.tool_call_id is None:
                raise bad_request("a tool message needs tool_call_id", f"{where}.tool_call_id")
            item["tool_call_id"] = msg.tool_call_id
        out.append(item)
    return out


def message_text(content: Any, where: str, msg: ChatMessage) -> str:
    """content: str, a list of {"type": "text", "text": str} parts, or None for an assistant message
    that carries tool_calls (or any assistant message: an empty turn)."""
    if content is None:
        if msg.role == "assistant":
            return ""
        raise bad_request(f"{where}.content is required for role '{msg.role}'", f"{where}.content")
    if isinstance(content, str):
        return params.check_text(content, f"{where}.content")
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of text parts", f"{where}.content")
    texts: list[str] = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise bad_request("a content part must be an object", param)
        kind = part.get("type")
        if kind != "text":
            raise bad_request(f"content part type {kind!r} is not supported (only 'text')", f"{param}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request("a text part needs a string 'text'", f"{param}.text")
        texts.append(params.check_text(text, f"{param}.text"))
    return "\n".join(texts)


def render_prompt(
    engine: EngineClient, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The chat template's token ids. A template that rejects the messages is the client's error (400)."""
    text_len = len(json.dumps(messages, ensure_ascii=False, default=str)) + len(json.dumps(tools or [], default=str))
    check_chars(text_len, engine.max_model_len, "messages")
    try:
        ids = engine.tokenizer.render_chat(messages, tools)
    except TemplateError as e:  # the tokenizer wraps jinja errors and a template's raise_exception
        raise bad_request(f"chat template error: {e}", "messages", "template_error") from None
    if not ids:
        raise bad_request("the rendered prompt is empty", "messages")
    return list(ids)


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function", {}))
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # leave it as the string the client sent
    return {**call, "function": fn}
