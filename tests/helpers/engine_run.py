"""Engine-level test helpers: run one request to its end, and check a cached state bit for bit
against a fresh prefill of its tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prefixserve.engine import AsyncEngine
from prefixserve.types import Request, Usage


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
