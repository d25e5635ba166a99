"""Tool calls: the prompt side (native template or the generic fallback), the grammar that forces a
call, and the parser that turns the model's text into OpenAI `tool_calls`.

The call syntax is Hermes-style, in the one text form the Qwen2.5/Qwen3/Hermes templates write a
call in (`call_text`): ``<tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>``, `", "`
between items and `": "` after keys. The forced-call grammar makes the model write exactly that form,
the fallback's system message teaches it, and the fallback writes calls back in it with the client's
`arguments` verbatim, which is the model's own text of them (`parse_tool_calls` returns that
substring, as OpenAI does): an echoed call renders as the text the model generated, so the next
turn's prefix cache hit reaches into it, as far as the model's tokens are the tokenizer's own
encoding of that text (docs/architecture.md, "Structured outputs and tool calls"). A template that
renders `tools` itself (its prompt changes with them) gets them natively and writes calls back
itself. A template that drops them (the embedded SmolLM2) gets the generic fallback: the tools and the
syntax are described in a system message, and assistant turns that made calls are written back as text.

`tool_choice` "required" or a named function is enforced by constrained decoding (`call_grammar`):
the reply is exactly one call whose arguments match the tool's JSON schema (a response_format then
holds nothing: the reply has no content). "auto" lets the model choose and parses what it wrote; with
a response_format it is held to calls or the format's JSON (`calls_or_answer_grammar`). "none" shows
the tools but parses nothing (a response_format holds the whole reply).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixserve.engine.detok import partial_len
from prefixserve.engine.grammar import compiled_schema, schema_compiles

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD, TAIL = OPEN + "\n", "\n" + CLOSE  # around a call's JSON object (`call_text`)
ITEM_SEP, KEY_SEP = ", ", ": "  # the templates' `tojson` (json.dumps' defaults), and the forced grammar's
_DECODER = json.JSONDecoder()
CUT_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]+)')  # a function name (chat.TOOL_NAME's) cut short
CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(,\s*"(?:arguments|parameters)"\s*:\s*)?')


@dataclass(frozen=True, slots=True)
class ToolCallOut:
    """One parsed call, as OpenAI returns it (arguments: the JSON text the model wrote for them)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    complete: bool = True  # False: max_tokens cut it (its arguments are the JSON written so far)

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None  # None when the reply is only calls
    calls: tuple[ToolCallOut, ...]


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """What a chat request asked of tools. `names`: the functions the model may call."""

    names: tuple[str, ...]
    parallel: bool = True  # parallel_tool_calls: several calls in one reply (False: the first only)


def parse_tool_calls(text: str, setup: ToolSetup, cut: bool = False) -> ParsedReply:
    """Every well-formed ``<tool_call>{json}</tool_call>`` naming a known function becomes a call; an
    unclosed last tag is parsed to the end of the text. Anything else (text before, between and
    after calls, invalid JSON, unknown names) stays content, unchanged apart from stripping.
    `cut`: max_tokens ended the reply, so an unclosed last tag that does not parse was being written:
    it is an incomplete call where its function's name is complete (as OpenAI returns a call cut by
    max_tokens: finish_reason length, the arguments written so far), left out where it may still have
    been becoming a call (the start of a known name: never returned as call syntax in the content),
    and content where it was not (an unknown name, other JSON, other text)."""
    content, calls = _split(text, setup, cut)
    if not calls:
        return ParsedReply(content if cut else text, ())
    return ParsedReply(content.strip() or None, calls)


def finish_reason(reply: ParsedReply, reason: str) -> str:
    """A reply's finish_reason: tool_calls when it ends in complete calls, else the engine's."""
    return "tool_calls" if reply.calls and all(c.complete for c in reply.calls) else reason


class ToolCallStream:
    """Streaming side of `parse_tool_calls`: text is passed on as content until a call may start;
    from the first ``<tool_call>`` on it is held and parsed when the choice finishes. Trailing
    whitespace is held too, so that a reply with calls streams the content `parse_tool_calls`
    returns (stripped) but for whitespace it opened with, which was shown before any call was."""

    def __init__(self, setup: ToolSetup) -> None:
        self._setup = setup
        self._held = ""  # text not yet passed on (trailing whitespace, a possible tag start, everything after a tag)
        self._in_call = False
        self._shown = False  # some content was passed on

    def feed(self, text: str) -> str:
        """Content safe to stream now."""
        self._held += text
        if self._in_call:
            return ""
        if (i := self._held.find(OPEN)) != -1:
            self._in_call = True
            body = self._held[:i]
        else:
            body = self._held[: len(self._held) - partial_len(self._held, OPEN)]
        out = body.rstrip()
        self._held = self._held[len(out):]
        self._shown = self._shown or bool(out)
        return out

    def finish(self, cut: bool = False) -> ParsedReply:
        """The rest: content not yet streamed (None if none) and the calls (`cut`: as `parse_tool_calls`).
        With calls, stripped as `parse_tool_calls` strips the whole content."""
        content, calls = _split(self._held, self._setup, cut)
        if calls:
            content = content.rstrip() if self._shown else content.strip()
        return ParsedReply((content if calls or cut else self._held) or None, calls)


def call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON schema of one call: to the named function, or to any of `tools`."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        # no parameters: an empty list of them (OpenAI's reading), so the call's arguments are {}
        params = compiled_schema(fn.get("parameters") or {"type": "object", "properties": {}})
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ITEM_SEP,
                                     "key_separator": KEY_SEP}}


def call_grammar(tools: list[dict[str, Any]], name: str | None) -> str:
    """A Lark grammar (llguidance's dialect) for exactly one call in its canonical text (`call_text`):
    name first (the schema's property order), no whitespace but the separators'."""
    return f"start: {json.dumps(HEAD)} call {json.dumps(TAIL)}\ncall: %json {json.dumps(call_schema(tools, name))}\n"


def calls_or_answer_grammar(tools: list[dict[str, Any]], answer: dict[str, Any], parallel: bool = True) -> str:
    """A Lark grammar for `tool_choice` auto with a response_format: the reply is either calls or JSON
    matching `answer` (the response_format's schema, `grammar.embedded_schema`), as the model decides
    with its first token (`<` or `{`). Calls: one (`parallel` false) or more, one a line, each in its
    canonical text as `call_grammar` forces it. A tool whose schema does not compile on its own (a
    keyword the grammar lacks) is called with any JSON object as its arguments: under auto its schema
    is no error (`chat.check_tools`)."""
    lenient = [tool if schema_compiles(call_schema([tool], None)) else _any_arguments(tool) for tool in tools]
    more = ' ("\\n" tagged)*' if parallel else ""
    return (f"start: calls | answer\ncalls: tagged{more}\ntagged: {json.dumps(HEAD)} call {json.dumps(TAIL)}\n"
            f"call: %json {json.dumps(call_schema(lenient, None))}\nanswer: %json {json.dumps(answer)}\n")


def _any_arguments(tool: dict[str, Any]) -> dict[str, Any]:
    """`tool` with its parameters read as any JSON object."""
    return {**tool, "function": {**tool["function"], "parameters": {"type": "object"}}}


def call_text(name: str, arguments: str) -> str:
    """One call in its canonical text, as the forced grammar makes the model write it and as the
    fallback writes it back: `arguments` (JSON text) is written as it is."""
    name_json = json.dumps(name, ensure_ascii=False)
    return f'{HEAD}{{"name"{KEY_SEP}{name_json}{ITEM_SEP}"arguments"{KEY_SEP}{arguments}}}{TAIL}'


def fallback_system_message(tools: list[dict[str, Any]]) -> str:
    """The tools and the call syntax, for a template that does not render tools itself."""
    lines = ["You can call these functions. To call one, reply with only",
             call_text("<function name>", "{<arguments as JSON>}"),
             "Functions:"]
    for tool in tools:
        fn = tool["function"]
        lines.append(json.dumps({"name": fn["name"], "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters") or {}}, sort_keys=True))
    return "\n".join(lines)


def calls_as_text(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls written back as `call_text`, one a line (as the Qwen/Hermes templates
    write them). A client's `arguments` string that is JSON is written verbatim: it is the model's own
    text of them (`parse_tool_calls`), so the turn renders as the text the model generated. An
    object (accepted leniently) is serialized with the canonical separators, a string that is not
    JSON is written as a JSON string, and none or an empty string as {}."""
    return "\n".join(call_text(str(call.get("function", {}).get("name")),
                               _arguments_text(call.get("function", {}).get("arguments"))) for call in tool_calls)


def _call_from_json(body: str, setup: ToolSetup) -> ToolCallOut | None:
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or value.get("name") not in setup.names:
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if not isinstance(value.get(key, {}), dict):
        return None
    spans = _value_spans(body)  # the model's own text of the arguments, as OpenAI returns it
    return ToolCallOut(name=str(value["name"]), arguments=body[slice(*spans[key])] if key in spans else "{}")


def _value_spans(body: str) -> dict[str, tuple[int, int]]:
    """Where each member's value of the JSON object `body` (one that json.loads parses) is written:
    key -> (start, end), the last one of a repeated key (as json.loads keeps)."""
    spans: dict[str, tuple[int, int]] = {}
    pos = _skip_ws(body, 0) + 1  # past "{"
    while body[pos := _skip_ws(body, pos)] != "}":
        key, pos = _DECODER.raw_decode(body, pos)
        start = _skip_ws(body, _skip_ws(body, pos) + 1)  # past ":"
        _, end = _DECODER.raw_decode(body, start)
        spans[key] = (start, end)
        pos = _skip_ws(body, end)
        if body[pos] == ",":
            pos += 1
    return spans


def _skip_ws(text: str, pos: int) -> int:
    """The position of the first character at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def _arguments_text(args: Any) -> str:
    """A call's `arguments` as a client sent them (a JSON string, or an object) -> JSON text."""
    if args is None or (isinstance(args, str) and not args.strip()):
        return "{}"
    if isinstance(args, str):
        try:
            json.loads(args)
            return args
        except (json.JSONDecodeError, RecursionError):
            pass
    return json.dumps(args, ensure_ascii=False, separators=(ITEM_SEP, KEY_SEP))


def _cut_call(body: str, setup: ToolSetup) -> ToolCallOut | None:
    """A call cut by max_tokens, from its name and the arguments' JSON so far (name first, as the
    forced-call grammar writes it); None when the name is not complete or not a known function. A
    name cut before its closing quote is complete where it is a known function's and begins no other's."""
    m = CUT_CALL.match(body)
    if m is None:
        if (cut := CUT_NAME.fullmatch(body)) is not None:
            name = cut.group(1)
            if name in setup.names and not any(n != name and n.startswith(name) for n in setup.names):
                return ToolCallOut(name=name, arguments="", complete=False)
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None
    if name not in setup.names:
        return None
    return ToolCallOut(name=name, arguments=body[m.end():].rstrip() if m.group(2) else "", complete=False)


def _may_be_call(body: str, setup: ToolSetup) -> bool:
    """Whether `body`, the text after an open tag that max_tokens cut before a known function's name
    was whole, may have been becoming a call: whitespace aside, the start of `{"name": "<a known name>"`.
    (Anything else was the model's text, e.g. a tag it was asked to quote, and stays content.)"""
    squeezed = "".join(body.split())
    return any(f'{{"name":{json.dumps(name)}'.startswith(squeezed) for name in setup.names)


def _split(text: str, setup: ToolSetup, cut: bool = False) -> tuple[str, tuple[ToolCallOut, ...]]:
    """The text outside the calls (as it is) and the calls."""
    calls: list[ToolCallOut] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(OPEN, pos)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        body_end = len(text) if end == -1 else end
        after = len(text) if end == -1 else end + len(CLOSE)
        body = text[start + len(OPEN) : body_end]
        if end == -1:  # a closing tag cut short is no part of the JSON
            body = body[: len(body) - partial_len(body, CLOSE)]
        call = _call_from_json(body, setup)
        rest = text[start + len(OPEN) :]
        if call is None and cut and end == -1 and ((call := _cut_call(rest, setup)) or _may_be_call(rest, setup)):
            kept.append(text[pos:start])  # the call being written when max_tokens cut the reply
            if call is None:
                pos = after
                continue
        else:
            kept.append(text[pos:start] if call is not None else text[pos:after])
        if call is not None and (setup.parallel or not calls):
            calls.append(call)
        pos = after
    kept.append(text[pos:])
    return "".join(kept), tuple(calls)
