"""Random operation sequences against a naive reference model of the cache.

The model keeps its entries in a list (least recently used first), recomputes bytes from scratch
(shared storage once) and serves lookups by brute force over every entry of the namespace.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass

from cache_fakes import NS_A, NS_A_SALT, NS_B, FakeState, kv, make_cache, snap
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixserve.cache import Entry, Hit, InsertStatus, Miss
from prefixserve.types import Namespace

MAX_BYTES = 150
SHARED = {"s0": 20, "s1": 35, "s2": 50}  # a storage key always has one size
NAMESPACES = [NS_A, NS_B, NS_A_SALT]
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=7).map(tuple)


def lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def serves(tokens: tuple[int, ...], truncatable: bool, has_logits: bool, prompt: tuple[int, ...],
           points: tuple[int, ...] = ()) -> int:
    """Tokens of `prompt` an entry may serve, straight from the rules (`points`: a snapshot-only
    state's resume points)."""
    common = lcp(tokens, prompt)
    if tokens == prompt and has_logits:
        return len(prompt)
    served = common if common == len(tokens) < len(prompt) else 0
    if truncatable:
        served = max(served, min(common, len(prompt) - 1))
    else:
        served = max([served, *(p for p in points if p <= min(common, len(prompt) - 1))])
    return served


@dataclass(eq=False)
class Ref:
    ns: Namespace
    tokens: tuple[int, ...]
    state: FakeState
    entry: Entry | None = None
    pins: int = 0
    repeated: bool = False  # a prompt equal to its tokens was looked up (Entry.repeated)

    def serves(self, prompt: tuple[int, ...]) -> int:
        return serves(self.tokens, self.state.truncatable, self.state.has_logits, prompt, self.state.resume_points)


def total_bytes(refs: list[Ref], extra: tuple[tuple[Hashable, int], ...] = ()) -> int:
    sizes = {key: n for ref in refs for key, n in ref.state.pieces}
    sizes.update(extra)
    return sum(sizes.values())


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(max_bytes=MAX_BYTES)
        self.model: list[Ref] = []  # least recently used first
        self.pinned: list[Ref] = []  # one item per pin held
        self.num_lookups = self.num_hits = self.num_cached_tokens = 0

    @rule(
        ns=st.sampled_from(NAMESPACES),
        tokens=TOKENS,
        truncatable=st.booleans(),
        logits=st.booleans(),
        logits_bytes=st.sampled_from([0, 0, 15, 40]),
        own=st.integers(0, 80),
        shared=st.lists(st.sampled_from(sorted(SHARED)), unique=True, max_size=2),
        points=st.lists(st.integers(1, 6), unique=True, max_size=3),
    )
    def insert(
        self,
        ns: Namespace,
        tokens: tuple[int, ...],
        truncatable: bool,
        logits: bool,
        logits_bytes: int,
        own: int,
        shared: list[str],
        points: list[int],
    ) -> None:
        pieces = [(k, SHARED[k]) for k in shared]
        if truncatable:
            state = kv(tokens, own, logits=logits, shared=pieces, logits_bytes=logits_bytes if logits else 0)
        else:  # resume points (a hybrid entry's checkpoints) inside the key
            state = snap(tokens, own, logits=logits, shared=pieces, points=sorted(p for p in points if p < len(tokens)))
        expected, new_model = self._model_insert(Ref(ns, tokens, state))
        result = self.cache.insert(ns, list(tokens), state)
        assert result.status is expected
        if result.stored:
            assert result.entry is not None and result.entry.state is state
            new_model[-1].entry = result.entry
        self.model = new_model

    @rule(ns=st.sampled_from(NAMESPACES), tokens=TOKENS)
    def lookup(self, ns: Namespace, tokens: tuple[int, ...]) -> None:
        result = self.cache.lookup(ns, tokens)
        mine = [ref for ref in self.model if ref.ns == ns]
        assert result.lcp_len == max((lcp(ref.tokens, tokens) for ref in mine), default=0)
        best = max((ref.serves(tokens) for ref in mine), default=0)
        self.num_lookups += 1
        if best == 0:
            assert isinstance(result, Miss)
            return
        assert isinstance(result, Hit) and result.num_cached_tokens == best
        (ref,) = [ref for ref in self.model if ref.entry is result.entry]  # cached, identical object
        assert ref.ns == ns and ref.serves(tokens) == best  # same namespace, a compatible match
        if best >= min(len(ref.tokens), len(tokens) - 1):  # served whole (cache/eviction.py): now recent
            self.model.remove(ref)
            self.model.append(ref)
        ref.repeated = ref.repeated or ref.tokens == tokens
        self.num_hits += 1
        self.num_cached_tokens += best

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        ref = data.draw(st.sampled_from(self.model))
        assert ref.entry is not None
        self.cache.pin(ref.entry)
        ref.pins += 1
        self.pinned.append(ref)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        ref = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        assert ref.entry is not None
        self.cache.unpin(ref.entry)
        ref.pins -= 1

    @rule(num_bytes=st.integers(0, 200))
    def evict(self, num_bytes: int) -> None:
        freed = 0
        while freed < num_bytes:
            victim = next((ref for ref in self.model if ref.pins == 0), None)
            if victim is None:
                break
            before = total_bytes(self.model)
            self.model.remove(victim)
            freed += before - total_bytes(self.model)
        assert self.cache.evict(num_bytes) == freed

    @precondition(lambda self: len(self.model) >= 5)
    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.model = []

    @invariant()
    def matches_the_model(self) -> None:
        self.cache.check_integrity()
        assert self.cache.num_bytes == total_bytes(self.model) <= MAX_BYTES
        entries = self.cache.entries()
        assert len(entries) == len(self.model)
        assert all(e is ref.entry for e, ref in zip(entries, self.model))
        for ns in NAMESPACES:
            mine = [ref for ref in self.model if ref.ns == ns]
            assert self.cache.stats_for(ns).num_bytes == total_bytes(mine)
        stats = self.cache.stats()
        assert (stats.num_lookups, stats.num_hits, stats.num_cached_tokens) == (
            self.num_lookups,
            self.num_hits,
            self.num_cached_tokens,
        )
        assert all(ref.entry is not None and ref.entry.num_pins == ref.pins for ref in self.model)
        # logits shed (cache/room.py) exactly where the model sheds them, and the repeats it knows of
        assert all(ref.entry is not None and (ref.entry.has_logits, ref.entry.repeated, ref.entry.state)
                   == (ref.state.has_logits, ref.repeated, ref.state) for ref in self.model)

    def _model_insert(self, new: Ref) -> tuple[InsertStatus, list[Ref]]:
        """What the rules say an insert does: (expected status, the model afterwards)."""
        model = list(self.model)
        old = next((ref for ref in model if ref.ns == new.ns and ref.tokens == new.tokens), None)
        if old is not None:
            model.remove(old)
            model.append(old)
            if not (new.state.has_logits and not old.state.has_logits and old.pins == 0):
                return InsertStatus.ALREADY_PRESENT, model
        if new.state.nbytes > MAX_BYTES:
            return InsertStatus.TOO_LARGE, model
        remaining = [ref for ref in model if ref is not old]
        # logits first (an unpinned KV entry's logits piece, in LRU order), then whole entries
        states = {id(ref): ref.state for ref in remaining}
        for ref in remaining:
            if total_bytes([Ref(r.ns, r.tokens, states[id(r)]) for r in remaining], new.state.pieces) <= MAX_BYTES:
                break
            if (ref.pins == 0 and not ref.repeated and ref.state.truncatable
                    and any(k[0] == "logits" for k, _ in ref.state.pieces)):
                states[id(ref)] = ref.state.without_logits()
        kept = list(remaining)
        while total_bytes([Ref(r.ns, r.tokens, states[id(r)]) for r in kept], new.state.pieces) > MAX_BYTES:
            victim = next((ref for ref in kept if ref.pins == 0), None)
            if victim is None:
                return InsertStatus.NO_ROOM, model
            kept.remove(victim)
        for ref in kept:
            ref.state = states[id(ref)]
        status = InsertStatus.INSERTED if old is None else InsertStatus.REPLACED
        new.repeated = old is not None and old.repeated
        return status, [*kept, new]


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_entries=st.integers(1, 40))
def test_lookup_matches_brute_force_on_long_prompts(seed: int, num_entries: int) -> None:
    """Long keys over a 3-token alphabet: deep trees, long edges, splits anywhere."""
    rng = random.Random(seed)
    cache = make_cache(max_bytes=10**9)
    refs: list[Ref] = []
    bases = [tuple(rng.choices(range(3), k=rng.randint(1, 60))) for _ in range(4)]
    for _ in range(num_entries):
        base = rng.choice(bases)
        tokens = base[: rng.randint(1, len(base))] + tuple(rng.choices(range(3), k=rng.randint(0, 20)))
        make = kv if rng.random() < 0.5 else snap
        state = make(tokens, 10, logits=rng.random() < 0.5)
        if cache.insert(NS_A, tokens, state).stored:
            refs = [ref for ref in refs if ref.tokens != tokens] + [Ref(NS_A, tokens, state)]
    cache.check_integrity()
    for _ in range(30):
        base = rng.choice([ref.tokens for ref in refs] + bases)
        prompt = base[: rng.randint(1, len(base))] + tuple(rng.choices(range(3), k=rng.randint(0, 10)))
        result = cache.lookup(NS_A, prompt)
        assert result.lcp_len == max(lcp(ref.tokens, prompt) for ref in refs)
        best = max(ref.serves(prompt) for ref in refs)
        if best == 0:
            assert isinstance(result, Miss)
        else:
            assert isinstance(result, Hit) and result.num_cached_tokens == best
            entry = result.entry
            assert serves(entry.token_ids, entry.truncatable, entry.has_logits, prompt) == best
    assert cache.lookup(NS_B, refs[0].tokens) == Miss(0)
