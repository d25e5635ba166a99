"""A hybrid's finished turn, keyed as the client's next request will hold it: a reply whose text the
tokenizer splits otherwise than the model sampled it, and a chat template that writes a reply back
otherwise than its generation prompt led into it (Qwen3's: an empty think block in the prompt with
thinking off, which the history does not have; a thinking reply whose reasoning the client never
sends back). The recurrent state cannot go back, so the turn is re-fed from a cached state
(engine/cache_writer.py; types.HistoryForm, models/tokenizer.py `next_turn`, docs/cache.md "Finished
turns"), and the next turn hits through the reply. On tiny random hybrid (Qwen3.5-like) models with
byte-level tokenizers."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import torch

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.models import load_model
from prefixserve.runner import ModelRunner
from prefixserve.types import HistoryForm, Namespace, Request, SamplingParams, Usage
from tests.conftest import TEST_DEVICE
from tests.helpers.engine_run import assert_fresh_prefill, collect
from tests.hybrid.tiny import VOCAB, make_model, save_tokenizer
from tests.server.test_reasoning import THINKER_TEMPLATE, save_thinking_tokenizer

torch.set_num_threads(1)
HI = [{"role": "system", "content": "You are terse. " * 6}, {"role": "user", "content": "Say a."}]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny-thinker-history"))
    make_model(folder, layers=4, seed=5, vocab=261, with_tokenizer=False)
    save_thinking_tokenizer(folder, THINKER_TEMPLATE)
    return load_model(folder, torch.float32, TEST_DEVICE)


def history(tok: Any, reply: str, kwargs: dict[str, Any] | None) -> list[int]:
    return tok.render_chat(HI + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}],
                           None, True, kwargs)


def test_the_template_form_and_the_next_turn(model):
    tok = model.tokenizer
    tags = ["<think>", "\n", "\n", "</think>", "\n", "\n"]
    assert tok.history_form(OFF)[:2] == (len(tags), "")  # the empty block is not in the history
    assert tok.history_form(None)[:2] == (2, "")  # the opened "<think>\n" is not either
    for kwargs, thinking in ((OFF, False), (None, True)):
        drop, lead, _ = tok.history_form(kwargs)
        prompt = tok.render_chat(HI, None, True, kwargs)
        said = "" if thinking else "<think>\nhmm\n</think>\n\n"  # the reply opens the block itself
        reply = tok.encode(said + "Let me see.\n</think>\n\nThe answer: a." if thinking else said + "The answer: a.")
        turn = tok.next_turn(prompt, reply + [tok.eos_token_ids[0]], HistoryForm(drop, lead, thinking))
        want = history(tok, "The answer: a.", kwargs)  # the client sends the answer back, not the reasoning
        assert turn is not None and want[: len(turn)] == list(turn) and turn[-1] == tok.eos_token_ids[0]
        assert len(turn) < len(prompt) + len(reply)


def make_engine(model, max_bytes: int) -> AsyncEngine:
    core = EngineCore(ModelRunner(model.decoder, 1), model.tokenizer, PrefixCache(CacheConfig(max_bytes=max_bytes)),
                      EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=128), 2048, lambda r, d: None)
    return AsyncEngine(core, "tiny", model.tokenizer, "test", model.arch.vocab_size)


async def run(engine: AsyncEngine, ids: list[int], ns: Namespace, max_tokens: int, form: HistoryForm | None = None,
              bias: tuple[tuple[int, float], ...] = ()) -> tuple[list[int], Usage]:
    return await collect(engine, Request(uuid.uuid4().hex, ns, tuple(ids), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logit_bias=bias), history=form))


async def settle(engine: AsyncEngine) -> None:
    for _ in range(200):
        if not engine.core.refills:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the turn refills did not finish")


@pytest.fixture(scope="module")
def merging(tmp_path_factory):
    """The tiny byte-level tokenizer plus one merge, "a" + "a" -> "aa": a model that writes "a" eight
    times wrote text the tokenizer encodes as four tokens."""
    folder = str(tmp_path_factory.mktemp("qwen35m"))
    make_model(folder, layers=4, seed=5, with_tokenizer=False, vocab=VOCAB + 1)
    save_tokenizer(folder, merges=("aa",))
    return load_model(folder, torch.float32, TEST_DEVICE)


def test_a_turn_is_cached_as_its_text_encodes(merging):
    tok = merging.tokenizer
    a, aa = tok.encode("a"), tok.encode("aa")
    assert len(a) == 1 and len(aa) == 1 and aa != a + a
    ns = Namespace("tiny", "t")
    first = [{"role": "system", "content": "You are terse. " * 6}, {"role": "user", "content": "Say a."}]
    ids = tok.render_chat(first)
    second = tok.render_chat(first + [{"role": "assistant", "content": "a" * 8}, {"role": "user", "content": "More?"}])
    turn = list(ids) + aa * 4
    assert second[: len(turn)] == turn
    cached, plain = make_engine(merging, 1 << 30), make_engine(merging, 0)

    async def go():
        out, _ = await run(cached, ids, ns, 8, bias=((a[0], 100.0),))
        await settle(cached)
        got, want = await run(cached, second, ns, 16), await run(plain, second, ns, 16)
        await cached.shutdown()
        await plain.shutdown()
        return out, got, want

    out, (out2, u2), (ref2, _) = asyncio.run(go())
    assert out == a * 8  # sampled one "a" at a time; the history holds "aa" four times
    assert u2.cached_tokens == len(turn)  # was len(ids): the sampled turn's entry ends where the reply begins
    assert out2 == ref2
    entry = cached.core.cache.get(ns, tuple(turn))
    assert entry is not None
    assert_fresh_prefill(cached.core.runner, entry.state, turn, 64)


@pytest.mark.parametrize("kwargs", [OFF, None], ids=["thinking-off", "thinking"])
def test_the_next_turn_hits_through_the_reply(model, kwargs):
    """Turn 1 writes "a" twelve times (all of it reasoning when the prompt opened the block); turn 2,
    the history as the template writes it, is served from the cache up to where it leaves the turn
    (was: not at all, the prompt being shorter than a recurrent checkpoint's grid), and answers as
    a cache-less engine does; the entry is bitwise a fresh prefill of that history."""
    tok = model.tokenizer
    ns = Namespace("tiny", "t")
    drop, lead, _ = tok.history_form(kwargs)
    thinking = kwargs is None
    prompt = tok.render_chat(HI, None, True, kwargs)
    a = tok.encode("a")
    second = history(tok, "" if thinking else "a" * 12, kwargs)
    key = prompt[: len(prompt) - drop] + ([] if thinking else a * 12)  # the answer only; cut, so no <|im_end|>
    assert second[: len(key)] == key
    cached, plain = make_engine(model, 1 << 30), make_engine(model, 0)

    async def go():
        out, _ = await run(cached, prompt, ns, 12, HistoryForm(drop, lead, thinking), bias=((a[0], 100.0),))
        await settle(cached)
        got, want = await run(cached, second, ns, 12), await run(plain, second, ns, 12)
        await cached.shutdown()
        await plain.shutdown()
        return out, got, want

    out, (out2, u2), (ref2, _) = asyncio.run(go())
    assert out == a * 12
    assert u2.cached_tokens == len(key)
    assert out2 == ref2
    entry = cached.core.cache.get(ns, tuple(key))
    assert entry is not None
    assert_fresh_prefill(cached.core.runner, entry.state, key, 64)


def test_a_reply_ended_by_another_stop_token_is_keyed_with_the_templates(merging):
    """A model with two stop tokens (`<|im_end|>`, `<|endoftext|>`) may end its reply with the one the
    chat template does not write: the next request's history holds the reply and then `<|im_end|>`
    whichever ended it. The turn is keyed so (types.HistoryForm `end`, from `history_form`'s probe),
    and the next turn hits through the reply's stop token (was: the prompt only; the turn was cached
    under `<|endoftext|>`, which no history holds)."""
    tok = merging.tokenizer
    im_end, text_end = tok.eos_token_ids[:2]  # the template's, then another
    assert tok.history_form(None) == (0, "", im_end)
    first = [{"role": "system", "content": "You are terse. " * 6}, {"role": "user", "content": "Say a."}]
    ids = tok.render_chat(first)
    reply = "Sure."
    turn = tok.next_turn(ids, tok.encode(reply) + [text_end], HistoryForm(end=im_end))
    second = tok.render_chat(first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}])
    assert turn is not None and second[: len(turn)] == list(turn) and turn[-1] == im_end
    # end to end: a reply that is the other stop token alone (forced), then the history that follows it
    second = tok.render_chat(first + [{"role": "assistant", "content": ""}, {"role": "user", "content": "More?"}])
    key = ids + [im_end]
    assert second[: len(key)] == key
    ns = Namespace("tiny", "t")
    cached, plain = make_engine(merging, 1 << 30), make_engine(merging, 0)
    form = HistoryForm(end=tok.history_form(None)[2])

    async def go():
        out, _ = await collect(cached, Request(uuid.uuid4().hex, ns, tuple(ids), SamplingParams(
            max_tokens=8, temperature=0.0, logit_bias=((text_end, 100.0),)), history=form))
        await settle(cached)
        got, want = await run(cached, second, ns, 8), await run(plain, second, ns, 8)
        await cached.shutdown()
        await plain.shutdown()
        return out, got, want

    out, (out2, u2), (ref2, _) = asyncio.run(go())
    assert out == [text_end]
    assert u2.cached_tokens == len(key)  # was len(ids)
    assert out2 == ref2
    entry = cached.core.cache.get(ns, tuple(key))
    assert entry is not None
    assert_fresh_prefill(cached.core.runner, entry.state, key, 64)
