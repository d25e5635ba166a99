"""Which prompt tokens a step feeds (Scheduler.prefill_plan, engine/scheduler.py): a prompt that can finish goes first,
a long prompt's chunks shrink deep into it so steps stay short, and it is never starved.

The runner's step is replaced by one that only advances the states (no model arithmetic): what is
checked is the schedule, and chunking never changes a bit (tests/runner/test_exactness.py)."""

from __future__ import annotations

import uuid

import torch

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import EngineCore
from prefixserve.engine.scheduler import CHUNK_GRAIN, LONE_CONTEXT_KEYS, LONG_CONTEXT_KEYS, SHARED_GRAIN
from prefixserve.types import Namespace, Request, SamplingParams
from tests.conftest import load_embedded

CHUNK = 256


class Recorder:
    """Stands in for ModelRunner.step: consumes the tokens, gives flat logits, records (id, count)."""

    def __init__(self, runner, vocab: int) -> None:
        self.runner = runner
        self.vocab = vocab
        self.steps: list[dict[int, int]] = []

    def __call__(self, items) -> None:
        fed: dict[int, int] = {}
        for it in items:
            it.state.reserve(it.state.num_tokens + len(it.token_ids))
            it.state.num_tokens += len(it.token_ids)
            it.state.logits = torch.zeros(self.vocab) if it.want_logits else None
            fed[id(it.state)] = fed.get(id(it.state), 0) + len(it.token_ids)
        self.steps.append(fed)


def make_core(monkeypatch):
    model, runner = load_embedded("int4")
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=0)),
                      EngineConfig(prefill_chunk_tokens=CHUNK, max_batch_tokens=2 * CHUNK), 16384, lambda r, d: None)
    rec = Recorder(runner, model.arch.vocab_size)
    monkeypatch.setattr(runner, "step", rec)
    return core, rec


def request(n: int, seed: int, max_tokens: int = 2) -> Request:
    ids = torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Request(uuid.uuid4().hex, Namespace("smol", "t"), tuple(ids),
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def session_of(core: EngineCore, req: Request):
    return next(s for s in core.running if s.request is req)


def test_a_long_prompt_alone_shrinks_its_chunks_as_its_keys_grow(monkeypatch):
    """Alone, a prompt runs full chunks up to LONE_CONTEXT_KEYS keys (nobody waits for its steps but a
    newcomer, for one), past that its chunks shrink by grains within that work."""
    core, rec = make_core(monkeypatch)
    n = 16000
    long = request(n, 1)
    core.add(long)
    chunks: list[tuple[int, int]] = []  # (start, rows)
    done = 0
    while done < n:
        core.step()
        (fed,) = rec.steps[-1].values()
        chunks.append((done, fed))
        done += fed
    for start, rows in chunks[:-1]:
        assert rows % CHUNK_GRAIN == 0 and rows >= CHUNK_GRAIN
        assert rows * (start + rows) <= CHUNK * LONE_CONTEXT_KEYS
        if (start + CHUNK) <= LONE_CONTEXT_KEYS:
            assert rows == CHUNK  # full chunks while within the lone work
    assert chunks[-2][1] == CHUNK - 2 * CHUNK_GRAIN  # deep in the prompt: shrunk


def test_a_short_prompt_arriving_mid_prefill_finishes_in_the_next_step(monkeypatch):
    core, rec = make_core(monkeypatch)
    long = request(6000, 2)
    core.add(long)
    for _ in range(20):
        core.step()
    short = request(300, 3)  # more than one chunk: it still goes first once it can finish in a step
    core.add(short)
    core.step()
    s = session_of(core, short)
    assert s.num_computed == CHUNK  # its first chunk, beside the long prompt's
    core.step()
    assert s.num_computed == 300 and s.output_ids  # done and its first token out
    assert rec.steps[-1][id(session_of(core, long).state)] >= SHARED_GRAIN


def test_short_prompts_filling_the_budget_never_starve_the_long_one(monkeypatch):
    core, rec = make_core(monkeypatch)
    long = request(3000, 4)
    core.add(long)
    core.step()
    for k in range(6):
        core.add(request(200, 10 + k))
    before = session_of(core, long).num_computed
    core.step()
    assert session_of(core, long).num_computed - before >= SHARED_GRAIN
    assert sum(rec.steps[-1].values()) <= 2 * CHUNK


def test_a_long_prompt_sharing_steps_with_a_decoder_takes_a_quarter_of_the_work(monkeypatch):
    """While another session decodes, each step's long-prompt chunk does at most a quarter of the
    attention work of a lone one (so the decoder's tokens, and a newcomer's first, wait less); alone
    again, it goes back to full chunks."""
    core, _rec = make_core(monkeypatch)
    long = request(6000, 5)
    core.add(long)
    for _ in range(8):
        core.step()
    talker = request(20, 6, max_tokens=40)
    core.add(talker)
    core.step()  # the short prompt finishes and starts decoding
    ls = session_of(core, long)
    shared = []
    while any(s.request is talker for s in core.running):
        start = ls.num_computed
        core.step()
        shared.append((start, ls.num_computed - start))
    assert len(shared) >= 30
    for start, rows in shared:
        assert rows >= SHARED_GRAIN
        assert rows == SHARED_GRAIN or rows * (start + rows) <= CHUNK * LONG_CONTEXT_KEYS // 4
    assert shared[-1][1] < CHUNK_GRAIN  # deep enough that the quarter bites
    start = ls.num_computed
    core.step()
    alone = ls.num_computed - start
    assert alone >= CHUNK_GRAIN and alone > shared[-1][1]
