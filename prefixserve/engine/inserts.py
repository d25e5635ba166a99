"""What the engine offers the cache: prompt boundaries, full prompts, finished turns.

Every insert goes one way: shared KV pieces in RAM (docs/cache.md), then write-through to the disk
and Redis tiers. Finished turns decoded with 4-bit rows are re-fed first (engine/refill.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixserve.engine.session import Session
from prefixserve.runner import SessionState
from prefixserve.types import Namespace

if TYPE_CHECKING:
    from prefixserve.engine.core import EngineCore


def flush_inserts(core: EngineCore, s: Session) -> None:
    """Offer the session's state at each pending length (boundary, full prompt) to the cache."""
    if s.state is None:
        s.to_insert.clear()
        return
    for num_tokens in s.to_insert:
        if s.state.truncatable or num_tokens == s.state.num_tokens:  # snapshot-only: its own length only
            insert(core, s, num_tokens)
    s.to_insert.clear()


def insert(core: EngineCore, s: Session, num_tokens: int) -> None:
    """Offer the session's state after its first `num_tokens` prompt tokens (unless caching is off
    here, or a flush made the session uncacheable)."""
    if not core.exact_reuse or core.cache.config.max_bytes == 0 or not s.cacheable:
        return
    assert s.state is not None and num_tokens <= s.state.num_tokens
    store(core, s.request.namespace, tuple(s.request.prompt_ids[:num_tokens]), s.state)


def store(core: EngineCore, ns: Namespace, key: tuple[int, ...], state: SessionState) -> None:
    """Cache `state`'s first len(key) tokens (shared pieces in RAM, write-through to disk and Redis)."""
    # piece edges at the cached entries on this key's path: their pieces are shared, not copied
    snap = core.pieces.snapshot(state, key, ns, core.cache.entry_lengths(ns, key))
    if core.cache.insert(ns, key, snap).stored and snap.truncatable:  # no hybrid files or values yet
        for tier in (core.disk, core.shared):  # write-through, on each tier's writer thread
            if tier is not None:
                tier.offer(ns, key, snap)


def offer_turn(core: EngineCore, s: Session) -> None:
    """Cache prompt + reply so the next turn of the conversation hits its own history.

    Dense decode runs the prefill calls, so the session's state is exact as it is (the reply's
    last token was never fed). With 4-bit decode rows the reply's KV has other bits than a
    recomputation's: the state goes to `core.refills` (engine/refill.py) to be re-fed by prefill."""
    st = s.state
    if not core.config.offer_finished_turns or st is None or not s.output_ids or not s.cacheable:
        return
    if not core.exact_reuse or core.cache.config.max_bytes == 0:
        return
    if core.runner.decoder.decode_matches_prefill:
        if st.num_tokens > s.prompt_len:
            ids = tuple(s.request.prompt_ids) + tuple(s.output_ids[: st.num_tokens - s.prompt_len])
            store(core, s.request.namespace, ids, st)
        return
    core.refills.offer(s.request.namespace, tuple(s.request.prompt_ids) + tuple(s.output_ids), st, s.prompt_len)
