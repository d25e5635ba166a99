"""Incremental detokenisation with stop strings, O(1) tokens decoded per step."""

from __future__ import annotations

from bisect import bisect_left

from prefixserve.engine.protocol import TokenizerLike


class IncrementalDetokenizer:
    """Feeds generated token ids one at a time and yields the text that is safe to emit.

    Text is held back while the decoded tail is an incomplete UTF-8 sequence, and while it could
    still be the start of a stop string (so a stop string is never partly streamed). `num_settled`
    says how many tokens' text is sure to stay, so that their logprobs go out with it, and never for
    the tokens of a stop string that was cut (engine/outputs.py).
    """

    def __init__(self, tokenizer: TokenizerLike, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix:read] decode to text already counted in `text`
        self._read_offset = 0
        self._starts: list[int] = []  # where each added token's text starts in `text`
        self.text = ""  # all text decoded so far (after a stop: cut before the stop string)
        self._emitted = 0  # chars of `text` already handed out
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.stopped = False
        self.finished = False

    def add(self, token_id: int) -> str:
        """Add one token; returns newly emittable text ('' if none). Sets `stopped` on a stop string."""
        assert not self.stopped
        self._ids.append(token_id)
        self._starts.append(len(self.text))
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
            return self._take()
        safe = len(self.text) - self._hold
        if safe <= self._emitted:
            return ""
        out = self.text[self._emitted : safe]
        self._emitted = safe
        return out

    @property
    def num_settled(self) -> int:
        """How many of the added tokens keep their text: those whose text starts before the text
        handed out (a stop string found later is cut after that), all of them once finished, and
        after a stop those that start before the cut (a token that straddles it stays)."""
        if self.finished and not self.stopped:
            return len(self._ids)
        return bisect_left(self._starts, self._emitted)

    def flush(self) -> str:
        """Everything not yet emitted (call when the request finishes). A character the last tokens
        left unfinished comes out as U+FFFD, as vLLM and OpenAI send it, rather than vanish."""
        if not self.stopped and self._read_offset < len(self._ids):
            prev = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
            self.text += self._tok.decode(self._ids[self._prefix_offset :])[len(prev) :]
            self._read_offset = len(self._ids)
        self.finished = True
        return self._take()

    def _take(self) -> str:
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out
