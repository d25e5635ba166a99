"""Recently encoded prompts, per namespace: a repeated request skips the chat template and the tokenizer.

Encoding is a pure function of the tokenizer and its input (the chat messages and tools, or a text
prompt), and on the 2-core Xeon it was the largest cost of a fully cached request: 3-8 ms for a
2,000-token prompt, against ~1 ms for the cache lookup, the stored first token and the response.
So the token ids of recent prompts are kept, keyed like the prefix cache by the request's namespace
(model, tenant, cache salt) and a digest of the exact input (JSON in the client's key order: a
template may iterate a dict in order). Another tenant, or another salt, sending the same prompt
encodes it again: a hit here is no more observable across namespaces, by timing, than a cache hit
(docs/cache.md, "Keys and namespaces"). A cache flush forgets the namespaces it flushes here too.

Bounded by tokens held (4 bytes each), least recently used out.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from prefixserve.types import FlushScope, Namespace

MAX_TOKENS = 1 << 21  # ids held in all (8 MiB)
MIN_TOKENS = 256  # shorter prompts encode in well under a millisecond: not worth an entry


def input_digest(kind: str, *parts: Any) -> bytes | None:
    """A digest of an encoder input: `kind` ("chat", "text") and its JSON parts, in their own order;
    None when a part is not plain JSON (then the input is encoded every time)."""
    try:  # (a lone surrogate fails the encode: a ValueError too)
        data = json.dumps([kind, *parts], ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError):
        return None
    return hashlib.blake2b(data, digest_size=20).digest()


class NotRemembered(Exception):
    """A recall-only memo (`PromptMemo.recall_only`) was asked for a prompt it does not hold."""


class PromptMemo:
    """Thread-safe (requests are prepared in a thread pool)."""

    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[Namespace, bytes], array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self._encodes = True  # False in a recall-only view

    def recall_only(self) -> PromptMemo:
        """A view of this memo that never encodes: a prompt it does not hold raises NotRemembered.
        The server prepares a request with it on the event loop first, and only on a miss in its
        thread pool (server/openai/routes.py): a thread hop costs ~0.4 ms on an idle 2-core VM, more than
        the rest of a remembered request's preparation. The view shares the entries and never adds."""
        view = copy.copy(self)
        view._encodes = False
        return view

    def ids(self, ns: Namespace, digest: bytes | None, encode: Callable[[], list[int]]) -> list[int]:
        """The token ids of the input `digest` names in `ns`: remembered, or `encode()`d (its
        exceptions pass through, and nothing is remembered). A recall-only view raises NotRemembered
        instead of encoding."""
        if digest is None:
            if not self._encodes:
                raise NotRemembered
            return encode()
        key = (ns, digest)
        with self._lock:
            held = self._entries.get(key)
            if held is not None:
                self._entries.move_to_end(key)
                return held.tolist()
        if not self._encodes:
            raise NotRemembered
        ids = encode()
        if MIN_TOKENS <= len(ids) <= self.max_tokens:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = array("i", ids)
                    self._tokens += len(ids)
                while self._tokens > self.max_tokens:
                    _, old = self._entries.popitem(last=False)
                    self._tokens -= len(old)
        return ids

    def forget(self, scope: FlushScope) -> int:
        """Drop the entries of the namespaces `scope` selects; how many."""
        with self._lock:
            gone = [k for k in self._entries if scope.selects(k[0])]
            for k in gone:
                self._tokens -= len(self._entries.pop(k))
        return len(gone)

    def __len__(self) -> int:
        return len(self._entries)
