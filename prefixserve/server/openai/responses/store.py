"""Finished Responses API responses, kept for `previous_response_id` and GET / DELETE /v1/responses/{id}.

Per tenant (another tenant's id is simply not found), in memory, least recently used first out past
`max_items` responses or `max_chars` characters of stored text in all, taken from the tenant holding
the most. With a `disk` (server/openai/responses/disk.py, `--responses-path`) every change is mirrored to a
SQLite file, read back when the server starts, so stored responses survive a restart; without one
they are gone then. A request with `store: false` is not kept, in memory or on disk. Each entry holds
the conversation as chat messages up to and including that response's output (its `instructions`
excluded: as OpenAI, a later request's own instructions apply), so a chained request renders the same
history a client re-sending it would, and the prefix cache serves that history as it would then.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixserve.server.openai.responses.disk import ResponseDisk, open_disk

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
    holds more than that tenant. The same bounds hold for the disk, which mirrors memory: a response
    evicted or deleted here is deleted there, in the same order."""

    def __init__(self, max_items: int = MAX_ITEMS, max_chars: int = MAX_CHARS, disk: ResponseDisk | None = None) -> None:
        """With `disk`, its responses are loaded (least recently used first, under these bounds: a file
        written under larger ones loses the excess now, as memory would have)."""
        self.max_items = max_items
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._tenants: dict[str, OrderedDict[str, Stored]] = {}  # each tenant's, least recently used first
        self._tenant_chars: dict[str, int] = {}
        self._count = 0
        self._chars = 0
        self._disk = disk
        self._clock = 0  # recency on disk: each put and get takes the next value
        if disk is not None:
            with self._lock:
                for row in disk.load():
                    self._clock = max(self._clock, row.used)
                    stored = Stored(tuple(row.messages), tuple(row.items), row.response, row.chars)
                    if row.chars > max_chars:
                        disk.delete(row.tenant_id, row.response_id)
                    else:
                        self._insert(row.tenant_id, row.response_id, stored)

    def put(self, tenant_id: str, response_id: str, messages: list[dict[str, Any]],
            items: tuple[dict[str, Any], ...], response: dict[str, Any]) -> None:
        texts = (json.dumps(messages, default=str), json.dumps(items, default=str), json.dumps(response, default=str))
        chars = sum(len(t) for t in texts)
        if chars > self.max_chars:
            return
        with self._lock:
            if self._disk is not None:  # queued in O(1), before the evictions this put causes
                self._clock += 1
                self._disk.put(tenant_id, response_id, self._clock, texts)
            self._insert(tenant_id, response_id, Stored(tuple(messages), items, response, chars))

    def get(self, tenant_id: str, response_id: str) -> Stored | None:
        with self._lock:
            own = self._tenants.get(tenant_id)
            if own is None or response_id not in own:
                return None
            own.move_to_end(response_id)
            if self._disk is not None:
                self._clock += 1
                self._disk.touch(tenant_id, response_id, self._clock)
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

    def flush(self, timeout: float = 5.0) -> None:
        """Block until every change so far is committed to the disk (none without one)."""
        if self._disk is not None:
            self._disk.flush(timeout)

    def close(self) -> None:
        """Commit what is queued for the disk and stop its writer; memory keeps answering."""
        if self._disk is not None:
            self._disk.close()

    def _insert(self, tenant_id: str, response_id: str, stored: Stored) -> None:
        """Under the lock: keep `stored` as the tenant's most recent, then evict past the bounds."""
        self._pop(tenant_id, response_id, forget=False)  # a replaced row is overwritten on disk, not deleted
        self._tenants.setdefault(tenant_id, OrderedDict())[response_id] = stored
        self._tenant_chars[tenant_id] = self._tenant_chars.get(tenant_id, 0) + stored.chars
        self._count += 1
        self._chars += stored.chars
        while self._count > self.max_items or self._chars > self.max_chars:
            by_chars = self._chars > self.max_chars
            victim = max(self._tenants, key=lambda t: self._tenant_chars[t] if by_chars else len(self._tenants[t]))
            self._pop(victim, next(iter(self._tenants[victim])))

    def _pop(self, tenant_id: str, response_id: str, forget: bool = True) -> bool:
        own = self._tenants.get(tenant_id)
        gone = None if own is None else own.pop(response_id, None)
        if gone is None:
            return False
        if forget and self._disk is not None:
            self._disk.delete(tenant_id, response_id)
        self._count -= 1
        self._chars -= gone.chars
        self._tenant_chars[tenant_id] -= gone.chars
        if not own:
            del self._tenants[tenant_id], self._tenant_chars[tenant_id]
        return True


def open_response_store(max_items: int, path: str | Path | None, flag: str = "--responses-path") -> ResponseStore | None:
    """The server's store: None when it keeps no responses (`max_items` 0, nothing written), in memory only
    without a `path`, else mirrored to the file there (a ValueError naming `flag` and the path when it
    cannot be opened: server/run.py turns it into one line and exit status 2)."""
    if not max_items:
        return None
    if not path:
        return ResponseStore(max_items)
    disk = open_disk(path, flag)
    try:
        return ResponseStore(max_items, disk=disk)
    except sqlite3.Error as e:  # a file damaged below the rows (a malformed page): not one to write into
        disk.close()
        raise ValueError(f"{flag} {path}: cannot read the stored responses: {e}") from None
