"""The shared tier's connection to Redis and its health (docs/cache.md, "Shared tier").

Every Redis call goes through `Link.call`: a failure (down, slow past the socket timeout, full,
refused) returns the caller's default, is counted and logged at most every LOG_EVERY_S, and starts
a back-off (0.25 s doubling to 8 s) during which Redis is not tried at all, so a dead Redis costs
nothing per request. The next call after the back-off is the reconnect attempt; a success ends it.
Thread-safe (redis-py's pool; the health fields under `_lock`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("prefixserve.cache")
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.25, 8.0
LOG_EVERY_S = 30.0
T = TypeVar("T")


class Link:
    def __init__(self, url: str, timeout_s: float) -> None:
        """Connects lazily: a Redis down at start is the same as one that goes down later."""
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._where = url.split("@")[-1]  # never log a password
        self._lock = threading.Lock()
        self.num_errors = 0
        self._backoff_s = 0.0  # 0 = healthy
        self._down_until = 0.0  # monotonic time before which Redis is not tried
        self._last_log = -LOG_EVERY_S

    @property
    def up(self) -> bool:
        return self._backoff_s == 0

    def available(self) -> bool:
        """False during a back-off: the caller skips Redis without waiting."""
        return self._backoff_s == 0 or time.monotonic() >= self._down_until

    def call(self, what: str, fn: Callable[[], T], default: T) -> T:
        """`fn()` (which talks to `self.client`), or `default` in a back-off or when it fails."""
        if not self.available():
            return default
        try:
            result = fn()
        except redis.exceptions.RedisError as e:
            full = isinstance(e, redis.exceptions.ResponseError)  # OOM under noeviction: the link is fine
            with self._lock:
                self.num_errors += 1
                if not full:
                    self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, 2 * self._backoff_s))
                    self._down_until = time.monotonic() + self._backoff_s
            self.warn("redis tier: %s on %s failed (%s: %s); serving from the local tiers",
                      what, self._where, type(e).__name__, e)
            return default
        if self._backoff_s:
            with self._lock:
                self._backoff_s, self._down_until = 0.0, 0.0
            log.info("redis tier: %s is reachable again", self._where)
        return result

    def warn(self, msg: str, *args: Any) -> None:
        """A warning, at most one per LOG_EVERY_S (a dead Redis must not flood the log)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_log < LOG_EVERY_S:
                return
            self._last_log = now
        log.warning(msg, *args)

    def close(self) -> None:
        self.client.close()
