"""Tool calls through the whole server on a tiny random model (tests/hybrid/tiny.py) whose chat
template renders `tools` natively, Qwen/Hermes style: the native path (no fallback system message),
forced calls valid against the schema, and the parser's edge cases (text before and after a call,
invalid JSON, an unclosed tag, a call cut by max_tokens) on text the engine generated token by token
(one byte per token here, so tags arrive split across stream chunks), streamed and not.

A random model writes no call syntax of its own, so where a test needs exact text the forced-call
grammar is replaced by one that only accepts that text (`force_text`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from prefixserve.engine import build_engine
from prefixserve.models.tokenizer import load_tokenizer_folder
from prefixserve.server.app import create_app
from prefixserve.server.openai import tools
from prefixserve.server.openai.chat import fallback_messages
from tests.hybrid.tiny import make_model

pytestmark = pytest.mark.slow

KEY = "sk-tiny-tools"
CH = "/v1/chat/completions"
# The Qwen2.5 template's tool parts, shortened: tools in the system turn, calls and results in Hermes tags;
# a call written as Qwen2.5 writes it (`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a function with <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}{% if not (loop.first and m['role'] == 'system') %}"
    "{%- if m['role'] == 'assistant' and m.tool_calls %}<|im_start|>assistant{% if m['content'] %}{{ '\\n' + m['content'] }}"
    "{% endif %}{% for tc in m.tool_calls %}{{ '\\n<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{{ tc.function.arguments | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}]
FORCE_ADD: dict[str, Any] = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny-hermes"))
    make_model(path, layers=4, seed=17)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def client(folder: str) -> Iterator[TestClient]:
    engine = build_engine(ModelConfig(path=folder, dtype="fp32", num_threads=1, served_model_name="tiny"),
                          CacheConfig(max_bytes=1 << 28), EngineConfig())
    with TestClient(create_app(engine, ServerConfig(api_keys=(KEY,)))) as c:
        yield c


def post(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(CH, json={"model": "tiny", "temperature": 0, **body}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream(client: TestClient, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str]:
    """(content, tool calls assembled from the deltas as the openai client does, finish_reason, chunks)."""
    r = client.post(CH, json={"model": "tiny", "temperature": 0, "stream": True, **body},
                    headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    content, calls, reason = "", {}, ""
    for chunk in chunks:
        for ch in chunk["choices"]:
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
                call["name"] += tc.get("function", {}).get("name") or ""
                call["arguments"] += tc.get("function", {}).get("arguments") or ""
            reason = ch["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


def force_text(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """The forced-call grammar becomes one that accepts exactly `text` (a JSON string is a Lark string)."""
    monkeypatch.setattr(tools, "call_grammar", lambda tool_list, name: f"start: {json.dumps(text)}\n")


def test_a_template_with_tools_renders_them_natively(client: TestClient, folder: str) -> None:
    tok = load_tokenizer_folder(folder)
    native = tok.render_chat(ASK, [ADD])
    assert native != tok.render_chat(ASK) and '<tools>\n{"type": "function"' in tok.decode(native)
    assert native != tok.render_chat(fallback_messages(ASK, [ADD]))
    r = post(client, {"messages": ASK, "tools": [ADD], "max_tokens": 1})
    assert r["usage"]["prompt_tokens"] == len(native)  # the template's own rendering, not the fallback


def test_a_forced_call_from_a_random_model_matches_the_schema_streamed_and_not(client: TestClient) -> None:
    body = {"messages": ASK, "tools": [ADD], "tool_choice": FORCE_ADD, "max_tokens": 200}
    r = post(client, body)
    choice = r["choices"][0]
    [call] = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "add"
    assert set(args) == {"a", "b"} and all(type(v) is int for v in args.values())
    content, calls, reason = stream(client, body)
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", call["function"]["arguments"])]
    assert calls[0]["id"].startswith("call_")
    # max_tokens cutting the call: never call syntax in the content; once its name is written, the
    # call with the arguments so far and finish_reason length (as OpenAI), streamed and not
    cut = post(client, {**body, "max_tokens": 12})["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"] is None
    assert not cut["message"]["content"]
    whole = call["function"]["arguments"]
    cut = post(client, {**body, "max_tokens": 44})["choices"][0]
    [partial] = cut["message"]["tool_calls"]
    assert cut["finish_reason"] == "length" and partial["function"]["name"] == "add" and not cut["message"]["content"]
    assert 0 < len(partial["function"]["arguments"]) < len(whole) and whole.startswith(partial["function"]["arguments"])
    content, calls, reason = stream(client, {**body, "max_tokens": 44})
    assert reason == "length" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", partial["function"]["arguments"])]


def test_auto_on_a_random_model_is_plain_content(client: TestClient) -> None:
    body = {"messages": ASK, "tools": [ADD], "tool_choice": "auto", "max_tokens": 24}
    choice = post(client, body)["choices"][0]
    assert choice["message"]["tool_calls"] is None and choice["finish_reason"] in ("stop", "length")
    content, calls, reason = stream(client, body)
    assert calls == [] and (content, reason) == (choice["message"]["content"], choice["finish_reason"])


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
EDGES = [  # generated text -> (content, calls): the parser on what the engine produced
    ("Let me add. " + CALL + " Done.", "Let me add.  Done.", [("add", {"a": 2, "b": 3})]),
    (CALL + CALL.replace("2", "7"), None, [("add", {"a": 2, "b": 3}), ("add", {"a": 7, "b": 3})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}', None, [("add", {"a": 2, "b": 3})]),  # unclosed
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"name": "sub", "arguments": {}}</tool_call>', '<tool_call>{"name": "sub", "arguments": {}}</tool_call>',
     []),  # an unknown function
    ('<tool_call>{"name": "add", "argu', '<tool_call>{"name": "add", "argu', []),  # unclosed and cut
    ("<tool_c no tag", "<tool_c no tag", []),
]


@pytest.mark.parametrize(("text", "content", "expected"), EDGES, ids=[str(i) for i in range(len(EDGES))])
def test_parser_edge_cases_on_generated_text(client: TestClient, monkeypatch: pytest.MonkeyPatch, text: str,
                                            content: str | None, expected: list[tuple[str, dict]]) -> None:
    force_text(monkeypatch, text)
    body = {"messages": ASK, "tools": [ADD], "tool_choice": "required", "max_tokens": 200}
    r = post(client, body)
    assert r["usage"]["completion_tokens"] >= len(text.encode())  # one token per byte: generated, not echoed
    choice = r["choices"][0]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"] or []]
    assert (choice["message"]["content"], got) == (content, expected)
    assert choice["finish_reason"] == ("tool_calls" if expected else "stop")
    s_content, s_calls, reason = stream(client, body)
    assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == expected and reason == choice["finish_reason"]
    assert s_content.strip() == (content or "")
    if expected:  # each choice's calls are indexed from 0 and carry their ids
        assert [c["id"][:5] for c in s_calls] == ["call_"] * len(expected)


def test_a_multi_turn_exchange_renders_natively_and_hits_the_cache(client: TestClient) -> None:
    """The forced call is written in the form the template writes calls back in, so the next turn's
    cache hit covers turn 1's prompt and its whole call (one token a byte here: the same text is the
    same tokens; the finished turn is cached through its last token)."""
    first = post(client, {"messages": ASK, "tools": [ADD], "tool_choice": FORCE_ADD, "max_tokens": 200})
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    second = post(client, {"messages": history, "tools": [ADD], "max_tokens": 4})
    turn = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= turn
    third = post(client, {"messages": [*history, {"role": "assistant", "content": "It is 5."},
                                       {"role": "user", "content": "And 4 and 4?"}], "tools": [ADD], "max_tokens": 4})
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= second["usage"]["prompt_tokens"]


def test_parallel_tool_calls_false_keeps_the_first_call(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    force_text(monkeypatch, CALL + CALL.replace("2", "7"))
    body = {"messages": ASK, "tools": [ADD], "tool_choice": "required", "max_tokens": 200, "parallel_tool_calls": False}
    calls = post(client, body)["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 2, "b": 3}]
    assert [json.loads(c["arguments"]) for c in stream(client, body)[1]] == [{"a": 2, "b": 3}]


def test_stop_strings_end_the_text_and_never_cut_a_call(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """QA: `stop: ["\\n"]` (or any string inside the call) with a forced call returned the call's
    first characters as content and no call. A stop string ends the reply's text; inside
    <tool_call>...</tool_call> it does not match (engine/detok.py), streamed and not."""
    body = {"messages": ASK, "tools": [ADD], "tool_choice": FORCE_ADD, "max_tokens": 200}
    whole = post(client, body)["choices"][0]["message"]["tool_calls"][0]["function"]
    for stop in (["\n"], ["\"a\"", "}", "tool", "<"]):
        choice = post(client, {**body, "stop": stop})["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, stop
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [whole]
        content, calls, reason = stream(client, {**body, "stop": stop})
        assert (content, reason) == ("", "tool_calls") and [(c["name"], c["arguments"]) for c in calls] == [
            (whole["name"], whole["arguments"])]
    force_text(monkeypatch, "Let me add.\n" + CALL + "\nDone.\nAnd more.")
    body = {**body, "tool_choice": "required", "stop": ["\n", "Done"]}
    choice = post(client, body)["choices"][0]
    assert choice["message"]["content"] == "Let me add." and choice["message"]["tool_calls"] is None
    force_text(monkeypatch, "Let me add. " + CALL + " Done.\nAnd more.")
    choice = post(client, body)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Let me add.", "tool_calls")
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"a": 2, "b": 3}]
    content, calls, reason = stream(client, body)
    assert (content.strip(), reason, len(calls)) == ("Let me add.", "tool_calls", 1)
    # with tool_choice none nothing is parsed: a stop string stops wherever it is
    choice = post(client, {**body, "tool_choice": "none", "stop": ["\"a\""]})["choices"][0]
    assert choice["message"]["tool_calls"] is None


def test_only_the_schemas_a_forced_call_is_held_to_must_compile(client: TestClient) -> None:
    """QA: a tool whose schema has a keyword the grammar lacks (`uniqueItems`, common in MCP tool
    sets) made every request with it a 400, even under auto or none, or forcing another tool,
    where nothing is constrained by it. Now only the schemas a forced call's grammar holds the
    reply to are compiled; OpenAI takes any schema of a tool that is not strict."""
    tags = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}
    for choice in ("auto", "none", FORCE_ADD):
        r = post(client, {"messages": ASK, "tools": [ADD, tags], "tool_choice": choice, "max_tokens": 2})
        assert r["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), choice
    for choice in ("required", {"type": "function", "function": {"name": "tag"}}):
        r = client.post(CH, json={"model": "tiny", "messages": ASK, "tools": [ADD, tags], "tool_choice": choice,
                                  "max_tokens": 2}, headers={"Authorization": f"Bearer {KEY}"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools[1].function.parameters", err
        assert "uniqueItems" in err["message"]


OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
OK_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": OK_SCHEMA}}


def test_auto_with_a_response_format_is_a_call_or_the_formats_json(client: TestClient, folder: str) -> None:
    """Under auto a response_format holds the reply to calls or its JSON, and the model's first token
    chooses (one byte a token here: a bias on `<` makes this random model open a call, on `{` the
    JSON; neither appears anywhere else in either form). A call comes back as tool_calls with
    finish_reason tool_calls, the JSON as content, streamed and not."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    [lt], [brace] = hf.encode("<", add_special_tokens=False), hf.encode("{", add_special_tokens=False)
    body = {"messages": ASK, "tools": [ADD], "response_format": OK_FORMAT, "parallel_tool_calls": False,
            "max_tokens": 200}
    call = post(client, {**body, "logit_bias": {str(lt): 100}})["choices"][0]
    [made] = call["message"]["tool_calls"]
    args = json.loads(made["function"]["arguments"])
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
    assert made["function"]["name"] == "add" and set(args) == {"a", "b"} and all(type(v) is int for v in args.values())
    content, calls, reason = stream(client, {**body, "logit_bias": {str(lt): 100}})
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", made["function"]["arguments"])]
    answer = post(client, {**body, "logit_bias": {str(brace): 100}})["choices"][0]
    assert answer["finish_reason"] == "stop" and answer["message"]["tool_calls"] is None
    assert set(json.loads(answer["message"]["content"])) == {"ok"}
    content, calls, reason = stream(client, {**body, "logit_bias": {str(brace): 100}})
    assert (content, calls, reason) == (answer["message"]["content"], [], "stop")
    # unsteered, whatever the model writes is one of the two
    free = post(client, {**body, "parallel_tool_calls": True})["choices"][0]
    if free["message"]["tool_calls"]:
        assert free["finish_reason"] == "tool_calls" and free["message"]["content"] is None
        assert {c["function"]["name"] for c in free["message"]["tool_calls"]} == {"add"}
    else:
        assert free["finish_reason"] == "stop" and set(json.loads(free["message"]["content"])) == {"ok"}


def test_forced_or_none_with_a_response_format_on_a_random_model(client: TestClient) -> None:
    """required or a named function with a response_format: the call (the format does not keep the
    model from it); none: the format's JSON, never a call."""
    for choice in ("required", FORCE_ADD):
        r = post(client, {"messages": ASK, "tools": [ADD], "tool_choice": choice, "response_format": OK_FORMAT,
                          "max_tokens": 200})["choices"][0]
        assert r["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in r["message"]["tool_calls"]] == [
            "add"]
    r = post(client, {"messages": ASK, "tools": [ADD], "tool_choice": "none", "response_format": OK_FORMAT,
                      "max_tokens": 200})["choices"][0]
    assert r["message"]["tool_calls"] is None and set(json.loads(r["message"]["content"])) == {"ok"}


def responses_output(client: TestClient, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """/v1/responses' output items, whole and as the streamed response.completed event carries them."""
    headers = {"Authorization": f"Bearer {KEY}"}
    r = client.post("/v1/responses", json={"model": "tiny", "temperature": 0, **body}, headers=headers)
    assert r.status_code == 200, r.text
    s = client.post("/v1/responses", json={"model": "tiny", "temperature": 0, "stream": True, **body}, headers=headers)
    assert s.status_code == 200, s.text
    events = [json.loads(line[6:]) for line in s.text.split("\n") if line.startswith("data: {")]
    [done] = [e for e in events if e["type"] == "response.completed"]
    return r.json()["output"], done["response"]["output"]


def test_the_responses_api_with_tools_and_a_text_format(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """text.format + tools under auto: the reply is a function_call item or a message holding the
    format's JSON, streamed and not (the grammar is replaced by one accepting one text, as `force_text`)."""
    flat = {"type": "function", **ADD["function"]}
    body = {"input": "Add 2 and 3.", "tools": [flat], "max_output_tokens": 200,
            "text": {"format": {"type": "json_schema", "name": "verdict", "schema": OK_SCHEMA}}}
    real = tools.calls_or_answer_grammar
    chosen: list[str] = []
    for text in (tools.call_text("add", '{"a": 2, "b": 3}'), '{"ok":true}'):
        monkeypatch.setattr(tools, "calls_or_answer_grammar",
                            lambda *a, _t=text, **k: chosen.append(real(*a, **k)) or f"start: {json.dumps(_t)}\n")
        for out in responses_output(client, body):
            if text.startswith(tools.OPEN):
                assert [(o["type"], o["name"], o["arguments"]) for o in out] == [
                    ("function_call", "add", '{"a": 2, "b": 3}')]
            else:
                assert [o["type"] for o in out] == ["message"] and out[0]["content"][0]["text"] == text
    assert chosen and all("start: calls | answer" in g for g in chosen)  # the request took the auto-with-format path
