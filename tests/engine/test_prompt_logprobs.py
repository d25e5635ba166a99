"""Prompt logprobs (completions' echo with logprobs, `SamplingParams.prompt_logprobs`): every prompt
token after the first scored on the logits of the position before it, bit for bit the logits a
prefill of that prefix ends with, however the prompt is chunked; such a prompt is computed, never
served from the cache, and still seeds the cache; max_tokens 0 feeds the prompt and nothing else."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import pytest
import torch

from prefixserve.engine import AsyncEngine
from prefixserve.runner import ModelRunner, StepItem, scored_logprobs, token_logprob
from prefixserve.types import (
    Delta,
    FinishReason,
    Namespace,
    PromptTooLong,
    Request,
    SamplingParams,
    TokenLogprob,
)

pytestmark = pytest.mark.slow

NS = Namespace("smol", "tenant-a")
TOP = 3
CHECKED = (0, 1, 36, 37, 63, 64, 65, 127, 150, 198)  # chunk edges of both schedules below, and between


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scored(runner: ModelRunner, ids: Sequence[int], cuts: Sequence[int]) -> list[TokenLogprob]:
    """Feed `ids` in chunks ending at `cuts`, scoring every position that has a next token."""
    state = runner.new_state(len(ids) + 1)
    out: list[TokenLogprob] = []
    start = 0
    for end in [*cuts, len(ids)]:
        item = StepItem(state, ids[start:end], want_logits=end == len(ids), targets=ids[start + 1 : end + 1],
                        num_top=TOP)
        runner.step([item])
        assert item.scores is not None
        out += scored_logprobs(item.targets, item.scores)
        start = end
    return out


def check_against_prefix_prefills(runner: ModelRunner, ids: list[int]) -> None:
    one = scored(runner, ids, [64, 128])
    other = scored(runner, ids, [37, 65, 150])
    assert [e.token_id for e in one] == ids[1:]
    assert one == other  # chunking never changes a bit
    for p in CHECKED:  # position p scores ids[p + 1] with the logits a prefill of ids[: p + 1] ends with
        state = runner.new_state(p + 2)
        runner.step([StepItem(state, ids[: p + 1])])
        assert one[p] == token_logprob(state.logits, ids[p + 1], TOP), p
        assert [t for t, _ in one[p].top] == torch.topk(state.logits, TOP).indices.tolist()


def test_prompt_logprobs_are_the_logits_of_a_prefill_of_each_prefix(embedded) -> None:
    _, runner = embedded
    check_against_prefix_prefills(runner, prompt_ids(200, runner.decoder.arch.vocab_size, 1))


def test_prompt_logprobs_of_a_hybrid_model(tmp_path) -> None:
    from prefixserve.models.layers import TilePlan
    from prefixserve.models.loaders.hybrid_folder import HybridHFModel, build_hybrid
    from tests.hybrid.tiny import VOCAB, make_model

    make_model(str(tmp_path), layers=4, seed=3, with_tokenizer=False)
    runner = ModelRunner(build_hybrid(HybridHFModel(str(tmp_path)), torch.float32, "cpu", TilePlan()), 1)
    check_against_prefix_prefills(runner, prompt_ids(200, VOCAB, 2))


def run(engine: AsyncEngine, ids: Sequence[int], sp: SamplingParams, n: int = 1) -> list[Delta]:
    async def go() -> list[Delta]:
        return [d async for d in engine.generate(Request(uuid.uuid4().hex, NS, tuple(ids), sp, num_choices=n))]

    return asyncio.run(go())


def test_a_scored_prompt_is_computed_not_served_and_still_seeds_the_cache(engine: AsyncEngine) -> None:
    runner = engine.core.runner
    ids = prompt_ids(300, runner.decoder.arch.vocab_size, 5)
    run(engine, ids, SamplingParams(max_tokens=1, temperature=0.0))  # now cached in full
    computed = engine.core.counters.num_computed_prompt_tokens
    deltas = run(engine, ids, SamplingParams(max_tokens=0, prompt_logprobs=TOP))
    assert engine.core.counters.num_computed_prompt_tokens - computed == len(ids)  # all of it, cache or not
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].token_ids == () and deltas[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(d.token_ids) for d in deltas) == 0
    usage = deltas[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (300, 0, 0)
    entries = carrying[0].prompt_logprobs
    assert entries is not None and entries == tuple(scored(runner, ids, [128, 256]))
    engine.core.cache.check_integrity()
    fresh = ids[:-1] + [ids[-1] + 1]  # a new prompt: scoring it seeds the cache like any other
    run(engine, fresh, SamplingParams(max_tokens=0, prompt_logprobs=0))
    again = run(engine, fresh, SamplingParams(max_tokens=2, temperature=0.0))
    assert again[-1].usage is not None and again[-1].usage.cached_tokens == len(fresh)


def test_each_choice_gets_the_prompt_logprobs_before_its_tokens(engine: AsyncEngine) -> None:
    ids = prompt_ids(90, engine.core.runner.decoder.arch.vocab_size, 6)
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=3, prompt_logprobs=0, num_logprobs=0, ignore_eos=True)
    deltas = run(engine, ids, sp, n=2)
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        first = next(i for i, d in enumerate(mine) if d.token_ids)
        carrying = [i for i, d in enumerate(mine) if d.prompt_logprobs is not None]
        assert len(carrying) == 1 and carrying[0] < first
        assert [e.token_id for e in mine[carrying[0]].prompt_logprobs or ()] == ids[1:]
        assert sum(len(d.token_ids) for d in mine) == 3
    plain = run(engine, ids, SamplingParams(max_tokens=3, temperature=1.0, seed=3, num_logprobs=0, ignore_eos=True))
    assert [t for d in plain for t in d.token_ids] == [t for d in deltas if d.index == 0 for t in d.token_ids]


def test_a_prompt_as_long_as_the_context_is_scored_when_nothing_is_generated() -> None:
    """Evaluation harnesses score windows of exactly the context's length (echo, max_tokens 0): that
    fits, scored as any prompt; one token more, or any generation, does not."""
    from prefixserve.cache import PrefixCache
    from prefixserve.config import CacheConfig, EngineConfig
    from prefixserve.engine import EngineCore
    from tests.conftest import load_embedded

    model, runner = load_embedded("int4")
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 28)),
                      EngineConfig(prefill_chunk_tokens=128, max_batch_tokens=256), 192, lambda r, d: None)
    engine = AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)
    try:
        ids = prompt_ids(192, runner.decoder.arch.vocab_size, 7)
        deltas = run(engine, ids, SamplingParams(max_tokens=0, prompt_logprobs=TOP))
        [entries] = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
        assert entries == tuple(scored(runner, ids, [128]))
        usage = deltas[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (192, 0)
        for too_long, sp in ((ids, SamplingParams(max_tokens=1)), ([*ids, 5], SamplingParams(max_tokens=0))):
            with pytest.raises(PromptTooLong):
                run(engine, too_long, sp)
    finally:
        asyncio.run(engine.shutdown())
