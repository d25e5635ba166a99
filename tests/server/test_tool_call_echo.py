"""A call echoed back renders as the reply the model generated: on the embedded model's tokenizer,
whose template drops `tools` (the fallback path), the text the forced-call grammar makes the model
write, returned as a call and sent back by a client in the next request's messages, renders to the
same characters and token ids inside the history, so the next turn's cache hit can cover the call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.engine.grammar import grammar_source
from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_gguf
from prefixserve.server.openai.tools import ToolCallStream, ToolSetup, call_grammar, parse_tool_calls
from prefixserve.types import Constraint
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import auth

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris?"}]
FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer_gguf(embedded_model_path())


@pytest.fixture
def smol(make_client: Callable[..., TestClient], tok: Tokenizer) -> TestClient:
    """The HTTP API over the embedded model's tokenizer and chat template (no model: /tokenize only)."""
    eng = FakeEngine(max_model_len=8192)
    eng.tokenizer = tok  # type: ignore[assignment]
    return make_client(eng=eng)


def accepts(tok: Tokenizer, text: str, tools: list[dict[str, Any]] | None = None) -> bool:
    """Whether the forced-call grammar lets the model write exactly `text` (in the tokenizer's tokens)."""
    return matches(tok, Constraint("lark", call_grammar(tools or [WEATHER], None)), text)


def matches(tok: Tokenizer, constraint: Constraint, text: str) -> bool:
    import llguidance
    import llguidance.hf

    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok.hf), grammar_source(constraint), log_level=0)
    return bool(m.consume_tokens(tok.hf.encode(text, add_special_tokens=False))) and m.is_accepting()


def tokenize(client: TestClient, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    r = client.post("/tokenize", headers=auth(), json={"model": "fake-model", "messages": messages,
                                                       "tools": [WEATHER], "add_generation_prompt": generation_prompt})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_the_grammar_forces_the_form_that_is_written_back(tok: Tokenizer) -> None:
    assert accepts(tok, FORCED)
    compact = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":2}}\n</tool_call>'
    sorted_keys = '<tool_call>\n{"arguments": {"city": "Paris", "days": 2}, "name": "get_weather"}\n</tool_call>'
    no_newlines = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
    assert not any(accepts(tok, text) for text in (compact, sorted_keys, no_newlines))


def test_forced_arguments_hold_the_declared_keys_only(tok: Tokenizer) -> None:
    """QA: a function declared without `parameters` was forced with an open object, and the embedded
    model filled 1,024 tokens with `{"name": "ping", "parameters": {"name": ...` (cut, not JSON); a tool
    with listed properties got invented extra keys beside them. No parameters is an empty list of them
    (OpenAI's reading): `{}`; an object schema that lists its properties and says nothing of others gets
    no others (as vLLM and xgrammar read it); one that allows others (or lists none) keeps them."""
    def call(name: str, args: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
    ping = {"type": "function", "function": {"name": "ping", "description": "Ping the server"}}
    assert accepts(tok, call("ping", "{}"), [ping])
    assert not accepts(tok, call("ping", '{"name": "ping"}'), [ping])
    empty = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    assert accepts(tok, call("ping", "{}"), [empty]) and not accepts(tok, call("ping", '{"x": 1}'), [empty])
    city = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    assert accepts(tok, call("get_weather", '{"city": "Oslo", "where": {"lat": 59.9}}'), [weather])
    assert not accepts(tok, call("get_weather", '{"city": "Oslo", "properties": {}}'), [weather])
    assert not accepts(tok, call("get_weather", '{"city": "Oslo", "where": {"lat": 1, "x": 2}}'), [weather])
    free = {"type": "function", "function": {"name": "log", "parameters": {
        "type": "object", "properties": {"extra": {"type": "object"}}, "additionalProperties": True}}}
    assert accepts(tok, call("log", '{"extra": {"any": 1}, "more": 2}'), [free])
    assert city == {"type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}  # not changed
    # response_format's schemas read the same way; a property named "properties" is a property
    schema = Constraint("json_schema", json.dumps({"type": "object", "properties": {"properties": {"type": "integer"}}}))
    assert matches(tok, schema, '{"properties":1}') and not matches(tok, schema, '{"properties":1,"age":2}')


@pytest.mark.parametrize("reply", [
    FORCED,
    # tool_choice auto: the model wrote its arguments compact and out of schema order; they come back as written
    '<tool_call>\n{"name": "get_weather", "arguments": {"days":2,"city":"Paris"}}\n</tool_call>',
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\u00e9"}}\n</tool_call>',
])
def test_an_echoed_call_renders_as_the_generated_reply(smol: TestClient, tok: Tokenizer, reply: str) -> None:
    parsed = parse_tool_calls(reply, ToolSetup(names=("get_weather",)))
    stream = ToolCallStream(ToolSetup(names=("get_weather",)))
    shown = "".join(stream.feed(ch) for ch in reply)
    streamed = stream.finish()
    [call] = parsed.calls
    assert [(c.name, c.arguments) for c in streamed.calls] == [(call.name, call.arguments)]
    assert call.arguments in reply  # the model's own text of them, not a re-serialization
    assert (shown + (streamed.content or "")).strip() == (parsed.content or "")
    # the client echoes the reply as the official client hands it over (content None when only calls)
    echoed = {"role": "assistant", "content": parsed.content, "tool_calls": [call.as_dict()]}
    prompt = tokenize(smol, ASK, True)
    history = tokenize(smol, [*ASK, echoed], False)
    generated = tok.hf.encode(reply, add_special_tokens=False)  # the reply's tokens, as a model writes them
    end = len(prompt) + len(generated)
    assert history[: len(prompt)] == prompt and history[len(prompt) : end] == generated
    assert tok.decode(history[end:], skip_special_tokens=False).startswith("<|im_end|>")  # the turn ends there
    assert tok.decode(history[len(prompt) : end], skip_special_tokens=False) == reply  # the same characters


def test_arguments_sent_as_an_object_or_not_as_json_are_written_canonically(smol: TestClient, tok: Tokenizer) -> None:
    """An object (accepted leniently) is written with the canonical separators in the client's key
    order; a string that is not JSON is written as a JSON string."""
    def written(arguments: Any) -> str:
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ids = tokenize(smol, [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}], False)
        text = tok.decode(ids, skip_special_tokens=False)
        return text[text.rindex("<tool_call>") : text.rindex("</tool_call>") + len("</tool_call>")]

    assert written({"city": "Paris", "days": 2}) == FORCED
    assert written(json.dumps({"city": "Paris", "days": 2}, separators=(",", ":"))) == FORCED.replace(
        '"city": "Paris", "days": 2', '"city":"Paris","days":2')
    assert written("not json") == '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>'
    assert written("") == '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
