"""Incremental detokenisation with stop strings, O(1) tokens decoded per step."""

from __future__ import annotations

from prefixserve.engine.protocol import TokenizerLike


class IncrementalDetokenizer:
    """Feeds generated token ids one at a time and yields the text that is safe to emit.

    Text is held back while the decoded tail is an incomplete UTF-8 sequence, and while it could
    still be the start of a stop string (so a stop string is never partly streamed).
    """

    def __init__(self, tokenizer: TokenizerLike, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix:read] decode to text already counted in `text`
        self._read_offset = 0
        self.text = ""  # all text decoded so far (after a stop: cut before the stop string)
        self._emitted = 0  # chars of `text` already handed out
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add one token; returns newly emittable text ('' if none). Sets `stopped` on a stop string."""
        assert not self.stopped
        self._ids.append(token_id)
        prev = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        cur = self._tok.decode(self._ids[self._prefix_offset :])
        if len(cur) <= len(prev) or cur.endswith("\ufffd"):
            return ""
        new = cur[len(prev) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        search_from = max(0, len(self.text) - self._hold)
        self.text += new
        hits = [i for s in self._stop if (i := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self.flush()
        safe = len(self.text) - self._hold
        if safe <= self._emitted:
            return ""
        out = self.text[self._emitted : safe]
        self._emitted = safe
        return out

    def flush(self) -> str:
        """Everything not yet emitted (call when the request finishes)."""
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out
