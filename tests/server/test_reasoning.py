"""Splitting a thinking model's reply into reasoning and content, whole and streamed (any chunking)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.config import ServerConfig
from prefixserve.server.app import create_app
from prefixserve.server.openai.reasoning import ReasoningStream, reasoning_tokens, split_reasoning
from prefixserve.server.openai.shapes import ChatShape, ChoiceOutput
from prefixserve.types import Usage
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import KEY_A, auth

CASES = [
    # (reply, the prompt opened <think>, reasoning, content)
    ("<think>\nLet me add.\n</think>\n\nIt is 4.", False, "Let me add.", "It is 4."),
    ("Let me add.\n</think>\n\nIt is 4.", True, "Let me add.", "It is 4."),
    ("<think>\n\n</think>\n\nIt is 4.", False, "", "It is 4."),  # enable_thinking false: an empty block
    ("It is 4.", False, None, "It is 4."),  # no block: untouched
    ("  It is <think> 4.", False, None, "  It is <think> 4."),
    ("<think>still thinking when max_tokens cut", False, "still thinking when max_tokens cut", ""),
    ("cut while thinking  ", True, "cut while thinking", ""),
    ("a  b\n\nc </thi", True, "a  b\n\nc </thi", ""),
    ("<thi", False, None, "<thi"),
    ("r</think>answer <think>again</think>", True, "r", "answer <think>again</think>"),
    ('<think>x</think><tool_call>{"name": "f"}</tool_call>', False, "x", '<tool_call>{"name": "f"}</tool_call>'),
]


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), CASES)
def test_whole_and_streamed_replies_split_the_same(text: str, thinking: bool, reasoning: str | None,
                                                   content: str) -> None:
    assert split_reasoning(text, thinking) == (reasoning, content)
    rng = random.Random(text)
    for chunking in range(20):
        stream, said, answered, k = ReasoningStream(thinking), "", "", 0
        while k < len(text):
            n = 1 if chunking == 0 else rng.randint(1, 6)
            r, c = stream.feed(text[k:k + n])
            said, answered, k = said + r, answered + c, k + n
            assert not answered or not r  # reasoning never follows content
        r, c = stream.finish()
        assert (said + r, answered + c) == (reasoning or "", content)


# Through the server, on the fake engine (it replays the prompt's text as the reply): a tokenizer that
# thinks gets its reasoning split out, streamed and not; chat_template_kwargs reach the template.

CH = "/v1/chat/completions"


def _ask(client: TestClient, engine: FakeEngine, body: dict[str, Any], **server: Any) -> tuple[dict, str, str, str]:
    """(the whole reply's message, and the streamed reasoning, content and finish_reason)."""
    prompt = engine.tokenizer.render_chat(body["messages"], None, True, body.get("chat_template_kwargs"))
    body = {**body, "max_tokens": len(prompt)}
    r = client.post(CH, json=body, headers=auth())
    assert r.status_code == 200, r.text
    raw = client.post(CH, json={**body, "stream": True}, headers=auth()).text
    deltas = [c["choices"][0] for c in (json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {"))
              if c["choices"]]
    said = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    return r.json()["choices"][0]["message"], said, content, deltas[-1]["finish_reason"]


def test_a_thinking_models_reasoning_is_reasoning_content(client: TestClient, engine: FakeEngine) -> None:
    engine.tokenizer.thinks = True  # type: ignore[misc]
    messages = [{"role": "user", "content": "Let me add. </think>\n\nIt is 4."}]
    opened = {"messages": messages, "chat_template_kwargs": {"open_think": True}}  # the prompt ends in <think>
    message, said, content, reason = _ask(client, engine, opened)
    assert message["reasoning_content"] == said and said.endswith("<user>Let me add.")
    assert message["content"] == content == "It is 4.\n<assistant><think>" and reason == "length"
    message, said, content, _ = _ask(client, engine, {"messages": messages})  # the reply does not open one
    assert message["reasoning_content"] is None and said == ""
    assert message["content"] == content and content.startswith("<user>Let me add. </think>")


def test_other_models_and_the_none_parser_leave_replies_alone(make_client: Any, engine: FakeEngine) -> None:
    body = {"messages": [{"role": "user", "content": "a</think>b"}], "chat_template_kwargs": {"open_think": True}}
    message, said, content, _ = _ask(make_client(), engine, body)
    assert "reasoning_content" not in message and said == "" and "a</think>b" in content
    engine.tokenizer.thinks = True  # type: ignore[misc]
    app = create_app(engine, ServerConfig(api_keys=(KEY_A,), reasoning_parser="none"))
    with TestClient(app) as plain:
        message, said, content, _ = _ask(plain, engine, body)
    assert "reasoning_content" not in message and said == "" and message["content"] == content


def test_chat_template_kwargs_reach_the_template_and_the_key(client: TestClient, engine: FakeEngine) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False},
            "max_tokens": 1}
    assert client.post(CH, json=body, headers=auth()).status_code == 200
    assert '<kwargs>{"enable_thinking": false}' in engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    tokenized = client.post("/tokenize", json={k: body[k] for k in ("messages", "chat_template_kwargs")},
                            headers=auth()).json()
    assert tokenized["tokens"] == list(engine.requests[-1].prompt_ids)
    for bad in ({"tools": []}, {"add_generation_prompt": False}, {"not an identifier": 1}):
        r = client.post(CH, json={**body, "chat_template_kwargs": bad}, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = client.post(CH, json={**body, "messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]},
                    headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].reasoning_content"


QWEN3_LIKE = (  # the Qwen3 template's generation prompt: thinking on opens nothing, off writes an empty block
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% if open_think is defined %}<think>\n{% endif %}{% endif %}"
)


def save_thinking_tokenizer(folder: str, template: str = QWEN3_LIKE) -> None:
    """A byte-level tokenizer with <think> and </think> as (non-special) added tokens, as Qwen3's: ids
    0..255 bytes, 256..258 <|endoftext|> <|im_start|> <|im_end|>, 259 <think>, 260 </think>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from prefixserve.models.tokenizer import load_tokenizer_folder

    folder = str(tmp_path_factory.mktemp("thinking-tokenizer"))
    save_thinking_tokenizer(folder)
    return load_tokenizer_folder(folder)


@pytest.mark.parametrize(("kwargs", "opened"), [(None, False), ({"enable_thinking": False}, False),
                                                ({"open_think": True}, True)])
def test_a_qwen3_like_tokenizer_thinks_and_its_prompt_says_where_the_reply_starts(
    thinking_tokenizer: Any, kwargs: dict[str, Any] | None, opened: bool,
) -> None:
    from types import SimpleNamespace

    from prefixserve.server.openai.chat import thinking_start

    assert thinking_tokenizer.thinks
    ids = thinking_tokenizer.render_chat([{"role": "user", "content": "2 + 2?"}], None, True, kwargs)
    assert thinking_start(SimpleNamespace(tokenizer=thinking_tokenizer), ids) is opened  # type: ignore[arg-type]
    think = thinking_tokenizer.hf.convert_tokens_to_ids("<think>")
    assert (think in ids) == (kwargs is not None)  # the tags are single tokens
    assert thinking_tokenizer.think_end_id == thinking_tokenizer.hf.convert_tokens_to_ids("</think>")


def test_a_template_without_think_tags_does_not_think() -> None:
    from prefixserve.models.loaders.load import embedded_model_path
    from prefixserve.models.tokenizer import load_tokenizer_gguf

    tokenizer = load_tokenizer_gguf(embedded_model_path())
    assert not tokenizer.thinks and tokenizer.think_end_id is None


# usage's reasoning_tokens, on the token ids of each case's reply (one token per byte, the tags one each):
# through the first </think> token, all of them when the block is never closed, 0 when it was not split off
NUM_REASONING = [15, 13, 4, 0, 0, 35, 20, 13, 0, 2, 3]


@pytest.mark.parametrize(("case", "expected"), list(zip(CASES, NUM_REASONING, strict=True)))
def test_reasoning_tokens_are_counted_by_token_id_whole_and_streamed(
    thinking_tokenizer: Any, case: tuple[str, bool, str | None, str], expected: int,
) -> None:
    text, thinking, reasoning, _ = case
    end_id = thinking_tokenizer.think_end_id
    ids = thinking_tokenizer.hf.encode(text, add_special_tokens=False)
    assert thinking_tokenizer.decode(ids) == text
    assert (0 if reasoning is None else reasoning_tokens(ids, end_id)) == expected
    rng = random.Random(text)
    for chunking in range(10):  # deltas of 1 (the engine's) or several tokens, with their text
        stream, k = ReasoningStream(thinking, end_id), 0
        while k < len(ids):
            n = 1 if chunking == 0 else rng.randint(1, 4)
            stream.count(ids[k:k + n])
            stream.feed(thinking_tokenizer.decode(ids[k:k + n]))
            k += n
        stream.finish()
        assert stream.num_tokens == expected


def test_chat_usage_sums_the_choices_reasoning_tokens_whole_and_streamed(thinking_tokenizer: Any) -> None:
    """n = 2: one reply thinks then answers, one is cut while thinking; with the parser off, 0."""
    replies = ["Let me add.\n</think>\n\nIt is 4.", "still thinking"]
    ids = [thinking_tokenizer.hf.encode(r, add_special_tokens=False) for r in replies]
    usage = Usage(prompt_tokens=9, completion_tokens=sum(map(len, ids)), cached_tokens=0)
    for thinking, expected in ((True, 13 + len(ids[1])), (None, 0)):
        shape = ChatShape(id="chatcmpl-1", model="m", thinking=thinking,
                          think_end_id=thinking_tokenizer.think_end_id)
        whole = shape.full([ChoiceOutput(i, r, "length", token_ids=t) for i, (r, t) in enumerate(zip(replies, ids))],
                           usage)["usage"]
        for i, t in enumerate(ids):
            for token in t:
                shape.chunks(i, thinking_tokenizer.decode([token]), (), None, None, (token,))
            shape.chunks(i, "", (), "length")
        streamed = shape.usage_chunk(usage)["usage"]
        assert whole == streamed and whole["completion_tokens_details"] == {
            "reasoning_tokens": expected, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0,
            "audio_tokens": 0}
        assert whole["prompt_tokens_details"] == {"cached_tokens": 0, "audio_tokens": 0}


# End to end: a tiny random hybrid model (tests/hybrid/tiny.py) with the tokenizer above and a template
# that opens <think> unless told not to (as QwQ's and DeepSeek-R1's do). Greedy, its replies are random
# bytes; logit_bias on </think> (260) or <think> (259) puts the tags in them. Which token ids the engine
# generated is read from the logprobs (one entry per token; the stop token has none).

THINKER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_think is not defined or open_think %}<think>\n{% endif %}{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]
BIAS = 4  # on </think>: the seed-5 model then writes it a few tokens into both replies (seed 3)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from prefixserve.config import CacheConfig, EngineConfig, ModelConfig
    from prefixserve.engine import build_engine
    from tests.hybrid.tiny import make_model

    folder = str(tmp_path_factory.mktemp("tiny-thinker"))
    make_model(folder, layers=4, seed=5, vocab=261, with_tokenizer=False)
    save_thinking_tokenizer(folder, THINKER_TEMPLATE)
    engine = build_engine(ModelConfig(path=folder, dtype="fp32", num_threads=1, served_model_name="tiny"),
                          CacheConfig(max_bytes=1 << 28), EngineConfig())
    assert engine.tokenizer.think_end_id == 260
    with TestClient(create_app(engine, ServerConfig(api_keys=(KEY_A,)))) as c:
        yield c


def _generated(choice: Any) -> list[str]:
    """The tokens a choice generated, as the official client parsed its logprobs."""
    return [entry.token for entry in choice.logprobs.content]


@pytest.mark.slow
@pytest.mark.parametrize(("kwargs", "bias", "split"), [
    (None, {"260": BIAS}, "closed"),  # the prompt opened the block; the reply closes it, then answers
    ({"open_think": False}, {"259": 100}, "open"),  # the reply opens a block and never closes it
    ({"enable_thinking": False}, {"260": BIAS}, None),  # thinking off: nothing is reasoning
])
def test_reasoning_tokens_through_the_official_client_streamed_and_not(
    thinker: TestClient, kwargs: dict[str, Any] | None, bias: dict[str, int], split: str | None,
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url="http://testserver/v1", api_key=KEY_A, http_client=thinker, max_retries=0)
    ask: dict[str, Any] = {"model": "tiny", "messages": HI, "max_tokens": 16, "temperature": 0.8, "logit_bias": bias,
                           "logprobs": True, "n": 2, "seed": 3}
    if kwargs is not None:
        ask["extra_body"] = {"chat_template_kwargs": kwargs}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    # streamed and not: the same usage (the second of them found the prompt cached)
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(exclude={"prompt_tokens_details"})
    details = whole.usage.completion_tokens_details
    assert details is not None and whole.usage.prompt_tokens_details is not None
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens, details.audio_tokens) == (0, 0, 0)
    assert whole.usage.prompt_tokens_details.audio_tokens == 0
    expected = 0
    for choice in whole.choices:
        tokens = _generated(choice)
        reasoning = getattr(choice.message, "reasoning_content", None)
        if split == "closed":
            assert 0 < tokens.index("</think>") < len(tokens) - 1 and reasoning is not None
            expected += tokens.index("</think>") + 1
        elif split == "open":
            assert "</think>" not in tokens and tokens[0] == "<think>" and reasoning is not None
            expected += len(tokens) + (choice.finish_reason == "stop")  # with the stop token, if it stopped
        else:
            assert reasoning is None
    assert details.reasoning_tokens == expected and (split is None) == (expected == 0)


@pytest.mark.slow
def test_responses_output_tokens_details_count_the_reasoning_item(thinker: TestClient) -> None:
    """The prompt opens the block and the reply never closes it: every output token is reasoning."""
    from openai import OpenAI

    client = OpenAI(base_url="http://testserver/v1", api_key=KEY_A, http_client=thinker, max_retries=0)
    ask: dict[str, Any] = {"model": "tiny", "input": "hi", "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    assert whole.output[0].type == "reasoning" and whole.usage is not None
    assert whole.usage.output_tokens == 8 and whole.usage.output_tokens_details.reasoning_tokens == 8
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.usage is not None
    assert last.response.usage.output_tokens_details == whole.usage.output_tokens_details
