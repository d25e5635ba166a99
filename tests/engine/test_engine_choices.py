"""The engine with the real model: n > 1 forks one prefill, logprobs, penalties / logit_bias, and
constrained decoding (grammar masks)."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from prefixserve.engine import AsyncEngine
from prefixserve.types import Constraint, Delta, Namespace, Request, SamplingParams

pytestmark = pytest.mark.slow

NS = Namespace("smol", "tenant-a")


def prompt(engine: AsyncEngine, user: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer.render_chat([{"role": "user", "content": user}]))


def run(engine: AsyncEngine, ids: tuple[int, ...], sp: SamplingParams, n: int = 1) -> list[Delta]:
    async def go() -> list[Delta]:
        return [d async for d in engine.generate(Request(uuid.uuid4().hex, NS, ids, sp, num_choices=n))]

    return asyncio.run(go())


def by_choice(deltas: list[Delta], n: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for d in deltas:
        out[d.index] += d.token_ids
    return out


def test_n_choices_prefill_once_are_seeded_and_count_the_prompt_once(engine: AsyncEngine) -> None:
    ids = prompt(engine, "Name a colour and a fruit.")
    computed_before = engine.core.counters.num_computed_prompt_tokens
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    first = run(engine, ids + (1000,), sp, n=4)  # a fresh prompt: no cache entry yet
    assert engine.core.counters.num_computed_prompt_tokens - computed_before == len(ids) + 1  # one prefill
    choices = by_choice(first, 4)
    assert [len(c) for c in choices] == [6, 6, 6, 6]
    assert len({tuple(c) for c in choices}) > 1  # different generators
    last = first[-1].usage
    assert last is not None and (last.prompt_tokens, last.completion_tokens) == (len(ids) + 1, 24)
    assert sum(d.finish_reason is not None for d in first) == 4
    again = run(engine, ids + (1000,), sp, n=4)  # now a full hit: every choice copies the entry
    assert by_choice(again, 4) == choices
    assert again[-1].usage is not None and again[-1].usage.cached_tokens == len(ids) + 1
    single = run(engine, ids + (1000,), sp)  # choice 0 is what n=1 with the same seed gives
    assert by_choice(single, 1)[0] == choices[0]
    assert engine.core.num_running() == 0
    engine.core.cache.check_integrity()


def test_greedy_logprobs_top_entry_is_the_sampled_token(engine: AsyncEngine) -> None:
    ids = prompt(engine, "What is the capital of France?")
    deltas = run(engine, ids, SamplingParams(max_tokens=5, temperature=0.0, num_logprobs=5))
    entries = [lp for d in deltas for lp in d.logprobs]
    tokens = [t for d in deltas for t in d.token_ids if t not in engine.tokenizer.eos_token_ids]
    assert [e.token_id for e in entries] == tokens
    for e in entries:
        assert len(e.top) == 5 and e.top[0][0] == e.token_id and e.top[0][1] == e.logprob <= 0.0
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)


def test_logit_bias_and_penalties_change_what_is_sampled(engine: AsyncEngine) -> None:
    ids = prompt(engine, "Say hello.")
    plain = by_choice(run(engine, ids, SamplingParams(max_tokens=4, temperature=0.0)), 1)[0]
    banned = by_choice(run(engine, ids, SamplingParams(max_tokens=4, temperature=0.0,
                                                       logit_bias=((plain[0], -100.0),))), 1)[0]
    assert banned[0] != plain[0]
    forced = by_choice(run(engine, ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                       logit_bias=((1000, 100.0),))), 1)[0]
    assert forced == [1000, 1000, 1000]
    penalised = by_choice(run(engine, ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                          frequency_penalty=2.0, logit_bias=((1000, 3.0),))), 1)[0]
    assert penalised.count(1000) < 3


def test_json_schema_constraint_always_parses_and_validates(engine: AsyncEngine) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    ids = prompt(engine, "Give me a city.")
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                        constraint=Constraint("json_schema", json.dumps(schema)))
    deltas = run(engine, ids, sp, n=3)
    texts = ["", "", ""]
    for d in deltas:
        texts[d.index] += d.text
    for text in texts:
        value = json.loads(text)
        assert set(value) == {"city", "population"} and isinstance(value["population"], int), text
    assert all(d.finish_reason is None or d.finish_reason.value == "stop" for d in deltas)


def test_closing_the_stream_aborts_every_choice(engine: AsyncEngine) -> None:
    ids = prompt(engine, "Count to one hundred.")

    async def go() -> int:
        req = Request(uuid.uuid4().hex, NS, ids, SamplingParams(max_tokens=200, ignore_eos=True), num_choices=3)
        seen = 0
        async for d in engine.generate(req):
            seen += len(d.token_ids)
            if seen >= 4:
                break
        for _ in range(100):  # the abort reaches the engine thread within a step or two
            if engine.core.num_running() == 0:
                break
            await asyncio.sleep(0.05)
        return engine.core.num_running()

    assert asyncio.run(go()) == 0
    engine.core.cache.check_integrity()
