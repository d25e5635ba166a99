"""The Hermes-style tool-call parser on strings: edge cases, streaming, the forced-call grammar."""

from __future__ import annotations

import json

import pytest

from prefixserve.engine.grammar import check_constraint
from prefixserve.server.openai.tools import (
    ParsedReply,
    ToolCallStream,
    ToolSetup,
    call_grammar,
    calls_as_text,
    fallback_system_message,
    finish_reason,
    parse_tool_calls,
)
from prefixserve.types import Constraint

SETUP = ToolSetup(names=("get_weather", "add"))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add"}}]


def calls(text: str, setup: ToolSetup = SETUP) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text, setup).calls]


def test_one_call_no_content() -> None:
    r = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', SETUP)
    assert r.content is None and [(c.name, c.arguments) for c in r.calls] == [("get_weather", '{"city": "Paris"}')]
    assert r.calls[0].id.startswith("call_")


def test_text_before_between_and_after_calls_is_content() -> None:
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call> and '
            '<tool_call>{"name": "add", "parameters": {"x": 1}}</tool_call> done.')
    r = parse_tool_calls(text, SETUP)
    assert r.content == "Let me check.  and  done."
    assert calls(text) == [("get_weather", {"city": "A"}), ("add", {"x": 1})]
    assert calls(text, ToolSetup(names=SETUP.names, parallel=False)) == [("get_weather", {"city": "A"})]


def test_unclosed_last_tag_is_parsed_to_the_end() -> None:
    assert calls('<tool_call>{"name": "add", "arguments": {"a": 2}}') == [("add", {"a": 2})]
    r = parse_tool_calls('<tool_call>{"name": "add", "argum', SETUP)
    assert r.calls == () and r.content == '<tool_call>{"name": "add", "argum'


def test_invalid_json_unknown_names_and_bad_arguments_stay_content() -> None:
    for text in ('<tool_call>{not json}</tool_call>', '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', '<tool_call>[1, 2]</tool_call>',
                 'plain text', ''):
        r = parse_tool_calls(text, SETUP)
        assert r.calls == () and r.content == text
    mixed = '<tool_call>{bad}</tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call>'
    r = parse_tool_calls(mixed, SETUP)
    assert r.content == "<tool_call>{bad}</tool_call>" and calls(mixed) == [("add", {})]


def test_stream_passes_text_until_a_tag_may_start() -> None:
    s = ToolCallStream(SETUP)
    assert s.feed("Hello <tool") == "Hello"  # "<tool" may start a tag, and the space may end the content: held
    assert s.feed("box> x") == " <toolbox> x"
    assert s.feed(' <tool_call>{"name": "add", ') == ""
    assert s.feed('"arguments": {}}</tool_call>') == ""
    r = s.finish()
    assert r.content is None and [c.name for c in r.calls] == ["add"]
    s = ToolCallStream(SETUP)
    assert s.feed("no calls <tool_c") == "no calls"
    assert s.finish().content == " <tool_c" and s.finish().calls == ()


@pytest.mark.parametrize("text", [
    'Sure.\n\n<tool_call>{"name": "add", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "Berlin"}\n<tool_call>{"name": "add", "arguments": {}}</tool_call>\n',  # QA's reply
    '\n<tool_call>{bad}</tool_call>\n \n<tool_call>{"name": "add", "arguments": {}}</tool_call>',
    'A <tool_call>{"name": "add", "arguments": {}}</tool_call> then B \n',
    "no calls at all \n\n",
    "  \n",
])
def test_streamed_content_is_the_non_streamed_one(text: str) -> None:
    """Token by token or in one piece, the content shown is what `parse_tool_calls` returns (QA: a
    malformed call before a good one streamed a trailing newline the non-streamed reply strips)."""
    for pieces in ([text], list(text)):
        s = ToolCallStream(SETUP)
        shown = "".join(s.feed(p) for p in pieces)
        rest = s.finish()
        whole = parse_tool_calls(text, SETUP)
        assert (shown + (rest.content or "") or None) == whole.content
        assert [(c.name, c.arguments) for c in rest.calls] == [(c.name, c.arguments) for c in whole.calls]


def test_forced_grammar_compiles_and_history_round_trips() -> None:
    check_constraint(Constraint("lark", call_grammar(TOOLS, None)))
    check_constraint(Constraint("lark", call_grammar(TOOLS, "get_weather")))
    text = calls_as_text([{"function": {"name": "add", "arguments": {"a": 1}}}])
    assert text == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' and calls(text) == [("add", {"a": 1})]
    assert '<tool_call>\n{"name": "<function name>", "arguments": {' in fallback_system_message(TOOLS)
    two = calls_as_text([{"function": {"name": "add", "arguments": '{"a":1}'}},
                         {"function": {"name": "get_weather", "arguments": '{"city": "A"}'}}])
    assert two == ('<tool_call>\n{"name": "add", "arguments": {"a":1}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>')


@pytest.mark.parametrize(("body", "arguments"), [
    ('{"name":"add","arguments":{"a":1,"b":[2, {"c":"}"}]}}', '{"a":1,"b":[2, {"c":"}"}]}'),
    ('\n { "arguments" : { "x" : "\\u00e9" } ,"name" : "add" }\n', '{ "x" : "\\u00e9" }'),
    ('{"name": "add", "arguments": {"a": 1}, "arguments": {"a": 2}}', '{"a": 2}'),  # json.loads keeps the last
    ('{"name": "add", "parameters": {"q": true}}', '{"q": true}'),
    ('{"name": "add"}', "{}"),
])
def test_arguments_are_the_models_own_text(body: str, arguments: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    stream = ToolCallStream(SETUP)
    for ch in text:
        stream.feed(ch)
    for reply in (parse_tool_calls(text, SETUP), stream.finish()):
        assert [(c.name, c.arguments, c.complete) for c in reply.calls] == [("add", arguments, True)]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "Sure.",
         [("get_weather", '{"city": "Par', False)]),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_c', None,
         [("get_weather", '{"city": "Paris"}', True)]),  # only the closing tag was cut: a whole call
        ('<tool_call>{"name": "get_weather", "argu', None, [("get_weather", "", False)]),
        ('Hm <tool_call>{"name": "get_wea', "Hm ", []),  # the name cut: the syntax is left out
        ('<tool_call>\n{"name": "get_weather', None, [("get_weather", "", False)]),  # a known name, unclosed
        ('Hm <tool_call>\n{ "name" :', "Hm ", []),  # any call may follow
        ("plain text cut", "plain text cut", []),
        # not becoming a call of a known function: the model's text, as when no max_tokens cut it
        # (QA: asked to quote a tag, 25 tokens billed and the content was "")
        ('<tool_call>{"name": "unknown", "arguments": {"a', '<tool_call>{"name": "unknown", "arguments": {"a', []),
        ('<tool_call>\n{"description": "x', '<tool_call>\n{"description": "x', []),
        ("```\n<tool_call>\nquoted text", "```\n<tool_call>\nquoted text", []),
    ],
)
def test_a_reply_cut_by_max_tokens_returns_no_call_being_written_as_content(text: str, content: str | None,
                                                                          calls: list[tuple[str, str, bool]]) -> None:
    for reply in (parse_tool_calls(text, SETUP, cut=True), _streamed(text)):
        assert [(c.name, c.arguments, c.complete) for c in reply.calls] == calls
        assert (reply.content or "").strip() == (content or "").strip()
        assert finish_reason(reply, "length") == ("tool_calls" if calls and all(c[2] for c in calls) else "length")


def _streamed(text: str) -> ParsedReply:
    stream = ToolCallStream(SETUP)
    shown = "".join(stream.feed(ch) for ch in text)
    rest = stream.finish(cut=True)
    return ParsedReply(shown + (rest.content or "") or None, rest.calls)
