"""Tools and a response_format in one request: under tool_choice auto the reply is either calls (the
Hermes syntax the parser reads) or JSON matching the format, as the model chooses; under none the
format alone; under required or a named function one call, which the format does not prevent.

The grammar is checked by feeding a matcher the embedded tokenizer's tokens of whole replies (no
model needed); the request wiring through the HTTP API on the fake engine, by the constraint each
request reached the engine with. Generation and parsing: tests/server/test_tool_calls_tiny.py (a tiny
random model) and tests/server/test_openai_agents_real.py (the embedded model).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.engine.grammar import embedded_schema, grammar_source
from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_gguf
from prefixserve.server.openai.tools import call_text, calls_or_answer_grammar
from prefixserve.types import Constraint
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import auth

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# a keyword the grammar lacks: no error under auto, and its arguments are then any JSON object
TAGS = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
CALL = call_text("get_weather", '{"city": "Paris"}')
TAG_CALL = call_text("tag", '{"tags": ["a", "a"], "extra": 1}')
JSON_ANSWER = '{"answer":"sunny","sure":true}'  # compact, as a response_format alone makes it
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer_gguf(embedded_model_path())


def accepts(tok: Tokenizer, grammar: str, text: str) -> bool:
    """Whether the Lark grammar lets a model write exactly `text`, token by token (the tokenizer's own)."""
    import llguidance
    import llguidance.hf

    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok.hf), grammar_source(Constraint("lark", grammar)),
                             log_level=0)
    return bool(m.consume_tokens(tok.hf.encode(text, add_special_tokens=False))) and m.is_accepting()


def either(fmt: Constraint, parallel: bool = True) -> str:
    return calls_or_answer_grammar([WEATHER, TAGS], embedded_schema(fmt), parallel)


def test_auto_with_a_schema_admits_a_call_or_the_schemas_json_and_nothing_else(tok: Tokenizer) -> None:
    grammar = either(Constraint("json_schema", json.dumps(ANSWER)))
    for text in (CALL, JSON_ANSWER, f"{CALL}\n{CALL}", f"{CALL}\n{TAG_CALL}"):
        assert accepts(tok, grammar, text), text
    for text in ("It is sunny in Paris.", '{"answer":"sunny"}', '{"answer":"sunny","sure":true,"x":1}',
                 '{"answer": "sunny", "sure": true}', f"{CALL}\n{JSON_ANSWER}", f"{JSON_ANSWER}\n{CALL}",
                 f"Sure. {CALL}", call_text("get_weather", '{"town": "Paris"}'), call_text("nope", "{}"),
                 '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'):
        assert not accepts(tok, grammar, text), text
    assert accepts(tok, either(Constraint("json_schema", json.dumps(ANSWER)), parallel=False), CALL)
    assert not accepts(tok, either(Constraint("json_schema", json.dumps(ANSWER)), parallel=False), f"{CALL}\n{CALL}")


def test_auto_with_json_object_admits_a_call_or_any_object(tok: Tokenizer) -> None:
    grammar = either(Constraint("json_object"))
    for text in (CALL, '{"anything":[1,2]}', "{}"):
        assert accepts(tok, grammar, text), text
    for text in ("[1]", '"text"', "Hello"):
        assert not accepts(tok, grammar, text), text


def requested(make_client: Callable[..., TestClient], path: str, body: dict[str, Any]) -> Constraint | None:
    """The constraint a request reached the (fake) engine with."""
    eng = FakeEngine(max_model_len=4096)
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    r = make_client(eng=eng).post(path, headers=auth(), json={"model": "fake-model", limit: 4, **body})
    assert r.status_code == 200, r.text
    return eng.requests[-1].sampling.constraint


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_with_a_format_is_held_to_calls_or_the_format(
        make_client: Callable[..., TestClient], tool_choice: str | None) -> None:
    body = {"messages": MSGS, "tools": [WEATHER, TAGS], "response_format": FORMAT,
            **({"tool_choice": tool_choice} if tool_choice else {})}
    c = requested(make_client, "/v1/chat/completions", body)
    assert c is not None and c.kind == "lark"
    assert c.source == either(Constraint("json_schema", json.dumps(ANSWER)))
    one = requested(make_client, "/v1/chat/completions", {**body, "parallel_tool_calls": False})
    assert one is not None and one.source == either(Constraint("json_schema", json.dumps(ANSWER)), parallel=False)


def test_none_with_a_format_is_the_format_only(make_client: Callable[..., TestClient]) -> None:
    c = requested(make_client, "/v1/chat/completions",
                  {"messages": MSGS, "tools": [WEATHER], "tool_choice": "none", "response_format": FORMAT})
    assert c == Constraint("json_schema", json.dumps(ANSWER))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_with_a_format_is_the_call(make_client: Callable[..., TestClient], tool_choice: Any,
                                                 tok: Tokenizer) -> None:
    c = requested(make_client, "/v1/chat/completions", {"messages": MSGS, "tools": [WEATHER],
                                                        "tool_choice": tool_choice, "response_format": FORMAT})
    assert c is not None and c.kind == "lark"
    assert accepts(tok, c.source, CALL) and not accepts(tok, c.source, JSON_ANSWER)


def test_a_forced_call_still_needs_a_valid_format(make_client: Callable[..., TestClient]) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    r = make_client(eng=FakeEngine(max_model_len=4096)).post(
        "/v1/chat/completions", headers=auth(),
        json={"model": "fake-model", "messages": MSGS, "tools": [WEATHER], "tool_choice": "required",
              "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"


def test_the_responses_api_holds_text_format_and_tools_the_same(make_client: Callable[..., TestClient]) -> None:
    flat = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}
    c = requested(make_client, "/v1/responses", {"input": "Weather in Paris?", "tools": [flat], "text": fmt})
    assert c is not None and c.source == calls_or_answer_grammar(
        [WEATHER], embedded_schema(Constraint("json_schema", json.dumps(ANSWER))))
    c = requested(make_client, "/v1/responses", {"input": "Weather in Paris?", "tools": [flat], "text": fmt,
                                                 "tool_choice": "none"})
    assert c == Constraint("json_schema", json.dumps(ANSWER))
    c = requested(make_client, "/v1/responses", {"input": "Weather in Paris?", "tools": [flat], "text": fmt,
                                                 "tool_choice": {"type": "function", "name": "get_weather"}})
    assert c is not None and c.kind == "lark" and "answer" not in c.source
