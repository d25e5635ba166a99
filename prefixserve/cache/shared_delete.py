"""Deleting from the shared tier (cache/shared.py): a flush's batches, and a write that landed after
a flush of its namespace. Key names: cache/shared_keys.py."""

from __future__ import annotations

from typing import Any


def delete_keys(client: Any, keys: list[bytes]) -> tuple[int, int]:
    """(values deleted, their bytes) of `keys`; length indexes and markers are deleted too, not counted."""
    if not keys:
        return 0, 0
    values = [k for k in keys if not k.endswith(b":len") and b":p:" not in k]
    pipe = client.pipeline(transaction=False)
    for k in values:
        pipe.strlen(k)
    sizes = pipe.execute()
    client.unlink(*keys)
    return len(values), sum(int(s) for s in sizes)


def unwrite(client: Any, key: str, markers: list[str], len_key: str, length: int) -> None:
    """Undo a write that landed after a flush of its namespace: its value, the markers that still
    name it (another entry's are kept) and its length in the namespace's index (another entry of that
    length, written since, is then found by its markers only: a miss at worst, never a wrong hit)."""
    pipe = client.pipeline(transaction=False)
    pipe.delete(key)
    for marker in markers:
        pipe.get(marker)
    named = pipe.execute()[1:]
    pipe = client.pipeline(transaction=False)
    for marker, value in zip(markers, named, strict=True):
        if value == key.encode():
            pipe.delete(marker)
    pipe.zrem(len_key, str(length))
    pipe.execute()
