"""What the engine offers the cache: prompt boundaries, recurrent checkpoints, full prompts,
finished turns.

Every insert goes one way: shared KV pieces in RAM (docs/cache.md), then write-through to the disk
and Redis tiers. Finished turns decoded with 4-bit rows are re-fed first (engine/refill.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prefixserve.cache import Hit, Miss
from prefixserve.engine.session import Session, Snapshot
from prefixserve.runner import SessionState
from prefixserve.types import Namespace, lcp

if TYPE_CHECKING:
    from prefixserve.engine.core import EngineCore

MIN_BOUNDARY_TOKENS = 16  # shorter common prefixes (a chat template's header) are not worth an entry


def plan(core: EngineCore, s: Session, hit: Hit[Snapshot] | Miss | None) -> None:
    """Where the prefill of a restored session stops for the cache. A boundary entry at the prompt's
    longest common prefix with its namespace, or where the state puts it (a snapshot-only state: the
    grid position at or below it, unless the hit already serves that far); and a snapshot-only
    state's recurrent checkpoints, stored with its later snapshots (docs/hybrid.md)."""
    st = s.state
    assert st is not None
    at = st.boundary_at(0 if hit is None else hit.lcp_len)
    served = isinstance(hit, Hit) and (hit.entry.num_tokens == at or (not st.truncatable and at <= s.num_cached))
    if MIN_BOUNDARY_TOKENS <= at < s.prompt_len and not served:
        s.boundary = at
        s.to_insert.append(at)
    if core.exact_reuse and core.cache.config.max_bytes > 0:
        s.checkpoints = st.checkpoint_positions(s.prompt_len)


def after_chunk(core: EngineCore, s: Session, end: int) -> None:
    """A prefill chunk of `s` ended at `end`: keep a checkpoint there, and insert a snapshot-only
    state's boundary entry now (the state is at this length only now, docs/hybrid.md)."""
    st = s.state
    if st is None:
        return
    if end in s.checkpoints:
        st.keep_checkpoint()
    if end == s.boundary < s.prompt_len and not st.truncatable:
        insert(core, s, end)
        s.to_insert.remove(end)


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
    for _ in store_steps(core, ns, key, state):
        pass


def store_steps(core: EngineCore, ns: Namespace, key: tuple[int, ...], state: SessionState) -> Iterator[None]:
    """`store`, pausing after each piece compared or copied (a background turn refill, engine/refill.py);
    `state` must not change until it ends. The entry goes in at the end, in one step."""
    # piece edges at the cached entries on this key's path: their pieces are shared, not copied
    snap = yield from core.pieces.snapshot_steps(state, key, ns, core.cache.entry_lengths(ns, key))
    if core.cache.insert(ns, key, snap).stored:  # hybrid snapshots too: the codec carries their recurrent part
        for tier in (core.disk, core.shared):  # write-through, on each tier's writer thread
            if tier is not None:
                tier.offer(ns, key, snap)


KEEP_MIN_TOKENS = 64  # an abandoned prefill is cached only when it computed at least this many tokens


def keep_computed(core: EngineCore, s: Session) -> None:
    """A prompt abandoned mid-prefill (its client left): cache what it computed, so the requests that
    waited for it (engine/admission.py `follows`) or the client's retry start there, not from scratch.
    KV-only states, exact at any length (a hybrid's checkpoints went in as it prefilled: `after_chunk`)."""
    st = s.state
    if st is None or not st.truncatable or st.num_tokens - s.num_cached < KEEP_MIN_TOKENS:
        return
    if core.cache.get(s.request.namespace, tuple(s.request.prompt_ids[: st.num_tokens])) is None:
        insert(core, s, st.num_tokens)  # unless caching is off here or a flush made the session uncacheable


def offer_turn(core: EngineCore, s: Session) -> None:
    """Cache prompt + reply so the next turn of the conversation hits its own history.

    Dense decode runs the prefill calls, so the session's state is exact as it is and is cached at
    once, but decode never fed the reply's last sampled token: a refill (engine/refill.py) feeds that
    one by prefill and caches the whole turn. With 4-bit decode rows the reply's KV has other bits
    than a recomputation's: the whole reply is re-fed.
    A reply a client sends back as text is keyed as its next request will hold it (`next_turn_key`):
    from where that differs from what the state holds, it is a refill in either mode (a hybrid's from
    a cached state: its recurrent state cannot go back)."""
    st = s.state
    if not core.config.offer_finished_turns or st is None or not s.output_ids or not s.cacheable:
        return
    if not core.exact_reuse or core.cache.config.max_bytes == 0:
        return
    dense = core.runner.decoder.decode_matches_prefill
    ns, prompt = s.request.namespace, tuple(s.request.prompt_ids)
    key = next_turn_key(core, s)
    if key is not None:
        if core.cache.get(ns, key) is not None or core.refills.holds(ns, key):
            return
        fed = prompt + tuple(s.output_ids[: st.num_tokens - s.prompt_len]) if dense else prompt  # exact in st
        same = lcp(key, fed)
        if st.truncatable and same == len(key):  # nothing to re-feed (a reply the history leaves out)
            st.truncate(same)
            store(core, ns, key, st)
        elif st.truncatable:
            core.refills.offer(ns, key, st, same, s.request.continues)
        elif (start := resume_state(core, ns, key, same)) is not None and start.num_tokens < len(key):
            core.refills.offer(ns, key, start, start.num_tokens, s.request.continues)
        return
    turn = prompt + tuple(s.output_ids)
    if core.cache.get(ns, turn) is not None or core.refills.holds(ns, turn):
        return  # this very turn is cached or on its way (a repeated request): a copy or a re-feed would only find it there
    if dense and st.num_tokens > s.prompt_len and core.cache.get(ns, turn[: st.num_tokens]) is None:
        store(core, ns, turn[: st.num_tokens], st)  # exact as it is: cached now, however busy the engine
    # decode never fed the reply's last token (<|im_end|>): a refill feeds it, in the background (dense),
    # or the whole reply (4-bit); under load the oldest pending refill is dropped (engine/refill.py)
    core.refills.offer(ns, turn, st, st.num_tokens if dense else s.prompt_len, s.request.continues)


def next_turn_key(core: EngineCore, s: Session) -> tuple[int, ...] | None:
    """The turn as its client's next request will hold it, where that is not prompt + sampled reply
    (models/tokenizer.py `next_turn`: the reply's text re-encoded, a chat template's own form); None
    where the sampled tokens serve: the client sends ids, or that cannot be told."""
    if not s.request.text_history or s.state is None:
        return None
    key = core.tokenizer.next_turn(s.request.prompt_ids, s.output_ids, s.request.history)
    return None if key is None or key == tuple(s.request.prompt_ids) + tuple(s.output_ids) else key


MAX_REFEED_PROMPT = 512  # prompt tokens a hybrid's turn refill may re-feed below where the key leaves the prompt


def resume_state(core: EngineCore, ns: Namespace, key: tuple[int, ...], exact: int) -> SessionState | None:
    """A state to re-feed `key` from, for a session whose own cannot go back to `exact`, where the key
    leaves what it holds (a hybrid's recurrent layers): a copy of the cached entry or checkpoint that
    serves most of the key (the prompt's own, inserted as the prompt finished, or one of its recurrent
    checkpoints when the key leaves the prompt: docs/hybrid.md), or a new state for a short key. None
    when that would re-feed more than MAX_REFEED_PROMPT tokens below `exact`. The copy is made at
    once, on the engine thread, so the entry needs no pin."""
    hit = core.cache.peek(ns, key)
    n = hit.num_cached_tokens if isinstance(hit, Hit) else 0
    if exact - n > MAX_REFEED_PROMPT:
        return None
    if not isinstance(hit, Hit):
        return core.runner.new_state(len(key))
    return hit.entry.state.restore(n, len(key) - n, core.runner.kv_pool)
