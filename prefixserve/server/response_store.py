"""Finished Responses API responses, kept for `previous_response_id` and GET / DELETE /v1/responses/{id}.

Per tenant (another tenant's id is simply not found), in memory, least recently used first out past
`max_items` responses or `max_chars` characters of stored text in all, taken from the tenant holding
the most; gone when the server restarts. A request with `store: false` is not kept. Each entry holds
the conversation as chat messages up to and including that response's output (its `instructions`
excluded: as OpenAI, a later request's own instructions apply), so a chained request renders the same
history a client re-sending it would, and the prefix cache serves that history as it would then.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_ITEMS = 4096
MAX_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Stored:
    messages: tuple[dict[str, Any], ...]  # the conversation through this response's output, as chat messages
    items: tuple[dict[str, Any], ...]  # the same conversation before the output, as typed input items
    response: dict[str, Any]  # the response object as it was answered
    chars: int


class ResponseStore:
    """Thread-safe: requests are prepared in the thread pool and finished on the event loop.

    The bounds are the server's, shared fairly: past one, the tenant holding the most (responses, or
    characters when that is the bound passed) loses its least recently used response. So a tenant
    storing many responses evicts its own first, and never empties another tenant's store while it
    holds more than that tenant."""

    def __init__(self, max_items: int = MAX_ITEMS, max_chars: int = MAX_CHARS) -> None:
        self.max_items = max_items
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._tenants: dict[str, OrderedDict[str, Stored]] = {}  # each tenant's, least recently used first
        self._tenant_chars: dict[str, int] = {}
        self._count = 0
        self._chars = 0

    def put(self, tenant_id: str, response_id: str, messages: list[dict[str, Any]],
            items: tuple[dict[str, Any], ...], response: dict[str, Any]) -> None:
        chars = sum(len(json.dumps(part, default=str)) for part in (messages, items, response))
        if chars > self.max_chars:
            return
        with self._lock:
            self._pop(tenant_id, response_id)
            self._tenants.setdefault(tenant_id, OrderedDict())[response_id] = Stored(tuple(messages), items, response,
                                                                                    chars)
            self._tenant_chars[tenant_id] = self._tenant_chars.get(tenant_id, 0) + chars
            self._count += 1
            self._chars += chars
            while self._count > self.max_items or self._chars > self.max_chars:
                by_chars = self._chars > self.max_chars
                victim = max(self._tenants, key=lambda t: self._tenant_chars[t] if by_chars else len(self._tenants[t]))
                self._pop(victim, next(iter(self._tenants[victim])))

    def get(self, tenant_id: str, response_id: str) -> Stored | None:
        with self._lock:
            own = self._tenants.get(tenant_id)
            if own is None or response_id not in own:
                return None
            own.move_to_end(response_id)
            return own[response_id]

    def find_item(self, tenant_id: str, item_id: str) -> dict[str, Any] | None:
        """The input or output item `item_id` of one of the tenant's stored responses (an `item_reference`),
        the most recently used first."""
        with self._lock:
            for stored in reversed(self._tenants.get(tenant_id, OrderedDict()).values()):
                for item in (*stored.response["output"], *stored.items):
                    if item.get("id") == item_id:
                        return item
        return None

    def delete(self, tenant_id: str, response_id: str) -> bool:
        with self._lock:
            return self._pop(tenant_id, response_id)

    def __len__(self) -> int:
        return self._count

    def _pop(self, tenant_id: str, response_id: str) -> bool:
        own = self._tenants.get(tenant_id)
        gone = None if own is None else own.pop(response_id, None)
        if gone is None:
            return False
        self._count -= 1
        self._chars -= gone.chars
        self._tenant_chars[tenant_id] -= gone.chars
        if not own:
            del self._tenants[tenant_id], self._tenant_chars[tenant_id]
        return True
