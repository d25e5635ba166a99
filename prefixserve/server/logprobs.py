"""Engine `TokenLogprob`s in OpenAI's two logprobs shapes.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}``. Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}``; as in vLLM, each top_logprobs dict also holds the sampled token.

A token's text is the tokenizer's decoding of that one id, and `bytes` its UTF-8 encoding; a
byte-level token that is only part of a character decodes to U+FFFD (so its bytes are those of
U+FFFD, not the raw byte).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixserve.engine.protocol import TokenizerLike
from prefixserve.types import TokenLogprob


class LogprobRenderer:
    """Token texts for one response (decoded once per id and remembered)."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tok = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self._tok.decode([token_id])
        return self._texts[token_id]

    def chat(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._chat_entry(e) for e in entries], "refusal": None}

    def completion(self, entries: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
        """`text_offset`: where the first entry's text starts in the choice's text."""
        tokens = [self.text(e.token_id) for e in entries]
        offsets: list[int] = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        tops = []
        for e in entries:
            top = {self.text(i): v for i, v in e.top}
            top.setdefault(self.text(e.token_id), e.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def prompt(self, first_id: int, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """An echoed prompt's part of a completions choice's logprobs: `first_id` (no logprob: null, as
        OpenAI) then `entries`, the prompt's other tokens, offsets from the start of the text."""
        first = self.text(first_id)
        rest = self.completion(entries, len(first))
        return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        item = self._item(e.token_id, e.logprob)
        item["top_logprobs"] = [self._item(i, v) for i, v in e.top]
        return item

    def _item(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
