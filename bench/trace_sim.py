"""Offline cache simulations over a scaled trace: bounds (infinite cache, Belady) and policies.

Two granularities, both counted in prompt tokens served from the cache ("hit tokens"):

- **Blocks** (`simulate_infinite`, `simulate_belady`, `simulate_block_lru`): the cache holds units
  ((tenant, hash id), tokens), each a trace block at the replay's scale. A request is served its
  leading blocks that are cached (ids are chained, so that is its cached prefix); then every block of
  it is cached, and blocks are evicted until the budget (tokens) holds. Belady evicts the block whose
  next use is farthest (never used again first; on a tie the deeper block), the classic optimum for
  equal-sized units: a block's next use is never before its parent's, so the cache stays a set of
  whole prefixes. Block LRU evicts the least recently used block, deeper first within a request: the
  leaf-first LRU of a radix cache at block granularity (SGLang's radix cache, vLLM's block pool).
- **Entries** (`simulate_server`): the real `prefixserve.cache.PrefixCache` driven as the engine
  drives it (engine/cache_writer.py): per request one lookup, then a boundary entry at the prompt's
  longest common prefix with its namespace (>= 16 tokens, unless an entry ends exactly there), the
  full prompt with its logits, and (`turns`) the finished turn, prompt + reply with logits. States
  are stand-ins whose storage mirrors runner/pieces.py: pieces cut at multiples of 64 tokens and at
  the lengths of the entries already cached on the key's path, keyed by (namespace, the prefix they
  end, start), so shared storage counts once exactly as on the server; an entry with logits holds
  them too (fp32, the vocabulary's size) and can shed them as the runner's snapshots do
  (`without_logits`, cache/room.py). Bytes are tokens x the model's KV bytes per token.

Sequential in arrival order: no concurrency (a real server may admit a request before an earlier
one's insert, and pins entries while sessions copy them).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from prefixserve.cache import Hit, PrefixCache
from prefixserve.config import CacheConfig
from prefixserve.types import Namespace

Unit = tuple[Hashable, int]  # (unit key, tokens)
PIECE_TOKENS = 64  # runner/pieces.py PIECE_TOKENS
MIN_BOUNDARY_TOKENS = 16  # engine/cache_writer.py MIN_BOUNDARY_TOKENS


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one simulation served: `hit_tokens` of `prompt_tokens` over `num_requests` requests."""

    name: str
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def working_set_tokens(requests: Sequence[Sequence[Unit]]) -> int:
    """Tokens of all distinct units (each at the largest size it is seen with): what an infinite
    block cache ends up holding."""
    sizes: dict[Hashable, int] = {}
    for units in requests:
        for key, n in units:
            if n > sizes.get(key, 0):
                sizes[key] = n
    return sum(sizes.values())


def _served(units: Sequence[Unit], cached: dict[Hashable, int]) -> int:
    """Tokens of the leading units cached (a unit cached smaller than asked serves what it holds,
    and ends the prefix)."""
    hit = 0
    for key, n in units:
        have = cached.get(key, 0)
        hit += min(have, n)
        if have < n:
            break
    return hit


def simulate_infinite(requests: Sequence[Sequence[Unit]]) -> SimResult:
    """Hit tokens of a cache that never evicts (the bound on any policy at any budget)."""
    cached: dict[Hashable, int] = {}
    hit = total = 0
    for units in requests:
        total += sum(n for _, n in units)
        hit += _served(units, cached)
        for key, n in units:
            if n > cached.get(key, 0):
                cached[key] = n
    return SimResult("infinite", len(requests), total, hit)


def simulate_belady(requests: Sequence[Sequence[Unit]], budget_tokens: int) -> SimResult:
    """Belady's farthest-next-use at block granularity within `budget_tokens` (module docstring)."""
    never = len(requests)
    next_use: list[list[int]] = [[never] * len(units) for units in requests]
    last_seen: dict[Hashable, tuple[int, int]] = {}
    for i in range(len(requests) - 1, -1, -1):
        for d, (key, _) in enumerate(requests[i]):
            seen = last_seen.get(key)
            next_use[i][d] = never if seen is None else seen[0]
            last_seen[key] = (i, d)
    cached: dict[Hashable, int] = {}
    version: dict[Hashable, int] = {}
    heap: list[tuple[int, int, int, Hashable]] = []  # (-next use, -depth, version, key)
    held = hit = total = evictions = 0
    stamp = itertools.count()
    for i, units in enumerate(requests):
        total += sum(n for _, n in units)
        hit += _served(units, cached)
        for d, (key, n) in enumerate(units):
            if n > cached.get(key, 0):
                held += n - cached.get(key, 0)
                cached[key] = n
            v = version[key] = next(stamp)
            heapq.heappush(heap, (-next_use[i][d], -d, v, key))
        while held > budget_tokens:
            _, _, v, key = heapq.heappop(heap)
            if version.get(key) != v:
                continue  # superseded by a later use
            held -= cached.pop(key)
            del version[key]
            evictions += 1
    return SimResult("belady", len(requests), total, hit, evictions)


def simulate_block_lru(requests: Sequence[Sequence[Unit]], budget_tokens: int) -> SimResult:
    """Leaf-first LRU over blocks within `budget_tokens` (module docstring)."""
    lru: OrderedDict[Hashable, int] = OrderedDict()  # least recently used first
    held = hit = total = evictions = 0
    for units in requests:
        total += sum(n for _, n in units)
        hit += _served(units, lru)
        for key, n in reversed(units):  # deepest first, so a request's root ends most recent
            old = lru.pop(key, 0)
            lru[key] = max(old, n)
            held += lru[key] - old
        while held > budget_tokens:
            _, n = lru.popitem(last=False)
            held -= n
            evictions += 1
    return SimResult("block-lru", len(requests), total, hit, evictions)


@dataclass(frozen=True, slots=True)
class _SimState:
    """A stand-in `CachedState`: token count, logits flag and storage pieces, no tensors."""

    num_tokens: int
    has_logits: bool
    pieces: tuple[tuple[Hashable, int], ...]
    truncatable: bool = True

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.pieces)

    def storage(self) -> list[tuple[Hashable, int]]:
        return list(self.pieces)

    def without_logits(self) -> _SimState:
        return _SimState(self.num_tokens, False, tuple(p for p in self.pieces if p[0][0] != "logits"))


@dataclass(frozen=True, slots=True)
class ServerRequest:
    """One request as the engine sees it: tenant, prompt token ids, reply length."""

    tenant: int
    prompt: tuple[int, ...]
    output_tokens: int


class ServerSim:
    """The engine's use of a `PrefixCache` (module docstring), one request at a time."""

    def __init__(self, config: CacheConfig, kv_bytes_per_token: int, logits_bytes: int, turns: bool = True) -> None:
        self.cache: PrefixCache[_SimState] = PrefixCache(config)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.logits_bytes = logits_bytes
        self.turns = turns
        self._logits_ids = itertools.count()
        self._reply_ids = itertools.count(1)

    def run(self, req: ServerRequest) -> int:
        """Serve one request; return the prompt tokens the cache served."""
        ns = Namespace("sim", f"t{req.tenant}")
        prompt = req.prompt
        match = self.cache.lookup(ns, prompt)
        served = match.num_cached_tokens if isinstance(match, Hit) else 0
        at = match.lcp_len
        ends_there = isinstance(match, Hit) and match.entry.num_tokens == at
        if MIN_BOUNDARY_TOKENS <= at < len(prompt) and not ends_there:
            self._insert(ns, prompt[:at], logits=False)
        self._insert(ns, prompt, logits=True)
        if self.turns and req.output_tokens > 0:
            reply = tuple(-next(self._reply_ids) for _ in range(req.output_tokens))  # never in a prompt
            self._insert(ns, prompt + reply, logits=True)
        return served

    def _insert(self, ns: Namespace, key: tuple[int, ...], logits: bool) -> None:
        self.cache.insert(ns, key, self._state(ns, key, logits))

    def _state(self, ns: Namespace, key: tuple[int, ...], logits: bool) -> _SimState:
        edges = set(range(PIECE_TOKENS, len(key), PIECE_TOKENS))
        edges.update(n for n in self.cache.entry_lengths(ns, key) if 0 < n < len(key))
        edges.add(len(key))
        pieces: list[tuple[Hashable, int]] = []
        digest: Hashable = ns
        start = 0
        for end in sorted(edges):
            digest = hash((digest, key[start:end]))  # names the prefix key[:end], whatever the edges
            pieces.append(((ns, digest, start), (end - start) * self.kv_bytes_per_token))
            start = end
        if logits:
            pieces.append((("logits", next(self._logits_ids)), self.logits_bytes))
        return _SimState(len(key), logits, tuple(pieces))


def simulate_server(
    requests: Sequence[ServerRequest],
    config: CacheConfig,
    kv_bytes_per_token: int,
    logits_bytes: int,
    turns: bool = True,
    name: str = "server",
) -> SimResult:
    """Hit tokens of the server's cache (`config`: budget and eviction policy) on `requests`."""
    sim = ServerSim(config, kv_bytes_per_token, logits_bytes, turns)
    hit = total = 0
    for req in requests:
        total += len(req.prompt)
        hit += sim.run(req)
    return SimResult(name, len(requests), total, hit, sim.cache.stats().num_evictions)
