"""Splitting a thinking model's reply into reasoning and content, whole and streamed (any chunking)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.config import ServerConfig
from prefixserve.server.app import create_app
from prefixserve.server.reasoning import ReasoningStream, split_reasoning
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


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A byte-level tokenizer with <think> and </think> as (non-special) added tokens, as Qwen3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from prefixserve.models.tokenizer import load_tokenizer_folder

    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN3_LIKE
    folder = str(tmp_path_factory.mktemp("thinking-tokenizer"))
    fast.save_pretrained(folder)
    return load_tokenizer_folder(folder)


@pytest.mark.parametrize(("kwargs", "opened"), [(None, False), ({"enable_thinking": False}, False),
                                                ({"open_think": True}, True)])
def test_a_qwen3_like_tokenizer_thinks_and_its_prompt_says_where_the_reply_starts(
    thinking_tokenizer: Any, kwargs: dict[str, Any] | None, opened: bool,
) -> None:
    from types import SimpleNamespace

    from prefixserve.server.chat import thinking_start

    assert thinking_tokenizer.thinks
    ids = thinking_tokenizer.render_chat([{"role": "user", "content": "2 + 2?"}], None, True, kwargs)
    assert thinking_start(SimpleNamespace(tokenizer=thinking_tokenizer), ids) is opened  # type: ignore[arg-type]
    think = thinking_tokenizer.hf.convert_tokens_to_ids("<think>")
    assert (think in ids) == (kwargs is not None)  # the tags are single tokens


def test_a_template_without_think_tags_does_not_think() -> None:
    from prefixserve.models.loader import embedded_model_path
    from prefixserve.models.tokenizer import load_tokenizer_gguf

    assert not load_tokenizer_gguf(embedded_model_path()).thinks
