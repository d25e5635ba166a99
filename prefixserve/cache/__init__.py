"""The exact, namespaced prefix cache: which model state serves the most of a prompt, within one
global LRU byte budget. Pure Python; imports nothing of ours but `prefixserve.types` and
`prefixserve.config`. Driven from one engine thread (no locks)."""

from prefixserve.cache.entry import Entry, FlushResult, Hit, InsertResult, InsertStatus, Miss
from prefixserve.cache.listener import CacheListener
from prefixserve.cache.prefix_cache import PrefixCache
from prefixserve.cache.state import CachedState
from prefixserve.cache.stats import CacheStats

__all__ = [
    "CacheListener",
    "CacheStats",
    "CachedState",
    "Entry",
    "FlushResult",
    "Hit",
    "InsertResult",
    "InsertStatus",
    "Miss",
    "PrefixCache",
]
