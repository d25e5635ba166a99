"""Several engine requests answered as one response: /v1/completions with a list of prompts.

Prompt k's choices become choices k * n .. k * n + n - 1 (OpenAI's order), and every Delta carries
the usage summed over the prompts reported so far, so the last Delta carries the request's total.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from prefixserve.engine.protocol import EngineClient
from prefixserve.server.streaming import aclose_shielded
from prefixserve.types import Delta, Request, Usage


async def generate_all(engine: EngineClient, requests: Sequence[Request]) -> AsyncIterator[Delta]:
    """The Deltas of every request, interleaved as they come, re-indexed and with summed usage.
    Raises what one request raises (PromptTooLong, an engine failure); closing this iterator closes
    (aborts) every request."""
    if len(requests) == 1:
        only = engine.generate(requests[0])
        try:
            async for delta in only:
                yield delta
        finally:  # closing this iterator closes (aborts) the engine's at once, not at garbage collection
            await aclose_shielded(only)
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
    iters = [engine.generate(r) for r in requests]

    async def pump(k: int, it: AsyncIterator[Delta]) -> None:
        try:
            async for delta in it:
                await queue.put((k, delta))
            await queue.put((k, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((k, e))

    tasks = [asyncio.ensure_future(pump(k, it)) for k, it in enumerate(iters)]
    usages: list[Usage | None] = [None] * len(requests)
    num_live = len(requests)
    try:
        while num_live:
            k, item = await queue.get()
            if item is None:
                num_live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.usage is not None:
                usages[k] = item.usage
            yield replace(item, index=k * requests[k].num_choices + item.index,
                          usage=None if item.usage is None else total(usages))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in iters:
            await aclose_shielded(it)


def total(usages: Sequence[Usage | None]) -> Usage:
    """Prompt, completion and cached tokens summed over the requests (None: nothing reported yet)."""
    known = [u for u in usages if u is not None]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in known),
                 completion_tokens=sum(u.completion_tokens for u in known),
                 cached_tokens=sum(u.cached_tokens for u in known))
