"""IncrementalDetokenizer over the embedded SmolLM2's byte-level tokenizer: an emoji is three tokens
(two of them parts of a character), so what is held back, flushed, and which tokens keep their text
after a stop string, can be checked on real ids."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from prefixserve.engine import AsyncEngine
from prefixserve.engine.detok import IncrementalDetokenizer
from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_gguf
from prefixserve.types import Delta, FinishReason, Namespace, Request, SamplingParams

TEXTS = ["Hello world, hello there", "Hi 🐱🐱 你好, café", "1. 1\n2. 2\n3. 3\n4. 4\n5", "🐬"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer_gguf(embedded_model_path())


def feed(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[IncrementalDetokenizer, str]:
    d = IncrementalDetokenizer(tok, stop)
    out = ""
    for i in ids:
        out += d.add(i)
        if d.stopped:
            break
    return d, out + d.flush()


@pytest.mark.parametrize("stop", [(), ("zzz",)])
def test_complete_text_comes_out_unchanged(tok: Tokenizer, stop: tuple[str, ...]) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        d, out = feed(tok, ids, stop)
        assert out == text == tok.decode(ids)
        assert d.num_settled == len(ids)


def test_an_unfinished_character_at_the_end_comes_out_as_a_replacement_character(tok: Tokenizer) -> None:
    ids = tok.encode("Hi 🐱")
    assert len(ids) == 4  # 'Hi', ' \xf0\x9f', '\x90', '\xb1'
    for k in (2, 3):
        d = IncrementalDetokenizer(tok)
        streamed = "".join(d.add(i) for i in ids[:k])
        assert streamed == "Hi"  # the unfinished character is held back while tokens may follow
        assert d.num_settled == 1  # ... and so are its tokens' logprobs
        assert d.flush() == " \ufffd"  # it was dropped: max_tokens 1 on an emoji reply gave ''
        assert d.num_settled == k


def test_tokens_of_a_cut_stop_string_are_not_settled(tok: Tokenizer) -> None:
    ids = tok.encode("1. 1\n2. 2\n3. 3\n4. 4\n5")
    d, out = feed(tok, ids, ("3\n4",))
    assert d.stopped and out == "1. 1\n2. 2\n3. "
    assert tok.decode(ids[: d.num_settled]) == out  # '3', '\n', '4' dropped


def test_a_token_that_straddles_the_cut_stays(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world, hello there")
    assert tok.decode(ids[:1]) == "Hello"
    d, out = feed(tok, ids, ("lo wor",))
    assert out == "Hel"
    assert d.num_settled == 1  # 'Hello' starts before the cut, ' world' after it


def test_held_back_text_settles_its_tokens_only_once_it_is_sure(tok: Tokenizer) -> None:
    ids = tok.encode("1. 1\n2. 2\n3. 3")
    d = IncrementalDetokenizer(tok, ("3\n4",))
    for i in ids:
        d.add(i)
    assert d.num_settled == len(ids) - 2  # ' ' and '3': held back, they may still begin a stop string
    d.flush()
    assert d.num_settled == len(ids)


class Chars:
    """A tokenizer a character a token (tags arrive split, as from a byte-level model)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


TAGS = ("<tool_call>", "</tool_call>")


def feed_chars(text: str, stop: tuple[str, ...], skip: tuple[str, str] | None = TAGS) -> tuple[str, str, bool]:
    """(what streamed before the end, what the whole reply is, stopped)."""
    d = IncrementalDetokenizer(Chars(), stop, skip)  # type: ignore[arg-type]
    streamed = ""
    for ch in text:
        streamed += d.add(ord(ch))
        assert d.text.startswith(streamed)
        if d.stopped:
            return streamed, streamed, True
    return streamed, streamed + d.flush(), d.stopped


CALL = '<tool_call>\n{"name": "f", "arguments": {"a": "x\ny"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "stop", "reply"), [
    # QA: stop "\n" with a forced call returned content "<tool_call>" and no call
    (CALL, ("\n",), CALL),
    (CALL, ("tool", '"a"', "}", "<"), CALL),  # in the tags and the JSON alike
    ("Sure.\n" + CALL + "\nDone.\nMore", ("\n",), "Sure."),  # outside a call it stops as ever
    ("Sure. " + CALL + " Done.\nMore", ("\n", "Done"), "Sure. " + CALL + " "),
    ("a <tool_c b", ("<tool",), "a "),  # not a tag after all: the stop string counts
    ("x <tool_call> y", ("<tool_call>",), "x <tool_call> y"),  # a stop string that is the tag: part of the span
    ("a <tool", ("<t",), "a "),  # the reply ended on half a tag: the stop string counts
    ("ab <tool_call> unclosed\nstill in", ("\n",), "ab <tool_call> unclosed\nstill in"),
])
def test_stop_strings_do_not_cut_a_tool_call(text: str, stop: tuple[str, ...], reply: str) -> None:
    streamed, whole, _ = feed_chars(text, stop)
    assert whole == reply and whole.startswith(streamed)
    assert feed_chars(text, stop, None)[1] == text[: min(i for s in stop if (i := text.find(s)) != -1)]


def test_a_stop_string_waits_while_a_tag_may_be_starting() -> None:
    d = IncrementalDetokenizer(Chars(), ("\n<",), TAGS)  # type: ignore[arg-type]
    out = "".join(d.add(ord(ch)) for ch in "hi\n<tool")
    assert out == "hi" and not d.stopped  # '\n<' may open a call: neither streamed nor a stop yet
    assert d.add(ord("s")) == "" and d.stopped and d.text == "hi"


def generate(engine: AsyncEngine, prompt: str, sp: SamplingParams) -> list[Delta]:
    ids = tuple(engine.core.tokenizer.encode(prompt))

    async def go() -> list[Delta]:
        return [d async for d in engine.generate(Request(uuid.uuid4().hex, Namespace("smol", "t"), ids, sp))]

    return asyncio.run(go())


@pytest.mark.slow
def test_the_engine_sends_logprobs_with_their_text(engine: AsyncEngine, tok: Tokenizer) -> None:
    """Greedy on the real model: a stop string's tokens have no logprobs (they had: '3', '\\n', '4'),
    an emoji's tokens go out in the delta with its text, and max_tokens 1 on an emoji gives U+FFFD."""
    sp = SamplingParams(max_tokens=20, temperature=0.0, stop=("3\n4",), num_logprobs=0)
    deltas = generate(engine, "Count from 1 to 20, one number per line:\n1. 1\n", sp)
    text = "".join(d.text for d in deltas)
    assert text == "2. 2\n3. " and deltas[-1].finish_reason is FinishReason.STOP
    assert b"".join(tok.token_bytes(e.token_id) for d in deltas for e in d.logprobs).decode() == text
    deltas = generate(engine, "Emoji: 🐱", SamplingParams(max_tokens=4, temperature=0.0, num_logprobs=0))
    assert "".join(d.text for d in deltas).startswith("🐬")
    for d in deltas[:-1]:  # each delta's tokens are whole characters: its text
        assert b"".join(tok.token_bytes(e.token_id) for e in d.logprobs).decode() == d.text
    deltas = generate(engine, "Emoji: 🐱", SamplingParams(max_tokens=1, temperature=0.0, num_logprobs=0))
    assert [d.text for d in deltas] == ["\ufffd"] and len(deltas[0].logprobs) == 1
