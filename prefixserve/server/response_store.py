"""Finished Responses API responses, kept for `previous_response_id` and GET / DELETE /v1/responses/{id}.

Per tenant (another tenant's id is simply not found), in memory, least recently used first out past
`max_items` responses or `max_chars` characters of stored text; gone when the server restarts. A
request with `store: false` is not kept. Each entry holds the conversation as chat messages up to
and including that response's output (its `instructions` excluded: as OpenAI, a later request's own
instructions apply), so a chained request renders the same history a client re-sending it would, and
the prefix cache serves that history as it would then.
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
    """Thread-safe: requests are prepared in the thread pool and finished on the event loop."""

    def __init__(self, max_items: int = MAX_ITEMS, max_chars: int = MAX_CHARS) -> None:
        self.max_items = max_items
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self._chars = 0

    def put(self, tenant_id: str, response_id: str, messages: list[dict[str, Any]],
            items: tuple[dict[str, Any], ...], response: dict[str, Any]) -> None:
        chars = sum(len(json.dumps(part, default=str)) for part in (messages, items, response))
        if chars > self.max_chars:
            return
        with self._lock:
            self._pop((tenant_id, response_id))
            self._items[(tenant_id, response_id)] = Stored(tuple(messages), items, response, chars)
            self._chars += chars
            while len(self._items) > self.max_items or self._chars > self.max_chars:
                self._pop(next(iter(self._items)))

    def get(self, tenant_id: str, response_id: str) -> Stored | None:
        with self._lock:
            found = self._items.get((tenant_id, response_id))
            if found is not None:
                self._items.move_to_end((tenant_id, response_id))
            return found

    def find_item(self, tenant_id: str, item_id: str) -> dict[str, Any] | None:
        """The input or output item `item_id` of one of the tenant's stored responses (an `item_reference`),
        the most recently stored first."""
        with self._lock:
            for (tenant, _), stored in reversed(self._items.items()):
                if tenant == tenant_id:
                    for item in (*stored.response["output"], *stored.items):
                        if item.get("id") == item_id:
                            return item
        return None

    def delete(self, tenant_id: str, response_id: str) -> bool:
        with self._lock:
            return self._pop((tenant_id, response_id))

    def __len__(self) -> int:
        return len(self._items)

    def _pop(self, key: tuple[str, str]) -> bool:
        gone = self._items.pop(key, None)
        if gone is not None:
            self._chars -= gone.chars
        return gone is not None
