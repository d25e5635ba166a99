"""Every bad input gets an OpenAI-shaped 4xx naming the problem, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.engine.protocol import Overloaded, PromptTooLong, Unavailable
from prefixserve.types import Request
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import ADMIN, auth

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
C, CH = "/v1/completions", "/v1/chat/completions"

# (endpoint, raw body or JSON object, expected status, expected param)
BAD: list[tuple[str, Any, int, str | None]] = [
    (C, b"{not json", 400, None),
    (C, b'{"prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
    (C, b"", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b'{"prompt": "a\\ud800"}', 400, "prompt"),  # lone surrogate
    (C, {"max_tokens": 3}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ["a"] * 17}, 400, "prompt"),
    (C, {"prompt": ["a", "b"], "best_of": 2}, 400, "best_of"),
    (C, {"prompt": ["a", ""]}, 400, "prompt"),
    (C, {"prompt": [[1, 2], []]}, 400, "prompt"),
    (C, {"prompt": [1, "a"]}, 400, "prompt"),
    (C, {"prompt": [1, True]}, 400, "prompt"),
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"prompt": [10**9]}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": "x" * 600}, 400, "prompt"),  # longer than the context (512)
    (C, {"prompt": "p", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "p", "max_tokens": -5}, 400, "max_tokens"),
    (C, {"prompt": "p", "max_tokens": 10**12}, 400, "max_tokens"),
    (C, {"prompt": "p", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "p", "max_tokens": 2.5}, 400, "max_tokens"),
    (C, {"prompt": "p", "temperature": -0.1}, 400, "temperature"),
    (C, {"prompt": "p", "temperature": 2.5}, 400, "temperature"),
    (C, {"prompt": "p", "temperature": "hot"}, 400, "temperature"),
    (C, b'{"prompt": "p", "temperature": NaN}', 400, "temperature"),
    (C, {"prompt": "p", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "p", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "p", "top_k": -2}, 400, "top_k"),
    (C, {"prompt": "p", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "p", "seed": "1"}, 400, "seed"),
    (C, {"prompt": "p", "stop": 5}, 400, "stop"),
    (C, {"prompt": "p", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "p", "stop": ["s"] * 17}, 400, "stop"),
    (C, {"prompt": "p", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "p", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (
        C,
        {"prompt": "p", "stream": True, "stream_options": {"include_usage": "y"}},
        400,
        "stream_options.include_usage",
    ),
    (C, {"prompt": "p", "n": 0}, 400, "n"),
    (C, {"prompt": "p", "n": 17}, 400, "n"),
    (C, {"prompt": "p", "n": 3, "best_of": 2}, 400, "best_of"),
    (C, {"prompt": "p", "best_of": 3, "stream": True}, 400, "best_of"),
    (C, {"prompt": "p", "logprobs": 6}, 400, "logprobs"),
    (C, {"prompt": "p", "logprobs": -1}, 400, "logprobs"),
    (C, {"prompt": "p", "logprobs": True}, 400, "logprobs"),
    (C, {"prompt": "p", "max_tokens": 0, "echo": True, "best_of": 2}, 400, "n"),
    (C, {"prompt": "p", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    (C, {"prompt": "p", "suffix": "end"}, 400, "suffix"),
    (C, {"prompt": "p", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "p", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "p", "logit_bias": {"50": 101}}, 400, "logit_bias"),
    (C, {"prompt": "p", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "p", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    (C, {"prompt": "p", "logit_bias": {"5": "x"}}, 400, "logit_bias"),
    (C, {"prompt": "p", "model": "gpt-4"}, 404, "model"),
    (C, {"prompt": "p", "model": 7}, 400, "model"),
    (C, {"prompt": "p", "cache_salt": ""}, 400, "cache_salt"),
    (C, {"prompt": "p", "cache_salt": 123}, 400, "cache_salt"),
    (C, {"prompt": "p", "cache_salt": "s" * 257}, 400, "cache_salt"),
    (C, {"prompt": "p", "cache_salt": ["a"]}, 400, "cache_salt"),
    (C, {"prompt": "p", "user": 12}, 400, "user"),
    (CH, {}, 400, "messages"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": "hi"}, 400, "messages"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CH, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CH, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        CH,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
    (CH, {"messages": [{"role": "user", "content": ["hi"]}]}, 400, "messages[0].content[0]"),
    (CH, {"messages": [{"role": "tool", "content": "r"}]}, 400, "messages[0].tool_call_id"),
    # QA: a tool result answering no call was accepted (the Responses API refused it, as OpenAI does)
    (CH, {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "zzz", "content": "r"}]},
     400, "messages[1].role"),
    (CH, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "tool", "tool_call_id": "zzz", "content": "r"}]}, 400, "messages[3].tool_call_id"),
    (CH, {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
    (
        CH,
        {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
        400,
        "messages[0].tool_calls",
    ),
    (CH, {"messages": [{"role": "user", "content": "RAISE_TEMPLATE_ERROR"}]}, 400, "messages"),
    (CH, {"messages": MSGS, "tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
    (CH, {"messages": MSGS, "tools": [{"type": "function", "function": {}}]}, 400, "tools[0].function.name"),
    (CH, {"messages": MSGS, "tools": "all"}, 400, "tools"),
    (CH, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools[0].function.name"),
    (CH, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "get weather"}}]},
     400, "tools[0].function.name"),
    (CH, {"messages": MSGS, "tools": TOOLS + [{"type": "function", "function": {"name": "f" * 65}}]},
     400, "tools[1].function.name"),
    (CH, {"messages": MSGS, "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
    (CH, {"messages": MSGS, "n": 0}, 400, "n"),
    (CH, {"messages": MSGS, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (CH, {"messages": MSGS, "logit_bias": {"5": -101}}, 400, "logit_bias"),
    (CH, {"messages": MSGS, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     400, "response_format.json_schema.strict"),
    (CH, {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice"),
    (CH, {"messages": MSGS, "tool_choice": "sometimes", "tools": TOOLS}, 400, "tool_choice"),
    (CH, {"messages": MSGS, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "tool_choice"),
    (CH, {"messages": MSGS, "tools": TOOLS, "tool_choice": {"type": "function"}}, 400, "tool_choice"),
    (CH, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     400, "tools[0].function.parameters"),
    (CH, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     400, "tools[0].function.parameters"),
    (CH, {"messages": MSGS, "tools": TOOLS + TOOLS}, 400, "tools"),
    (CH, {"messages": MSGS, "logprobs": "yes"}, 400, "logprobs"),
    (CH, {"messages": MSGS, "top_logprobs": 3}, 400, "top_logprobs"),
    (CH, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CH, {"messages": MSGS, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    (CH, {"messages": MSGS, "response_format": {"type": "yaml"}}, 400, "response_format"),
    (C, {"prompt": "p", "response_format": {"type": "yaml"}}, 400, "response_format"),
    (C, {"prompt": "p", "response_format": "json"}, 400, "response_format"),
    (CH, {"messages": MSGS, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    (CH, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     400, "response_format.json_schema.schema"),
    (CH, {"messages": MSGS, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     400, "response_format.json_schema.schema"),
    (CH, {"messages": MSGS, "functions": [{"name": "f"}]}, 400, "functions"),
    (CH, {"messages": MSGS, "modalities": ["text", "audio"]}, 400, "modalities"),  # text is all it answers in
    (CH, {"messages": MSGS, "modalities": "text"}, 400, "modalities"),
    (CH, {"messages": MSGS, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    (CH, {"messages": MSGS, "metadata": {"k": 1}}, 400, "metadata"),  # OpenAI's: string values
    (CH, {"messages": MSGS, "metadata": ["k"]}, 400, "metadata"),
    (CH, {"messages": MSGS, "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    (CH, {"messages": MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens"),  # the field it was set by
    (CH, {"messages": MSGS, "max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, 400,
     "messages[0].content[0].type"),  # only an assistant's text may be a refusal
    (CH, {"messages": MSGS, "n": 17}, 400, "n"),
    (CH, {"messages": MSGS, "n": -1}, 400, "n"),
    (CH, {"messages": MSGS, "cache_salt": ""}, 400, "cache_salt"),
    (CH, {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),  # the field the prompt came from
    (C, {"prompt": "x" * 600}, 400, "prompt"),
    (CH, {"messages": MSGS, "reasoning_effort": "low"}, 400, "reasoning_effort"),  # OpenAI fields we do not act on
    (CH, {"messages": MSGS, "prediction": {"type": "content", "content": "Hello"}}, 400, "prediction"),
    (CH, {"messages": MSGS, "web_search_options": {"search_context_size": "low"}}, 400, "web_search_options"),
]


def _post(client: TestClient, path: str, body: Any) -> Any:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={**auth(), "Content-Type": "application/json"})
    return client.post(path, json=body, headers=auth())


def check_error(r: Any, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_an_openai_4xx_then_good_request_works(
    client: TestClient, engine: FakeEngine, path: str, body: Any, status: int, param: str | None
) -> None:
    check_error(_post(client, path, body), status, param)
    assert engine.requests == []  # nothing reached the engine
    good = {"prompt": "ok", "max_tokens": 2} if path == C else {"messages": MSGS, "max_tokens": 2}
    r = client.post(path, json=good, headers=auth())
    assert r.status_code == 200, r.text


def test_text_modalities_and_metadata_within_openais_bounds_are_accepted(client: TestClient) -> None:
    body = {"messages": MSGS, "max_tokens": 2, "modalities": ["text"], "metadata": {"k": "v"}}
    assert client.post(CH, json=body, headers=auth()).status_code == 200
    for unused in ({"reasoning_effort": None}, {"web_search_options": {}}, {"prediction": None}):  # nothing asked for
        assert client.post(CH, json={**body, **unused}, headers=auth()).status_code == 200, unused


def test_a_streaming_bad_request_is_still_a_plain_400(client: TestClient) -> None:
    r = client.post(C, json={"prompt": "p", "stream": True, "n": 0}, headers=auth())
    check_error(r, 400, "n")
    assert r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize(("body", "param", "code"), [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", "\\ud800"),
    (b'{"messages": [{"role": "user", "content": "ok \\ud83d\\ude00 \\udc00"}]}', "messages[0].content", "\\udc00"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"\\udfff": 1}}', "metadata", "\\udfff"),
])
def test_a_lone_surrogate_escape_is_named_as_one(client: TestClient, body: bytes, param: str, code: str) -> None:
    """JSON can write half a UTF-16 pair as a \\u escape; pydantic's parser then says "unexpected end
    of hex escape": the 400 says what is wrong, and where."""
    r = _post(client, CH, body)
    check_error(r, 400, param)
    assert r.json()["error"]["message"] == (f"{param}: the string contains an invalid \\u escape: {code} is a "
                                            "lone surrogate (half of a UTF-16 pair), not a character")


def test_oversized_body_is_413(client: TestClient) -> None:
    r = client.post(C, content=b"x" * ((16 << 20) + 1), headers=auth())
    assert r.status_code == 413 and "error" in r.json()


class TooLongEngine(FakeEngine):
    async def generate(self, request: Request):  # type: ignore[override]
        raise PromptTooLong("the engine says the prompt does not fit")
        yield  # pragma: no cover


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "param"), [(C, {"prompt": "p"}, "prompt"), (CH, {"messages": MSGS}, "messages"),
                                                     ("/v1/responses", {"input": "p"}, "input")])
def test_prompt_too_long_from_the_engine_is_400(make_client: Any, stream: bool, path: str, body: dict[str, Any],
                                                param: str) -> None:
    """Named as the client sent the prompt: chat's `messages`, Responses' `input` (was `prompt` everywhere)."""
    eng = TooLongEngine()
    client = make_client(eng=eng)
    r = client.post(path, json={**body, "stream": stream}, headers=auth())
    check_error(r, 400, param)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "prefixserve_requests_in_flight 0.0" in client.get("/metrics", headers=auth(ADMIN)).text


class BusyEngine(FakeEngine):
    def __init__(self, exc: Exception) -> None:
        super().__init__()
        self.exc = exc

    async def generate(self, request: Request):  # type: ignore[override]
        raise self.exc
        yield  # pragma: no cover


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_queue_is_429_with_retry_after_and_a_stopped_engine_503(make_client: Any, stream: bool) -> None:
    client = make_client(eng=BusyEngine(Overloaded("too many requests are waiting (256)", retry_after_s=2)))
    r = client.post(C, json={"prompt": "p", "stream": stream}, headers=auth())
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and "waiting" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "requests"  # OpenAI's type for a request rate limit
    client = make_client(eng=BusyEngine(Unavailable("the server is shutting down")))
    r = client.post(C, json={"prompt": "p", "stream": stream}, headers=auth())
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert "prefixserve_requests_in_flight 0.0" in client.get("/metrics", headers=auth(ADMIN)).text


def test_engine_failure_is_a_shaped_500_non_streaming_and_an_error_event_streaming(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.fail_with = "boom"
    r = client.post(C, json={"prompt": "p"}, headers=auth())
    assert (
        r.status_code == 500
        and r.json()["error"]["type"] == "server_error"
        and "boom" in r.json()["error"]["message"]
    )
    r = client.post(C, json={"prompt": "p", "stream": True}, headers=auth())
    assert r.status_code == 200
    assert '"error":{"message":"boom","type":"server_error"' in r.text and r.text.endswith("data: [DONE]\n\n")
    engine.fail_with = None
    assert client.post(C, json={"prompt": "p"}, headers=auth()).status_code == 200


def test_at_least_25_distinct_bad_inputs() -> None:
    assert len(BAD) >= 25
