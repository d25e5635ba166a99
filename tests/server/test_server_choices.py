"""Response shapes of n > 1, logprobs, echo, best_of and system_fingerprint (fake engine: each choice
replays the prompt's bytes, and every token's logprob is -0.5, its k alternatives -0.5, -1.5, ...)."""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi.testclient import TestClient

from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import auth

C, CH = "/v1/completions", "/v1/chat/completions"


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


def test_completion_n_choices_count_the_prompt_once(client: TestClient) -> None:
    r = client.post(C, json={"prompt": "ab", "max_tokens": 3, "n": 3}, headers=auth())
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["aba"] * 3
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 9
    assert body["system_fingerprint"] == "fp_fake"


def test_chat_n_choices_stream_with_indexes(client: TestClient) -> None:
    r = client.post(CH, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2,
                              "stream": True, "stream_options": {"include_usage": True}}, headers=auth())
    chunks = sse(r.text)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [(0, "length"), (1, "length")]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []
    assert all(c["system_fingerprint"] == "fp_fake" for c in chunks)


def test_chat_logprobs_shape(client: TestClient) -> None:
    r = client.post(CH, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True,
                              "top_logprobs": 2}, headers=auth())
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["refusal"] is None and len(lp["content"]) == 2
    first = lp["content"][0]
    assert first == {"token": "<", "logprob": -0.5, "bytes": [60],
                     "top_logprobs": [{"token": "<", "logprob": -0.5, "bytes": [60]},
                                      {"token": "=", "logprob": -1.5, "bytes": [61]}]}
    r = client.post(CH, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True,
                              "stream": True}, headers=auth())
    entries = [e for c in sse(r.text) if c["choices"] and c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert [(e["token"], e["top_logprobs"]) for e in entries] == [("<", []), ("u", [])]


def test_completion_logprobs_and_echo(client: TestClient) -> None:
    r = client.post(C, json={"prompt": "ab", "max_tokens": 3, "logprobs": 1}, headers=auth())
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {"tokens": ["a", "b", "a"], "token_logprobs": [-0.5, -0.5, -0.5],
                  "top_logprobs": [{"a": -0.5}, {"b": -0.5}, {"a": -0.5}], "text_offset": [0, 1, 2]}
    r = client.post(C, json={"prompt": "ab", "max_tokens": 2, "echo": True}, headers=auth())
    assert r.json()["choices"][0]["text"] == "abab"
    r = client.post(C, json={"prompt": "ab", "max_tokens": 2, "echo": True, "stream": True}, headers=auth())
    assert "".join(c["choices"][0]["text"] for c in sse(r.text) if c["choices"]) == "abab"


def test_echo_with_logprobs_leads_each_choice_with_its_prompt(client: TestClient) -> None:
    """OpenAI's legacy shape: the prompt's tokens first (the first with null logprob and top_logprobs),
    then the completion's, text offsets running through the echoed text; per prompt of a list."""
    body = {"prompt": ["ab", "xyz"], "max_tokens": 1, "echo": True, "logprobs": 1, "n": 2}
    choices = client.post(C, json=body, headers=auth()).json()["choices"]
    assert [(c["index"], c["text"]) for c in choices] == [(0, "aba"), (1, "aba"), (2, "xyzx"), (3, "xyzx")]
    assert choices[0]["logprobs"] == {
        "tokens": ["a", "b", "a"], "token_logprobs": [None, -1.0, -0.5],
        "top_logprobs": [None, {"b": -1.0}, {"a": -0.5}], "text_offset": [0, 1, 2]}
    assert choices[3]["logprobs"]["tokens"] == ["x", "y", "z", "x"]
    assert choices[3]["logprobs"]["token_logprobs"] == [None, -1.0, -1.0, -0.5]
    assert choices[3]["logprobs"]["text_offset"] == [0, 1, 2, 3]
    r = client.post(C, json={**body, "stream": True}, headers=auth())
    by_index: dict[int, list[dict]] = {}
    for c in sse(r.text):
        if c["choices"]:
            by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    for i, streamed in by_index.items():
        assert "".join(c["text"] for c in streamed) == choices[i]["text"]
        assert streamed[0]["text"] == ("ab" if i < 2 else "xyz")  # the echo goes out with its logprobs
        assert [t for c in streamed if c["logprobs"] for t in c["logprobs"]["tokens"]] == choices[i]["logprobs"]["tokens"]
        assert [o for c in streamed if c["logprobs"] for o in c["logprobs"]["text_offset"]] == \
            choices[i]["logprobs"]["text_offset"]


def test_echo_with_max_tokens_0_is_the_prompt_alone(client: TestClient) -> None:
    r = client.post(C, json={"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 0}, headers=auth())
    body = r.json()
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 3
    r = client.post(C, json={"prompt": "abc", "max_tokens": 0, "echo": True, "stream": True}, headers=auth())
    chunks = [c["choices"][0] for c in sse(r.text) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == "abc" and chunks[-1]["finish_reason"] == "length"


def test_echo_scores_a_prompt_as_long_as_the_context(client: TestClient, engine: FakeEngine) -> None:
    """Evaluation harnesses score windows of exactly the context's length (echo, max_tokens 0)."""
    whole = [5 + k % 200 for k in range(engine.max_model_len)]
    r = client.post(C, json={"prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 0}, headers=auth())
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == engine.max_model_len, r.text
    for body in ({"prompt": whole, "max_tokens": 1, "echo": True}, {"prompt": [*whole, 5], "max_tokens": 0, "echo": True}):
        r = client.post(C, json=body, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_best_of_returns_n_choices(client: TestClient) -> None:
    r = client.post(C, json={"prompt": "ab", "max_tokens": 2, "n": 2, "best_of": 4}, headers=auth())
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 8  # all four were generated


def test_choices_past_the_session_slots_name_the_field_that_asked_for_them(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(eng=FakeEngine(max_num_seqs=3))
    r = client.post(C, json={"prompt": "ab", "max_tokens": 2, "n": 1, "best_of": 4}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    r = client.post(C, json={"prompt": "ab", "max_tokens": 2, "n": 4}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = client.post(C, json={"prompt": "ab", "max_tokens": 2, "n": 2, "best_of": 3}, headers=auth())
    assert r.status_code == 200, r.text


def test_unknown_model_is_404_model_not_found(client: TestClient) -> None:
    r = client.post(CH, json={"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}, headers=auth())
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tool_calls_in_a_reply_are_parsed_streamed_and_not(client: TestClient, engine: FakeEngine) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    messages = [{"role": "user", "content": call}]
    prompt_ids = engine.tokenizer.render_chat(messages, tools)
    prompt_len = len(prompt_ids)
    body = {"messages": messages, "tools": tools, "max_tokens": prompt_len}  # the fake replays the prompt
    r = client.post(CH, json=body, headers=auth()).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [tc] = choice["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert choice["message"]["content"] == engine.tokenizer.decode(prompt_ids).replace(call, "").strip()
    chunks = sse(client.post(CH, json={**body, "stream": True}, headers=auth()).text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert streamed[0]["function"] == {"name": "add", "arguments": ""} and streamed[0]["id"].startswith("call_")
    assert streamed[1] == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(d.get("content") or "" for d in deltas).strip() == choice["message"]["content"]
    body["parallel_tool_calls"] = False
    assert client.post(CH, json=body, headers=auth()).json()["choices"][0]["finish_reason"] == "tool_calls"


def test_a_list_of_prompts_gives_each_its_choices_and_sums_usage(client: TestClient) -> None:
    body = {"prompt": ["ab", "xyz"], "max_tokens": 2, "n": 2}
    r = client.post(C, json=body, headers=auth()).json()
    assert [(c["index"], c["text"]) for c in r["choices"]] == [(0, "ab"), (1, "ab"), (2, "xy"), (3, "xy")]
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (5, 8)
    chunks = sse(client.post(C, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                             headers=auth()).text)
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert texts == {0: "ab", 1: "ab", 2: "xy", 3: "xy"} and chunks[-1]["usage"]["total_tokens"] == 13
