"""The Responses API's `input` items: as the chat messages they mean, as the typed items a stored
response keeps (GET /v1/responses/{id}/input_items lists them), and `item_reference` items resolved to
an item of one of the tenant's stored responses (how the Codex CLI replays a conversation).

An item keeps the id its client gave it (a replayed output item's `msg_...` / `fc_...`), or gets one.
A message's string content is kept as one text part, which the chat template renders the same as the
string (server/openai/chat.py joins text parts with newlines), so a conversation replayed by reference is
keyed in the prefix cache by the same token ids as one re-sent in full.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from prefixserve.server.errors import APIError, bad_request

TEXT_PARTS = ("input_text", "output_text", "text")
KINDS = ("message", "function_call", "function_call_output", "item_reference", "reasoning")
MAX_LIMIT = 100
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")


def resolved(raw: Any, find: Callable[[str], dict[str, Any] | None]) -> Any:
    """`input` with each `item_reference` replaced by the stored item it names (`find`: by id, within the
    tenant's stored responses). Raises APIError(400) for a reference to nothing."""
    if not isinstance(raw, list):
        return raw
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            ref = item.get("id")
            found = find(ref) if isinstance(ref, str) else None
            if found is None:
                what = f"item with id {ref[:64]!r}" if isinstance(ref, str) else "an item id"
                raise bad_request(f"{what} was not found in this key's stored responses", f"input[{i}].id")
            item = found
        out.append(item)
    return out


def check_include(include: list[str] | None) -> None:
    """`include` values OpenAI defines; only the logprobs one adds anything here (no reasoning, search,
    image or code items are ever produced), and an unknown one is a typo to report, as OpenAI does."""
    for i, value in enumerate(include or ()):
        if value not in INCLUDABLE:
            raise bad_request(f"include[{i}] must be one of {', '.join(INCLUDABLE)}", f"include[{i}]")


def check_call_outputs(history: tuple[dict[str, Any], ...], items: Any) -> None:
    """A `function_call_output` answers a call made before it, in the stored history or in `input`
    (OpenAI: "No tool call found for function call output with call_id ...")."""
    called = {c.get("id") for m in history for c in m.get("tool_calls") or ()}
    for i, item in enumerate(items if isinstance(items, list) else ()):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "function_call":
            called.add(item.get("call_id"))
        elif kind == "function_call_output" and item.get("call_id") not in called:
            call_id = str(item.get("call_id"))[:64]
            raise bad_request(f"No tool call found for function call output with call_id {call_id}.",
                              f"input[{i}].call_id")


def chat_messages(items: Any) -> list[dict[str, Any]]:
    """`input` (a string, or resolved items) as chat messages; the chat checks validate what is inside."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request("an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "reasoning":  # as this server outputs it: the text in content (a summary is not the text)
            thought += _reasoning_text(item.get("content"), where)
            continue
        if kind == "message":
            out.append({"role": item.get("role"), "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and not thought:  # text and calls of one turn: one message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _content(item.get("output"), where, "output")})
        else:
            raise bad_request(f"input item type {kind!r} is not supported ({', '.join(KINDS)})", f"{where}.type")
        if thought and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], thought = thought, ""
    return out


def _reasoning_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if not isinstance(content, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        raise bad_request("a reasoning item's content must be a list of reasoning_text parts", f"{where}.content")
    return "".join(p["text"] for p in content)


def typed_items(items: Any) -> list[dict[str, Any]]:
    """Validated `input` (chat_messages accepted it) as the typed items a stored response keeps."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        given = item.get("id")
        if kind == "message":
            role = item["role"]
            text = "output_text" if role == "assistant" else "input_text"
            content = item.get("content")
            parts = ([{"type": text, "text": content}] if isinstance(content, str)
                     else [{**p, "type": text if p["type"] == "text" else p["type"]} for p in content or []])
            out.append({"type": "message", "id": given if isinstance(given, str) else f"msg_{uuid.uuid4().hex}",
                        "role": role, "content": parts, "status": "completed"})
        elif kind == "function_call":
            out.append({"type": kind, "id": given if isinstance(given, str) else f"fc_{uuid.uuid4().hex}",
                        "call_id": item.get("call_id"), "name": item.get("name"),
                        "arguments": item.get("arguments"), "status": "completed"})
        elif kind == "reasoning":
            out.append({"type": kind, "id": given if isinstance(given, str) else f"rs_{uuid.uuid4().hex}",
                        "summary": item.get("summary") or [], "content": item.get("content") or [],
                        "status": "completed"})
        else:
            out.append({"type": kind, "id": given if isinstance(given, str) else f"fco_{uuid.uuid4().hex}",
                        "call_id": item.get("call_id"), "output": item.get("output"), "status": "completed"})
    return out


def listed(items: tuple[dict[str, Any], ...], query: dict[str, str]) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: a page of `items`, OpenAI's list shape and cursors (`order`
    desc by default: the newest item first; `after` / `before` an item id; `limit` 1..100, default 20)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}", "limit")
    seq = list(items) if order == "asc" else list(reversed(items))
    ids = [item["id"] for item in seq]
    start, end = 0, len(seq)
    for name in ("after", "before"):
        if (cursor := query.get(name)) is not None:
            if cursor not in ids:
                raise APIError(400, f"no input item with id {cursor[:64]!r} in this response", param=name)
            if name == "after":
                start = ids.index(cursor) + 1
            else:
                end = ids.index(cursor)
    page = seq[start:end][:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": end - start > len(page)}


def _content(content: Any, where: str, name: str = "content") -> Any:
    """A string, or text parts (input_text / output_text) as chat text parts."""
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(f"content part type {kind!r} is not supported (only text)", f"{where}.{name}[{j}].type")
        parts.append({"type": "text", "text": part.get("text")})
    return parts
