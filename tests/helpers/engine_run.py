"""Engine-level test helpers: run one request to its end, check a cached state bit for bit against
a fresh prefill of its tokens, and the reply ids a text client sends back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prefixserve.engine import AsyncEngine
from prefixserve.types import Delta, Request, Usage


async def collect_to_last(engine: AsyncEngine, req: Request) -> tuple[list[int], Delta]:
    """The token ids the request generated and its last Delta (finish reason, error, usage)."""
    out: list[int] = []
    last = None
    async for d in engine.generate(req):
        out += d.token_ids
        last = d
    assert last is not None
    return out, last


async def collect(engine: AsyncEngine, req: Request) -> tuple[list[int], Usage]:
    """The token ids the request generated and its final usage."""
    out: list[int] = []
    usage = None
    async for d in engine.generate(req):
        out += d.token_ids
        usage = d.usage or usage
    assert usage is not None
    return out, usage


def assert_fresh_prefill(runner: Any, snapshot: Any, tokens: Sequence[int], chunk: int) -> None:
    """`snapshot` (a cache entry's state) holds exactly what prefilling `tokens` gives: its KV, and a
    hybrid's recurrent state too."""
    n = len(tokens)
    fresh = runner.new_state()
    runner.prefill(fresh, list(tokens), chunk)
    restored = snapshot.restore(n, 0)
    assert torch.equal(restored.kv[..., :n, :], fresh.kv[..., :n, :])
    rec = getattr(restored, "rec", None)
    for name in ("conv", "cell", "delta") if rec is not None else ():
        assert torch.equal(getattr(rec, name), getattr(fresh.rec, name)), name


def echoed(tok: Any, prompt_ids: Sequence[int], reply_ids: Sequence[int]) -> tuple[int, ...] | None:
    """The reply's ids as they follow the prompt in a client's next request that sends the reply back
    as text (a template that writes it right after its generation prompt): `next_turn` less the prompt."""
    turn = tok.next_turn(prompt_ids, reply_ids)
    return None if turn is None else turn[len(prompt_ids):]
