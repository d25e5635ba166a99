"""The cache writer: what the engine offers the cache (prompt boundaries, recurrent checkpoints, full
prompts, finished turns), the finished turns it re-feeds first (engine/refill.py), and the tiers'
write-through.

Every insert goes one way: shared KV pieces in RAM (docs/cache.md), then write-through to the disk
and Redis tiers. Finished turns decoded with 4-bit rows are re-fed first (engine/refill.py).
Engine thread only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prefixserve.cache import Hit, Miss, PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.config import EngineConfig
from prefixserve.engine.protocol import TokenizerLike
from prefixserve.engine.refill import TurnRefills
from prefixserve.engine.session import Session, Snapshot
from prefixserve.runner import ModelRunner, SessionState
from prefixserve.runner.pieces import PieceStore
from prefixserve.types import Namespace, lcp

if TYPE_CHECKING:  # only a shared tier's server imports it (and redis with it, 0.2 s)
    from prefixserve.cache.shared import SharedTier

MIN_BOUNDARY_TOKENS = 16  # shorter common prefixes (a chat template's header) are not worth an entry
KEEP_MIN_TOKENS = 64  # an abandoned prefill is cached only when it computed at least this many tokens
MAX_REFEED_PROMPT = 512  # prompt tokens a hybrid's turn refill may re-feed below where the key leaves the prompt


class CacheWriter:
    """Owns the inserts into the RAM cache, the pending turn refills (`refills`) and the tiers' writes
    (`disk`, `shared`: None when off). Writes nothing where the self-test refused reuse
    (`exact_reuse` False) or caching is off (`max_bytes` 0)."""

    def __init__(self, runner: ModelRunner, tokenizer: TokenizerLike, cache: PrefixCache[Snapshot],
                 config: EngineConfig, exact_reuse: bool, pieces: PieceStore,
                 disk: DiskTier | None = None, shared: SharedTier | None = None) -> None:
        self.exact_reuse = exact_reuse
        self.pieces = pieces  # KV shared between cache entries, stored once (docs/cache.md)
        self.disk = disk  # the disk tier (docs/cache.md), None when off
        self.shared = shared  # the shared tier on Redis (docs/cache.md), None when off
        self.refills = TurnRefills(runner, config.prefill_chunk_tokens,  # finished turns, re-fed
                                   lambda ns, key, st: self.store_steps(ns, key, st))
        self._runner = runner
        self._tokenizer = tokenizer
        self._cache = cache
        self._offer_turns = config.offer_finished_turns

    def _caching(self) -> bool:
        return self.exact_reuse and self._cache.config.max_bytes > 0

    def plan(self, s: Session, hit: Hit[Snapshot] | Miss | None) -> None:
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
        if self._caching():
            s.checkpoints = st.checkpoint_positions(s.prompt_len)

    def after_chunk(self, s: Session, end: int) -> None:
        """A prefill chunk of `s` ended at `end`: keep a checkpoint there, and insert a snapshot-only
        state's boundary entry now (the state is at this length only now, docs/hybrid.md)."""
        st = s.state
        if st is None:
            return
        if end in s.checkpoints:
            st.keep_checkpoint()
        if end == s.boundary < s.prompt_len and not st.truncatable:
            self.insert(s, end)
            s.to_insert.remove(end)

    def flush_inserts(self, s: Session) -> None:
        """Offer the session's state at each pending length (boundary, full prompt) to the cache."""
        if s.state is None:
            s.to_insert.clear()
            return
        for num_tokens in s.to_insert:
            if s.state.truncatable or num_tokens == s.state.num_tokens:  # snapshot-only: its own length only
                self.insert(s, num_tokens)
        s.to_insert.clear()

    def insert(self, s: Session, num_tokens: int) -> None:
        """Offer the session's state after its first `num_tokens` prompt tokens (unless caching is off
        here, or a flush made the session uncacheable)."""
        if not self._caching() or not s.cacheable:
            return
        assert s.state is not None and num_tokens <= s.state.num_tokens
        self.store(s.request.namespace, tuple(s.request.prompt_ids[:num_tokens]), s.state)

    def store(self, ns: Namespace, key: tuple[int, ...], state: SessionState) -> None:
        """Cache `state`'s first len(key) tokens (shared pieces in RAM, write-through to disk and Redis)."""
        for _ in self.store_steps(ns, key, state):
            pass

    def store_steps(self, ns: Namespace, key: tuple[int, ...], state: SessionState) -> Iterator[None]:
        """`store`, pausing after each piece compared or copied (a background turn refill, engine/refill.py);
        `state` must not change until it ends. The entry goes in at the end, in one step."""
        # piece edges at the cached entries on this key's path: their pieces are shared, not copied
        snap = yield from self.pieces.snapshot_steps(state, key, ns, self._cache.entry_lengths(ns, key))
        if self._cache.insert(ns, key, snap).stored:  # hybrid snapshots too: the codec carries their recurrent part
            for tier in (self.disk, self.shared):  # write-through, on each tier's writer thread
                if tier is not None:
                    tier.offer(ns, key, snap)

    def keep_computed(self, s: Session) -> None:
        """A prompt abandoned mid-prefill (its client left): cache what it computed, so the requests that
        waited for it (engine/scheduler.py `Scheduler.follows`) or the client's retry start there, not from scratch.
        KV-only states, exact at any length (a hybrid's checkpoints went in as it prefilled: `after_chunk`)."""
        st = s.state
        if st is None or not st.truncatable or st.num_tokens - s.num_cached < KEEP_MIN_TOKENS:
            return
        if self._cache.get(s.request.namespace, tuple(s.request.prompt_ids[: st.num_tokens])) is None:
            self.insert(s, st.num_tokens)  # unless caching is off here or a flush made the session uncacheable

    def offer_turn(self, s: Session) -> None:
        """Cache prompt + reply so the next turn of the conversation hits its own history.

        Dense decode runs the prefill calls, so the session's state is exact as it is and is cached at
        once, but decode never fed the reply's last sampled token: a refill (engine/refill.py) feeds that
        one by prefill and caches the whole turn. With 4-bit decode rows the reply's KV has other bits
        than a recomputation's: the whole reply is re-fed.
        A reply a client sends back as text is keyed as its next request will hold it (`next_turn_key`):
        from where that differs from what the state holds, it is a refill in either mode (a hybrid's from
        a cached state: its recurrent state cannot go back)."""
        st = s.state
        if not self._offer_turns or st is None or not s.output_ids or not s.cacheable:
            return
        if not self._caching():
            return
        dense = self._runner.decoder.decode_matches_prefill
        ns, prompt = s.request.namespace, tuple(s.request.prompt_ids)
        key = self.next_turn_key(s)
        if key is not None:
            if self._cache.get(ns, key) is not None or self.refills.holds(ns, key):
                return
            fed = prompt + tuple(s.output_ids[: st.num_tokens - s.prompt_len]) if dense else prompt  # exact in st
            same = lcp(key, fed)
            if st.truncatable and same == len(key):  # nothing to re-feed (a reply the history leaves out)
                st.truncate(same)
                self.store(ns, key, st)
            elif st.truncatable:
                self.refills.offer(ns, key, st, same, s.request.continues)
            elif (start := self.resume_state(ns, key, same)) is not None and start.num_tokens < len(key):
                self.refills.offer(ns, key, start, start.num_tokens, s.request.continues)
            return
        turn = prompt + tuple(s.output_ids)
        if self._cache.get(ns, turn) is not None or self.refills.holds(ns, turn):
            return  # this very turn is cached or on its way (a repeated request): a copy or a re-feed would only find it there
        if dense and st.num_tokens > s.prompt_len and self._cache.get(ns, turn[: st.num_tokens]) is None:
            self.store(ns, turn[: st.num_tokens], st)  # exact as it is: cached now, however busy the engine
        # decode never fed the reply's last token (<|im_end|>): a refill feeds it, in the background (dense),
        # or the whole reply (4-bit); under load the oldest pending refill is dropped (engine/refill.py)
        self.refills.offer(ns, turn, st, st.num_tokens if dense else s.prompt_len, s.request.continues)

    def next_turn_key(self, s: Session) -> tuple[int, ...] | None:
        """The turn as its client's next request will hold it, where that is not prompt + sampled reply
        (models/tokenizer.py `next_turn`: the reply's text re-encoded, a chat template's own form); None
        where the sampled tokens serve: the client sends ids, or that cannot be told."""
        if not s.request.text_history or s.state is None:
            return None
        key = self._tokenizer.next_turn(s.request.prompt_ids, s.output_ids, s.request.history)
        return None if key is None or key == tuple(s.request.prompt_ids) + tuple(s.output_ids) else key

    def resume_state(self, ns: Namespace, key: tuple[int, ...], exact: int) -> SessionState | None:
        """A state to re-feed `key` from, for a session whose own cannot go back to `exact`, where the key
        leaves what it holds (a hybrid's recurrent layers): a copy of the cached entry or checkpoint that
        serves most of the key (the prompt's own, inserted as the prompt finished, or one of its recurrent
        checkpoints when the key leaves the prompt: docs/hybrid.md), or a new state for a short key. None
        when that would re-feed more than MAX_REFEED_PROMPT tokens below `exact`. The copy is made at
        once, on the engine thread, so the entry needs no pin."""
        hit = self._cache.peek(ns, key)
        n = hit.num_cached_tokens if isinstance(hit, Hit) else 0
        if exact - n > MAX_REFEED_PROMPT:
            return None
        if not isinstance(hit, Hit):
            return self._runner.new_state(len(key))
        return hit.entry.state.restore(n, len(key) - n, self._runner.kv_pool)
