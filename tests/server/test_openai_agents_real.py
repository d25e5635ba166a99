"""The surface agents use, end to end: a real `prefixserve serve` process with the embedded model,
driven by the official `openai` client and by the OpenAI Agents SDK (`openai-agents`).

The embedded model's tool calling is weak, so tool calls are forced (tool_choice) where a test needs
one; what is tested is the protocol: the call's shape, its arguments valid against the schema, the
round trip with a `role: tool` result, and the cache hit on the shared history.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.helpers.server_proc import ServerProcess, server_fixture

pytestmark = pytest.mark.slow

KEY = "sk-agents-a-111"
server = server_fixture(["--api-key", KEY, "--no-ledger"], scope="module")
dense = server_fixture(["--api-key", KEY, "--no-ledger", "--decode-kernel", "dense"], scope="module")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris?"}]


def client(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=srv.openai_url, api_key=KEY, max_retries=0, timeout=300)


def model_id(srv: ServerProcess) -> str:
    return client(srv).models.list().data[0].id


def test_n_choices_with_a_seed_are_reproducible(server: ServerProcess) -> None:
    c, m = client(server), model_id(server)
    kw: dict[str, Any] = {"model": m, "messages": ASK, "max_tokens": 5, "n": 4, "seed": 11, "temperature": 1.0}
    a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2, 3]
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]
    assert a.usage is not None and b.usage is not None and b.usage.prompt_tokens_details is not None
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # counted once, not 4 times
    assert a.usage.completion_tokens == 20  # 4 choices x 5 tokens (unless one stops early)
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens  # the whole prompt hit
    assert a.system_fingerprint and a.system_fingerprint == b.system_fingerprint


def test_top_logprobs_under_greedy_lead_with_the_sampled_token(server: ServerProcess) -> None:
    r = client(server).chat.completions.create(model=model_id(server), messages=ASK, max_tokens=4,
                                               temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content


class City(BaseModel):
    name: str
    population: int
    coastal: bool


def test_parse_returns_a_pydantic_object(server: ServerProcess) -> None:
    r = client(server).chat.completions.parse(
        model=model_id(server), max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Describe the city of Lisbon as JSON."}], response_format=City)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and r.choices[0].finish_reason == "stop"
    r = client(server).chat.completions.create(
        model=model_id(server), max_tokens=60, temperature=0.8, seed=1, n=2,
        messages=[{"role": "user", "content": "Any JSON."}], response_format={"type": "json_object"})
    for ch in r.choices:  # a reply cut by max_tokens is cut JSON, as with OpenAI; else it parses
        assert ch.finish_reason == "length" or isinstance(json.loads(ch.message.content or ""), dict)
    # a raw completion too (vLLM's extension; QA: it was ignored and the text was not JSON)
    text = client(server).completions.create(
        model=model_id(server), prompt="Lisbon as JSON:", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": City.model_json_schema()}}})
    assert text.choices[0].finish_reason == "stop" and City.model_validate_json(text.choices[0].text)


def test_forced_tool_call_round_trip_streamed_and_not_hits_the_cache(server: ServerProcess) -> None:
    c, m = client(server), model_id(server)
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=m, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=40,
                                  temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    stream = c.chat.completions.create(model=m, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=40,
                                       temperature=0, stream=True)
    name, args, reasons = "", "", []
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                name += tc.function.name or "" if tc.function else ""
                args += tc.function.arguments or "" if tc.function else ""
            reasons.append(ch.finish_reason)
    assert (name, args) == ("get_weather", call.function.arguments) and reasons[-1] == "tool_calls"
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'}]
    final = c.chat.completions.create(model=m, messages=history, tools=[WEATHER], max_tokens=12, temperature=0)
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and final.usage is not None
    details = final.usage.prompt_tokens_details
    # the shared history was cached: the whole first prompt (the fallback renders it identically)
    assert details is not None and details.cached_tokens >= r.usage.prompt_tokens - 1
    text, reasons = "", []
    for chunk in c.chat.completions.create(model=m, messages=history, tools=[WEATHER], max_tokens=12,
                                           temperature=0, stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reasons.append(ch.finish_reason)
    assert (text, reasons[-1]) == (final.choices[0].message.content, final.choices[0].finish_reason)
    more = [*history, {"role": "assistant", "content": final.choices[0].message.content},
            {"role": "user", "content": "And in Rome?"}]
    later = c.chat.completions.create(model=m, messages=more, tools=[WEATHER], max_tokens=2, temperature=0)
    assert later.usage is not None and later.usage.prompt_tokens_details is not None
    assert later.usage.prompt_tokens_details.cached_tokens >= final.usage.prompt_tokens - 1  # turn 2's whole prompt


def test_required_tool_choice_and_unknown_model(server: ServerProcess) -> None:
    c, m = client(server), model_id(server)
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}
    r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Add 2 and 3."}],
                                  tools=[WEATHER, add], tool_choice="required", max_tokens=40, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name in ("get_weather", "add")
    args = json.loads(calls[0].function.arguments)
    assert set(args) == ({"city"} if calls[0].function.name == "get_weather" else {"a", "b"})
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-9", messages=ASK, max_tokens=2)
    assert isinstance(e.value.body, dict) and e.value.body.get("code") == "model_not_found"


def test_a_forced_call_echoed_back_renders_as_the_reply_and_hits_the_cache(dense: ServerProcess) -> None:
    """QA's case, on the fallback path (the embedded template drops tools): the client gets the model's
    own text of the arguments, and the call it echoes back renders as the characters the model wrote,
    so the next turn's cache hit reaches into the call as far as the model's tokens are the tokenizer's
    own encoding of that text. (Under the grammar the model may split the text otherwise, `"}` `}`
    where the tokenizer has `"` `}}`; the cache is keyed by token ids, so the hit stops there.) On the
    dense server a finished turn is cached as it ends; with 4-bit decode it is re-fed first, and the
    next turn may come before that, finish it and be billed for it as computed."""
    c, m = client(dense), model_id(dense)
    r = c.chat.completions.create(model=m, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=40,
                                  temperature=0, logprobs=True)
    assert r.choices[0].finish_reason == "tool_calls" and r.usage is not None and r.choices[0].logprobs
    content = r.choices[0].logprobs.content or []
    generated, reply = [e.token for e in content], b"".join(bytes(e.bytes or []) for e in content).decode()
    [call] = r.choices[0].message.tool_calls or []
    assert call.function.arguments in reply  # the model's own text of them, not a re-serialization
    echoed = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}]
    rendered = httpx.post(f"{dense.base_url}/tokenize", headers={"Authorization": f"Bearer {KEY}"}, json={
        "model": m, "messages": echoed, "tools": [WEATHER], "add_generation_prompt": False,
        "return_token_strs": True}).json()["token_strs"][r.usage.prompt_tokens:]
    assert "".join(rendered).startswith(reply + "<|im_end|>")  # the same characters
    same = next((i for i, (a, b) in enumerate(zip(generated, rendered)) if a != b), len(generated))
    history = [*echoed, {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'}]
    second = c.chat.completions.create(model=m, messages=history, tools=[WEATHER], max_tokens=2, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    covered = second.usage.prompt_tokens_details.cached_tokens  # the turn (its last token computed if its refill had not run)
    assert covered >= r.usage.prompt_tokens + min(same, len(generated) - 1), (covered, generated, rendered)


def test_the_responses_api_answers_as_chat_does_and_shares_its_cache(server: ServerProcess) -> None:
    """`client.responses.create` with instructions: the same greedy text as the chat request it means
    (the same prompt ids, so the chat request's cache entry serves it in full), usage in the Responses
    shape, and a streamed response that ends with the same text and usage."""
    c = client(server)
    system = "You are the librarian of the Prefix Harbour library. " * 6
    chat = c.chat.completions.create(model=model_id(server), messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "When do you open?"}],
        max_tokens=12, temperature=0)
    r = c.responses.create(model=model_id(server), instructions=system, input="When do you open?",
                           max_output_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.input_tokens_details.cached_tokens == r.usage.input_tokens  # the chat request seeded it
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    evs = list(c.responses.create(model=model_id(server), instructions=system, input="When do you open?",
                                  max_output_tokens=12, temperature=0, stream=True))
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    final = evs[-1].response  # response.completed, or response.incomplete when max_output_tokens cut it
    assert evs[-1].type == f"response.{r.status}"
    assert text == final.output_text == r.output_text
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == r.usage.input_tokens
    chat_lp = c.chat.completions.create(model=model_id(server), messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "When do you open?"}],
        max_tokens=12, temperature=0, logprobs=True, top_logprobs=2).choices[0].logprobs
    resp_lp = c.responses.create(model=model_id(server), instructions=system, input="When do you open?",
                                 max_output_tokens=12, temperature=0, include=["message.output_text.logprobs"],
                                 top_logprobs=2).output[0].content[0].logprobs
    assert chat_lp is not None and chat_lp.content is not None and resp_lp
    assert [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in resp_lp] == \
        [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in chat_lp.content]


def test_a_tool_round_trip_on_the_responses_api(server: ServerProcess) -> None:
    """A forced call comes back as a `function_call` item; sent back with its `function_call_output`,
    the next request reuses the whole first request from the cache."""
    c = client(server)
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": WEATHER["function"]["parameters"]}
    ask = {"model": model_id(server), "instructions": "You are a helpful assistant.", "tools": [tool],
           "max_output_tokens": 40, "temperature": 0}
    first = c.responses.create(input="What is the weather in Paris?", tool_choice="required", **ask)
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and clear"}]
    second = c.responses.create(input=history, **ask)  # tool_choice auto: the model may answer or call again
    assert second.output and second.status in ("completed", "incomplete")
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_previous_response_id_chains_a_conversation_through_the_cache(server: ServerProcess) -> None:
    """A chained request answers as the same conversation re-sent in full, and the previous turn's
    prompt is served from the cache."""
    c = client(server)
    ask = {"model": model_id(server), "instructions": "You are a helpful assistant.", "max_output_tokens": 10,
           "temperature": 0}
    first = c.responses.create(input="Name a colour.", **ask)
    chained = c.responses.create(input="And a fruit?", previous_response_id=first.id, **ask)
    resent = c.responses.create(input=[{"role": "user", "content": "Name a colour."},
                                       {"role": "assistant", "content": first.output_text},
                                       {"role": "user", "content": "And a fruit?"}], store=False, **ask)
    assert chained.previous_response_id == first.id and chained.output_text == resent.output_text
    assert first.usage is not None and chained.usage is not None and resent.usage is not None
    assert chained.usage.input_tokens == resent.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert c.responses.retrieve(chained.id).output_text == chained.output_text
    items = list(c.responses.input_items.list(chained.id, order="asc"))  # the client pages through them
    assert [i.type for i in items] == ["message"] * 3 and items[1].id == first.output[0].id
    by_ref = c.responses.create(input=[{"type": "item_reference", "id": i.id} for i in items], store=False, **ask)
    assert by_ref.output_text == chained.output_text and by_ref.usage is not None
    assert by_ref.usage.input_tokens_details.cached_tokens == by_ref.usage.input_tokens  # the same prompt, in full
    c.responses.delete(chained.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(chained.id)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_runs_a_tool_loop(server: ServerProcess, api: str) -> None:
    """The Agents SDK on either of its model APIs (`OpenAIChatCompletionsModel`, or its default
    `OpenAIResponsesModel` over /v1/responses): it sends the tools and a forced tool_choice, parses the
    call it gets back and runs the tool with its argument."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"18 degrees and clear in {city}"

    async def go() -> Any:
        kind = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
        model = kind(model=model_id(server), openai_client=openai.AsyncOpenAI(
            base_url=server.openai_url, api_key=KEY, max_retries=0, timeout=300))
        agent = Agent(name="weather", instructions="Answer weather questions with the tool.", model=model,
                      tools=[get_weather], tool_use_behavior="stop_on_first_tool",  # a weak model would call again
                      model_settings=ModelSettings(tool_choice="get_weather", max_tokens=60, temperature=0))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(go())
    assert len(seen) == 1 and seen[0]  # the SDK parsed our tool call and ran the tool with its argument
    assert result.final_output == f"18 degrees and clear in {seen[0]}"


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    sunny: bool


FORECAST = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": Forecast.model_json_schema()}}


def test_tools_with_a_response_format_follow_tool_choice(server: ServerProcess) -> None:
    """tools + response_format: required (or a named function) is a call, the format notwithstanding;
    none is the format's JSON; auto is either, as the model chooses, and parsed as such."""
    c, m = client(server), model_id(server)
    kw: dict[str, Any] = {"model": m, "messages": ASK, "tools": [WEATHER], "response_format": FORECAST,
                          "max_tokens": 60, "temperature": 0}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.chat.completions.create(**kw, tool_choice=choice).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.tool_calls, choice
        [call] = r.message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    r = c.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert r.message.tool_calls is None and r.finish_reason == "stop"
    assert Forecast.model_validate_json(r.message.content or "")
    for stream in (False, True):
        if not stream:
            auto = c.chat.completions.create(**kw).choices[0]
            content, calls, reason = auto.message.content, auto.message.tool_calls or [], auto.finish_reason
            names = [call.function.name for call in calls]
        else:
            content, names, reason = "", [], None
            for chunk in c.chat.completions.create(**kw, stream=True):
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    names += [tc.function.name for tc in ch.delta.tool_calls or [] if tc.function and tc.function.name]
                    reason = ch.finish_reason or reason
        if names:
            assert reason == "tool_calls" and set(names) == {"get_weather"} and not content
        else:
            assert reason == "stop" and Forecast.model_validate_json(content or "")


def test_the_responses_api_with_tools_and_a_text_format(server: ServerProcess) -> None:
    c = client(server)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    fmt: Any = {"format": {"type": "json_schema", "name": "forecast", "schema": Forecast.model_json_schema()}}
    ask: Any = {"model": model_id(server), "input": "What is the weather in Paris?", "tools": [tool], "text": fmt,
                "max_output_tokens": 60, "temperature": 0}
    forced = c.responses.create(**ask, tool_choice="required")
    assert [o.type for o in forced.output] == ["function_call"] and forced.output[0].name == "get_weather"  # type: ignore[union-attr]
    plain = c.responses.create(**ask, tool_choice="none")
    assert [o.type for o in plain.output] == ["message"] and Forecast.model_validate_json(plain.output_text)
    auto = c.responses.create(**ask)
    kinds = [o.type for o in auto.output]  # calls (one or more), or one message in the format
    assert kinds == ["message"] or (kinds and set(kinds) == {"function_call"}), kinds
    if kinds == ["message"]:
        assert Forecast.model_validate_json(auto.output_text)


def test_pydantic_ai_native_output_with_a_tool(server: ServerProcess) -> None:
    """pydantic-ai's NativeOutput sends the output type as a json_schema response_format beside the
    tools (tool_choice auto): the request is accepted, and the run ends with the tool called or a
    Forecast parsed from the reply. What the weak embedded model chooses is not tested."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    sent: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=300)
    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=server.openai_url, api_key=KEY,
                                                               max_retries=0, http_client=http))
    agent = Agent(OpenAIChatModel(model_id(server), provider=provider), output_type=NativeOutput(Forecast),
                  instructions="Answer weather questions. Call get_weather for the weather in a city.",
                  # one call a reply: the weak model otherwise writes calls until max_tokens cuts one
                  model_settings={"max_tokens": 120, "temperature": 0, "parallel_tool_calls": False})
    called: list[str] = []

    @agent.tool_plain
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"18 degrees and sunny in {city}"

    try:
        result = asyncio.run(agent.run("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=4)))
    except UsageLimitExceeded:
        assert called  # the model kept calling the tool: each call was parsed and run
    else:
        assert isinstance(result.output, Forecast)
    first = sent[0]
    assert first["response_format"]["type"] == "json_schema" and [t["function"]["name"] for t in first["tools"]] == [
        "get_weather"]
    assert first.get("tool_choice", "auto") == "auto" and first["parallel_tool_calls"] is False
