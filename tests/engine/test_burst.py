"""A burst of requests opening with one new system prompt computes it once (engine/admission.py
`follows`): the first prefills it, the others wait for its entry and hit it; answers are the
cache-less engine's. Never across namespaces, and not for a prefix too short to be worth a wait."""

from __future__ import annotations

import asyncio

import pytest

from prefixserve.types import Namespace
from tests.engine.test_engine_cache import SYSTEM, chat, make_engine, run

pytestmark = pytest.mark.slow
USERS = ["Can I return a jacket after 30 days?", "What about clearance shoes?", "Do you offer store credit?",
         "Can I return a jacket after 30 days?"]


def test_a_burst_with_one_new_system_prompt_computes_it_once():
    cached, plain = make_engine(1 << 30), make_engine(0)
    tok = cached.tokenizer
    prompts = [chat(tok, u) for u in USERS]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)
    a, b = Namespace("smol", "tenant-a"), Namespace("smol", "tenant-b")

    async def go():
        burst = await asyncio.gather(*(run(cached, p, a) for p in prompts))  # all at once, one namespace
        computed_before = cached.core.counters.num_computed_prompt_tokens
        others = await asyncio.gather(*(run(cached, p, ns) for p, ns in zip(prompts[:2], (b, Namespace("smol", "tenant-c")))))
        computed_others = cached.core.counters.num_computed_prompt_tokens - computed_before
        refs = [await run(plain, p, a) for p in prompts]
        await cached.shutdown()
        await plain.shutdown()
        return burst, others, computed_others, refs

    burst, others, computed_others, refs = asyncio.run(go())
    cached_counts = [u.cached_tokens for _, u in burst]
    assert cached_counts[0] == 0  # the first computes the system prompt
    assert all(c >= shared for c in cached_counts[1:3])  # the others were served it
    assert cached_counts[3] == len(prompts[3])  # the same prompt as the first: a full hit
    assert [out for out, _ in burst] == [out for out, _ in refs]  # waiting never changes an answer
    # two tenants' bursts never wait for each other: each computes its own prompt in full
    assert [u.cached_tokens for _, u in others] == [0, 0] and computed_others == len(prompts[0]) + len(prompts[1])
    assert cached.core.cache.check_integrity() is None


def test_a_short_shared_prefix_does_not_wait():
    """Two prompts sharing only the chat template's opening: the second starts at once (both compute
    in full), since the first's entry would serve it less than FOLLOW_MIN_TOKENS."""
    cached = make_engine(1 << 30)
    tok = cached.tokenizer
    ns = Namespace("smol", "tenant-a")
    prompts = [tok.render_chat([{"role": "user", "content": SYSTEM}]),
               tok.render_chat([{"role": "user", "content": "Hello there, who are you?"}])]

    async def go():
        out = await asyncio.gather(*(run(cached, p, ns) for p in prompts))
        await cached.shutdown()
        return out

    assert [u.cached_tokens for _, u in asyncio.run(go())] == [0, 0]


def test_a_prompt_abandoned_mid_prefill_keeps_what_it_computed():
    """QA: a burst's first request cancelled 1 s into a long prefill left nothing cached, so the next
    waiting request computed the prompt again from the start. What an abandoned prefill computed is
    cached (a KV state is exact at any length), and the retry starts there, answering as a cache-less
    engine does."""
    cached, plain = make_engine(1 << 30), make_engine(0)
    tok = cached.tokenizer
    prompt = tok.render_chat([{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": USERS[0]}])
    ns = Namespace("smol", "tenant-a")

    async def go():
        import uuid

        from prefixserve.types import Request, SamplingParams
        gen = cached.generate(Request(uuid.uuid4().hex, ns, tuple(prompt), SamplingParams(max_tokens=4, temperature=0.0)))
        await gen.__anext__()  # admitted: its prefill has started
        for _ in range(400):  # until it computed a few chunks
            if cached.core.counters.num_computed_prompt_tokens >= 256:
                break
            await asyncio.sleep(0.005)
        await gen.aclose()  # the client leaves mid-prefill
        retry = await run(cached, prompt, ns)
        ref = await run(plain, prompt, ns)
        await cached.shutdown()
        await plain.shutdown()
        return retry, ref

    (out, usage), (ref, _) = asyncio.run(go())
    assert 256 <= usage.cached_tokens < len(prompt) and out == ref
    assert cached.core.cache.check_integrity() is None
