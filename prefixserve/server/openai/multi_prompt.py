"""Several engine requests answered as one response: /v1/completions with a list of prompts.

Prompt k's choices become choices k * n .. k * n + n - 1 (OpenAI's order), and every Delta carries
the usage summed over the prompts reported so far, so the last Delta carries the request's total.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import anyio

from prefixserve.engine.protocol import EngineClient
from prefixserve.server.openai.streaming import aclose_shielded
from prefixserve.types import Delta, Request, Usage


@dataclass(slots=True)
class Usages:
    """The latest usage of each request of one response, as `generate_all` saw them."""

    seen: list[Usage | None] = field(default_factory=list)

    async def final(self, engine: EngineClient, requests: Sequence[Request]) -> Usage | None:
        """The response's usage after its iterator was closed early: for each request the engine's
        abort usage where it has one (worker truth), else the last one seen; None if none is known.
        Waits for the engine even inside a cancelled scope (a disconnect cancels the response task)."""
        usages: list[Usage | None] = []
        with anyio.CancelScope(shield=True):
            for r, seen in zip(requests, self.seen):
                usages.append(await engine.abandoned_usage(r.request_id) or seen)
        return total(usages) if any(u is not None for u in usages) else None


async def generate_all(
    engine: EngineClient, requests: Sequence[Request], usages: Usages | None = None
) -> AsyncIterator[Delta]:
    """The Deltas of every request, interleaved as they come, re-indexed and with summed usage.
    Raises what one request raises (PromptTooLong, an engine failure); closing this iterator closes
    (aborts) every request. `usages` follows each request's latest usage (for `Usages.final`)."""
    usages = usages if usages is not None else Usages()
    usages.seen = [None] * len(requests)
    if len(requests) == 1:
        only = engine.generate(requests[0])
        try:
            async for delta in only:
                if delta.usage is not None:
                    usages.seen[0] = delta.usage
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
                usages.seen[k] = item.usage
            yield replace(item, index=k * requests[k].num_choices + item.index,
                          usage=None if item.usage is None else total(usages.seen))
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
