"""POST /v1/chat/completions: messages (+ tools) -> chat template -> prompt token ids.

The template runs in the engine's tokenizer (`render_chat`), so a tools request is keyed in the cache
by exactly the token ids the model sees, like any other prompt. Tools and their calls: tools.py;
`response_format` json_object / json_schema and forced tool calls become a grammar `Constraint`
(`tool_constraint`: with tools under auto, a response_format allows calls or its JSON).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from typing import Any

from prefixserve.config import DEFAULT_MAX_TOKENS
from prefixserve.engine.grammar import embedded_schema
from prefixserve.engine.protocol import EngineClient, TemplateError
from prefixserve.server.errors import bad_request
from prefixserve.server.namespaces import check_salt, namespace
from prefixserve.server.openai import params, reasoning, tools
from prefixserve.server.openai.completions import check_chars, check_fits, include_usage, prepared
from prefixserve.server.openai.logprobs import LogprobRenderer
from prefixserve.server.openai.prompt_memo import PromptMemo, input_digest
from prefixserve.server.openai.schemas import ChatCompletionRequest, ChatMessage, TokenizeRequest
from prefixserve.server.openai.shapes import ChatShape, Prepared, new_id
from prefixserve.types import Constraint, HistoryForm

MAX_TOP_LOGPROBS = 20
THINK_TAIL = 16  # prompt tokens read for an open <think> (the generation prompt's last few)
# OpenAI chat fields of features this server does not have (params.check_absent)
CHAT_ABSENT = (("reasoning_effort", ("a thinking model's template takes chat_template_kwargs, e.g. "
                                     '{"enable_thinking": false}')),
               ("prediction", "no predicted outputs"), ("web_search_options", "no web search"))
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "chat_template",
                                      "continue_final_message", "return_dict", "documents", "conversation"})

logger = logging.getLogger("prefixserve.server")


def prepare_chat(
    body: ChatCompletionRequest, engine: EngineClient, tenant_id: str, default_max_tokens: int = DEFAULT_MAX_TOKENS,
    memo: PromptMemo | None = None, think_split: bool = True,
) -> Prepared:
    """Validate a chat body for `tenant_id` and render its prompt. Raises APIError(400).
    `default_max_tokens`: the server's cap for a request that names none (`--default-max-tokens`);
    `memo`: recently rendered prompts, per namespace (server/openai/prompt_memo.py); `think_split`: split a
    thinking model's reasoning out of its replies (server/openai/reasoning.py; `--reasoning-parser`)."""
    model = params.check_model(body.model, engine.model_id)
    salt = check_salt(body.cache_salt)
    params.check_prompt_cache_key(body.prompt_cache_key)  # a routing hint only: not in the namespace
    params.check_unsupported(body)
    params.check_metadata(body.metadata)
    params.check_text_only(body.modalities, body.audio)
    params.check_absent(body, CHAT_ABSENT)
    n = params.check_n(body.n)
    num_logprobs = check_logprobs(body)
    if body.functions is not None or body.function_call is not None:
        raise bad_request("the legacy functions API is not supported; use tools", "functions")
    tool_list = check_tools(body)
    forced = forced_tool(body, tool_list)
    constraint = tool_constraint(body, tool_list, forced, params.response_constraint(body.response_format))
    messages = render_messages(body.messages)
    kwargs = check_template_kwargs(body.chat_template_kwargs)
    if memo is None:
        prompt_ids = render_prompt(engine, messages, tool_list, True, kwargs)
    else:
        ns = namespace(engine.model_id, tenant_id, salt)
        prompt_ids = memo.ids(ns, input_digest("chat", messages, tool_list, kwargs),
                              lambda: render_prompt(engine, messages, tool_list, True, kwargs))
    check_fits(len(prompt_ids), engine.max_model_len, param="messages")
    named = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    sampling = params.sampling_params(body, getattr(body, named), default_max_tokens, engine.max_model_len,
                                      len(prompt_ids), engine.vocab_size, num_logprobs, constraint,
                                      max_tokens_name=named, session_budget_tokens=engine.session_budget_tokens,
                                      num_choices=n)
    setup = None if tool_list is None or body.tool_choice == "none" else tools.ToolSetup(
        names=tuple(t["function"]["name"] for t in tool_list), parallel=body.parallel_tool_calls is not False)
    if setup is not None and sampling.stop:  # a stop string ends the reply's text, never cuts a call
        sampling = replace(sampling, stop_skip=(tools.OPEN, tools.CLOSE))
    thinking = thinking_start(engine, prompt_ids) if think_split else None
    shape = ChatShape(id=new_id("chatcmpl"), model=model, include_usage=include_usage(body),
                      fingerprint=engine.health().fingerprint,
                      logprobs=None if num_logprobs is None else LogprobRenderer(engine.tokenizer), tools=setup,
                      thinking=thinking, think_end_id=engine.tokenizer.think_end_id)
    # how the client's next request will hold this reply: the cache keys the finished turn so (docs/cache.md)
    drop, lead, end = engine.tokenizer.history_form(kwargs)
    history = HistoryForm(drop, lead, thinking, end) if drop or lead or thinking is not None or end is not None else None
    return prepared(engine, body, prompt_ids, sampling, tenant_id, salt, shape, n, history=history,
                    continues=setup is not None or any(m["role"] == "assistant" for m in messages))


def tool_constraint(body: ChatCompletionRequest, tool_list: list[dict[str, Any]] | None, forced: str | None,
                    fmt: Constraint | None) -> Constraint | None:
    """The reply's constraint, from the tools, `forced` (`forced_tool`) and the response_format's `fmt`:
    a forced call is exactly one call (the format holds content, and such a reply has none); under
    auto with a format, calls or the format's JSON, as the model chooses; else the format (none under
    tool_choice none, or without tools)."""
    if forced is not None:
        assert tool_list is not None
        return params.checked(Constraint("lark", tools.call_grammar(tool_list, forced or None)), "tools")
    if fmt is None or tool_list is None or body.tool_choice == "none":
        return fmt
    either = tools.calls_or_answer_grammar(tool_list, embedded_schema(fmt), body.parallel_tool_calls is not False)
    return params.checked(Constraint("lark", either), "tools")


def thinking_start(engine: EngineClient, prompt_ids: list[int]) -> bool | None:
    """None for a model that does not think; else whether the prompt ends inside a <think> block (a
    template that opens it for the model), so that the whole reply up to </think> is reasoning."""
    if not engine.tokenizer.thinks:
        return None
    tail = engine.tokenizer.decode(prompt_ids[-THINK_TAIL:])
    return tail.rfind(reasoning.OPEN) > tail.rfind(reasoning.CLOSE)


def check_logprobs(body: ChatCompletionRequest) -> int | None:
    """logprobs (bool) and top_logprobs (0..20, needs logprobs) -> the engine's num_logprobs."""
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        if not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def check_tools(body: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]] | None:
    """The tools to render, or None. With tool_choice 'none' they are rendered all the same (as OpenAI
    keeps them visible), so the turn that must answer in text is keyed by the same prefix as the turns
    that called them; only its reply is not parsed for calls. Each function's name follows OpenAI's
    rule and its `parameters` must be a JSON schema of an object; the schemas a forced call is
    constrained by (every tool's for 'required', the named one's) must compile. The others are no
    error where they do not compile (a keyword the grammar lacks): an 'auto' reply is parsed, not
    constrained, or with a response_format such a tool's arguments are any JSON object
    (`tools.calls_or_answer_grammar`); OpenAI takes any schema of a tool that is not strict."""
    choice = body.tool_choice
    if choice is not None and choice not in ("auto", "none", "required") and not isinstance(choice, dict):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
    if not body.tools:
        return None
    out = [tool.model_dump(exclude_none=True) for tool in body.tools]
    forced = named_function(choice)  # (checked by forced_tool)
    for i, tool in enumerate(out):
        name = tool["function"]["name"]
        if not TOOL_NAME.fullmatch(name):
            raise bad_request("a function name must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f"tools[{i}].function.name")
        schema = tool["function"].get("parameters")
        param = f"tools[{i}].function.parameters"
        if schema is not None:
            if schema.get("type", "object") != "object":
                raise bad_request("parameters must be a JSON schema of type 'object'", param)
            if choice == "required" or forced == name:
                params.checked(Constraint("json_schema", json.dumps(schema)), param)
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    return out


def named_function(choice: Any) -> str | None:
    """The function a `{'type': 'function', 'function': {'name': ...}}` tool_choice names, else None."""
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else None


def forced_tool(body: ChatCompletionRequest, tool_list: list[dict[str, Any]] | None) -> str | None:
    """None: the model may answer freely; "": it must call one of the tools ('required'); a name: it
    must call that function."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return None
    if tool_list is None:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice == "required":
        return ""
    assert isinstance(choice, dict)
    name = named_function(choice)
    if choice.get("type") != "function" or name is None:
        raise bad_request("tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tool_list}:
        raise bad_request(f"tool_choice names an unknown function {name[:64]!r}", "tool_choice")
    return name


def render_prompt(
    engine: EngineClient, messages: list[dict[str, Any]], tool_list: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The chat template's token ids. With tools, a template that ignores them (same ids with and
    without) gets the generic fallback of tools.py instead. Without tools, earlier calls a template
    would drop are written as text all the same (the model must see what it called). A template that
    rejects the messages is the client's error (400). `template_kwargs`: the request's
    chat_template_kwargs (`check_template_kwargs`). The templates get calls' arguments as objects;
    calls written as text keep the client's arguments string (tools.calls_as_text)."""
    def render(msgs: list[dict[str, Any]], tool_defs: list[dict[str, Any]] | None) -> list[int]:
        return _render(engine, msgs, tool_defs, add_generation_prompt, template_kwargs)

    templated = [{**m, "tool_calls": [_tool_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
                 for m in messages]
    if tool_list is None:
        native = render(templated, None)
        if not any(m.get("tool_calls") for m in messages):
            return native
        if native != render([{k: v for k, v in m.items() if k != "tool_calls"} for m in messages], None):
            return native  # the template writes calls itself
        return render(calls_as_text(messages), None)
    native = render(templated, tool_list)
    if native != render(templated, None):
        return native
    return render(fallback_messages(messages, tool_list), None)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs (as vLLM and llama.cpp's server take them, e.g. {"enable_thinking": false}
    for a Qwen3-family template): extra variables for the template, never ones the server sets."""
    if not kwargs:
        return None
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise bad_request(f"chat_template_kwargs may not set {key[:64]!r}", "chat_template_kwargs")
    return kwargs


def fallback_messages(messages: list[dict[str, Any]], tool_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the tools described in the system message and earlier calls as text."""
    out = calls_as_text(messages)
    described = tools.fallback_system_message(tool_list)
    if out and out[0]["role"] == "system":
        out[0]["content"] = out[0]["content"] + "\n\n" + described
    else:
        out.insert(0, {"role": "system", "content": described})
    return out


def calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each assistant message's tool calls written into its content (tools.py's syntax)."""
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("tool_calls"):
            m["content"] = (m["content"] + "\n" if m["content"] else "") + tools.calls_as_text(m.pop("tool_calls"))
    return out


def render_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validated messages as plain dicts. Text parts are joined with newlines; assistant tool calls are
    kept as the client sent them (`render_prompt` parses their arguments for the template)."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    answering: set[str | None] | None = None  # the call ids tool messages may answer here (after an assistant's calls)
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if msg.role == "developer" else msg.role
        item: dict[str, Any] = {"role": role, "content": message_text(msg.content, where, msg)}
        if msg.name is not None:
            item["name"] = params.check_text(msg.name, f"{where}.name")
        if msg.reasoning_content is not None:  # a thinking model's reasoning, for templates that keep it
            if msg.role != "assistant":
                raise bad_request("only assistant messages carry reasoning_content", f"{where}.reasoning_content")
            item["reasoning_content"] = params.check_text(msg.reasoning_content, f"{where}.reasoning_content")
        if msg.tool_calls:
            if msg.role != "assistant":
                raise bad_request("only assistant messages may carry tool_calls", f"{where}.tool_calls")
            item["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in msg.tool_calls]
        if msg.role == "tool":
            if msg.tool_call_id is None:
                raise bad_request("a tool message needs tool_call_id", f"{where}.tool_call_id")
            if answering is None:  # as OpenAI: a result answers a call of the assistant message before it
                raise bad_request("messages with role 'tool' must be a response to a preceding assistant message "
                                  "with 'tool_calls'", f"{where}.role")
            if None not in answering and msg.tool_call_id not in answering:  # (calls sent without ids: any)
                raise bad_request(f"tool_call_id {msg.tool_call_id[:64]!r} is not among the 'tool_calls' of the "
                                  "preceding assistant message", f"{where}.tool_call_id")
            item["tool_call_id"] = msg.tool_call_id
        elif msg.role == "assistant" and msg.tool_calls:
            answering = {tc.id for tc in msg.tool_calls}
        else:
            answering = None
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
    if not content and msg.role != "assistant":
        raise bad_request("content must not be an empty list of parts", f"{where}.content")
    texts: list[str] = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise bad_request("a content part must be an object", param)
        kind = part.get("type")
        field = "refusal" if kind == "refusal" and msg.role == "assistant" else "text"  # an assistant's refusal is its text
        if kind != field:
            raise bad_request(f"content part type {kind!r} is not supported (only 'text')", f"{param}.type")
        text = part.get(field)
        if not isinstance(text, str):
            raise bad_request(f"a {kind} part needs a string '{field}'", f"{param}.{field}")
        texts.append(params.check_text(text, f"{param}.{field}"))
    return "\n".join(texts)


def _render(engine: EngineClient, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    text_len = sum(len(json.dumps(part or [], ensure_ascii=False, default=str)) for part in (messages, tools, template_kwargs))
    check_chars(text_len, engine.max_model_len, "messages")
    try:
        ids = engine.tokenizer.render_chat(messages, tools, add_generation_prompt, template_kwargs)
    except TemplateError as e:  # the tokenizer wraps jinja errors and a template's raise_exception
        raise bad_request(f"chat template error: {e}", "messages", "template_error") from None
    if not ids:
        raise bad_request("the rendered prompt is empty", "messages")
    return list(ids)


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A call as templates expect it: arguments given as a JSON string parsed to an object."""
    fn = dict(call.get("function", {}))
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # leave it as the string the client sent
    return {**call, "function": fn}
