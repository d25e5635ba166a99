"""Engine `TokenLogprob`s in OpenAI's two logprobs shapes.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}``. Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}``; as in vLLM, each top_logprobs dict also holds the sampled token.

A token's `bytes` are its raw bytes (`TokenizerLike.token_bytes`), so a byte-level token that is only
part of a UTF-8 character (an emoji's first two bytes) keeps them, and the content tokens' bytes joined
are the content's UTF-8, which is what OpenAI's `bytes` are for. Its `token` string is those bytes as
UTF-8 where they are valid, else OpenAI's legacy spelling ``bytes:\\xf0\\x9f``: distinct byte tokens
stay distinct keys of a completions top_logprobs dict. A completions `text_offset` counts the
characters the tokens before it decode to (an unfinished character not yet counted), so offsets
index into the choice's text and never pass its end, as OpenAI's and vLLM's do.

A control token (`<|im_end|>`, `<|endoftext|>`) has no text in a generated reply (decoding skips it) but
is named, `token` and `bytes`, by its spelling, as vLLM names it: every such token was `""`, so several in
one completions top_logprobs dict overwrote each other, and a chat entry could not be told apart. An
echoed prompt keeps its control tokens in its text (what the client sent), and its offsets count them.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

from prefixserve.engine.protocol import TokenizerLike
from prefixserve.types import TokenLogprob


def token_string(raw: bytes) -> str:
    """`raw` decoded, or ``bytes:\\xNN...`` when it is not valid UTF-8 on its own."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class LogprobRenderer:
    """Token texts for one response (computed once per id and remembered)."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tok = tokenizer
        self._raw: dict[int, bytes] = {}

    def raw(self, token_id: int) -> bytes:
        if token_id not in self._raw:
            self._raw[token_id] = self._tok.token_bytes(token_id)
        return self._raw[token_id]

    def named(self, token_id: int) -> bytes:
        """The bytes that name the token: its raw bytes, or a control token's spelling."""
        return self.raw(token_id) or self._tok.decode([token_id], skip_special_tokens=False).encode()

    def token(self, token_id: int) -> str:
        return token_string(self.named(token_id))

    def chat(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._chat_entry(e) for e in entries], "refusal": None}

    def completion(self, entries: Sequence[TokenLogprob], text_offset: int | TextOffsets) -> dict[str, Any]:
        """`text_offset`: where the first entry's text starts in the choice's text, or a streamed
        choice's `TextOffsets`, which goes on from its last chunk's tokens."""
        return self._completion([e.token_id for e in entries], entries, text_offset)

    def prompt(self, first_id: int, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """An echoed prompt's part of a completions choice's logprobs: `first_id` (no logprob: null, as
        OpenAI) then `entries`, the prompt's other tokens, offsets from the start of the text."""
        rest = self._completion([first_id, *(e.token_id for e in entries)], entries, 0, in_text=self.named)
        return {"tokens": rest["tokens"], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": rest["text_offset"]}

    def offsets(self, start: int) -> TextOffsets:
        """A completions choice's text offsets from `start`, for its generated tokens."""
        return TextOffsets(start, self.raw)

    def _completion(self, ids: list[int], entries: Sequence[TokenLogprob], text_offset: int | TextOffsets,
                    in_text: Callable[[int], bytes] | None = None) -> dict[str, Any]:
        """`ids`: the tokens, `entries` the logprobs of its last len(entries) ones; `in_text`: a token's
        bytes in the choice's text (default: its raw bytes, none for a control token)."""
        at = text_offset if isinstance(text_offset, TextOffsets) else TextOffsets(text_offset, in_text or self.raw)
        offsets = at.of(ids)
        tops = []
        for e in entries:
            top = {self.token(i): v for i, v in e.top}
            top.setdefault(self.token(e.token_id), e.logprob)
            tops.append(top)
        return {"tokens": [self.token(i) for i in ids], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        item = self._item(e.token_id, e.logprob)
        item["top_logprobs"] = [self._item(i, v) for i, v in e.top]
        return item

    def _item(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.token(token_id), "logprob": logprob, "bytes": list(self.named(token_id))}


class TextOffsets:
    """Where each token's text starts in a completions choice's text, token after token (an unfinished
    UTF-8 character held back until its last byte). A streamed choice keeps one across its chunks, so
    its offsets are the tokens' own, as the whole response's are: a chunk's text need not be its
    tokens' (text that may begin a stop string is held back, `stop` cuts a token's text short)."""

    def __init__(self, start: int, in_text: Callable[[int], bytes]) -> None:
        self.next = start
        self._in_text = in_text
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def of(self, ids: Sequence[int]) -> list[int]:
        out = []
        for i in ids:
            out.append(self.next)
            self.next += len(self._decoder.decode(self._in_text(i)))
        return out
