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

    `skip` (open, close): stop strings do not match in text from an `open` to its `close` (or to the
    end while unclosed), tags included: a tool call (server/openai/tools.py) is never cut by a stop string
    meant for the reply's text. A stop string that reaches into a possible start of `open` waits
    until the tag is told apart.
    """

    def __init__(self, tokenizer: TokenizerLike, stop: tuple[str, ...] = (),
                 skip: tuple[str, str] | None = None) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix:read] decode to text already counted in `text`
        self._read_offset = 0
        self._starts: list[int] = []  # where each added token's text starts in `text`
        self.text = ""  # all text decoded so far (after a stop: cut before the stop string)
        self._emitted = 0  # chars of `text` already handed out
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._spans = _Spans(skip) if skip is not None and self._stop else None
        self._deferred: int | None = None  # a stop string's start that waits on a possible `open` tag
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
        if self._deferred is not None:
            search_from = min(search_from, self._deferred)
        self.text += new
        hit = self._first_stop(search_from)
        if hit is not None:
            self.text = self.text[:hit]
            self.stopped = True
            return self._take()
        safe = len(self.text) - self._hold
        if self._deferred is not None:
            safe = min(safe, self._deferred)
        if safe <= self._emitted:
            return ""
        out = self.text[self._emitted : safe]
        self._emitted = safe
        return out

    def _first_stop(self, start: int) -> int | None:
        """Where the first stop string at or after `start` begins (outside `skip`'s spans), if any;
        sets `_deferred` to the first that reaches into a possible open tag at the end."""
        if self._spans is None:
            hits = [i for s in self._stop if (i := self.text.find(s, start)) != -1]
            return min(hits) if hits else None
        self._spans.scan(self.text)
        self._deferred = None
        best = None
        for s in self._stop:
            i = self.text.find(s, start)
            while i != -1 and (best is None or i < best):
                where = self._spans.place(i, i + len(s))
                if where == _OUTSIDE:
                    best = i
                    break
                if where == _UNDECIDED and (self._deferred is None or i < self._deferred):
                    self._deferred = i
                i = self.text.find(s, i + 1)
        if best is not None and self._deferred is not None and self._deferred < best:
            best = None  # an earlier stop string may still count: wait for the tag to be told apart
        return best

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
        if not self.stopped and self._deferred is not None:  # the reply ended before the tag was whole
            self.text, self.stopped = self.text[: self._deferred], True
        self.finished = True
        return self._take()

    def _take(self) -> str:
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out


_OUTSIDE, _INSIDE, _UNDECIDED = 0, 1, 2


class _Spans:
    """The spans of a growing text from an `open` tag to its `close` (tags included), found
    incrementally: text before `scanned` is placed, a tail that is a proper prefix of `open` is not."""

    def __init__(self, skip: tuple[str, str]) -> None:
        self._open, self._close = skip
        self._closed: list[tuple[int, int]] = []
        self._start: int | None = None  # the unclosed span's start
        self._scanned = 0
        self._undecided = 0  # where a possible open tag at the end starts (the text's length if none)

    def scan(self, text: str) -> None:
        while True:
            if self._start is None:
                i = text.find(self._open, self._scanned)
                if i == -1:
                    tail = partial_len(text, self._open)
                    self._undecided = len(text) - tail
                    self._scanned = max(self._scanned, len(text) - len(self._open) + 1)
                    return
                self._start, self._scanned = i, i + len(self._open)
            j = text.find(self._close, self._scanned)
            if j == -1:
                self._scanned = max(self._scanned, len(text) - len(self._close) + 1)
                self._undecided = len(text)
                return
            self._closed.append((self._start, j + len(self._close)))
            self._start, self._scanned = None, j + len(self._close)

    def place(self, start: int, end: int) -> int:
        """Where text[start:end] lies: outside every span, overlapping one, or reaching into an
        undecided tail."""
        if self._start is not None and end > self._start:
            return _INSIDE
        for a, b in reversed(self._closed):
            if b <= start:
                break
            if end > a:
                return _INSIDE
        return _UNDECIDED if self._start is None and end > self._undecided else _OUTSIDE


def partial_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
