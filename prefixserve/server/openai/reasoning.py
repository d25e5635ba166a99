"""A thinking model's reply split into `reasoning_content` and `content` (chat completions).

Qwen3-family models think before they answer: ``<think>`` reasoning ``</think>`` answer. Their chat
templates either leave the ``<think>`` to the model or write it at the end of the prompt (the reply
then starts inside the block; `thinking`), and `chat_template_kwargs: {"enable_thinking": false}`
writes an empty block instead. As vLLM's and llama.cpp's servers do, the reasoning goes out as
`message.reasoning_content` (`delta.reasoning_content` when streamed) and only the answer as `content`,
where tool calls are then parsed. Reasoning is stripped of surrounding whitespace, the answer of
leading whitespace; a reply cut while thinking is all reasoning. Streaming gives the same strings:
text that could still be a tag or trailing whitespace is held until it is known.

On only for a model whose vocabulary has both tags as tokens and whose chat template writes them
(`Tokenizer.thinks`), so other models' replies are never touched; `--reasoning-parser none` turns
it off.

Usage's `reasoning_tokens` (chat's `completion_tokens_details`, Responses' `output_tokens_details`)
counts a split reply's reasoning by the token ids the engine generated, never by re-tokenizing text:
the tokens through the first `</think>` token (`Tokenizer.think_end_id`), or all of them when the
reply ended before closing the block; 0 for a reply whose reasoning was not split off. A reply that
spells `</think>` in pieces of other tokens closes the block in the text but not by id, and counts
every token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixserve.engine.detok import partial_len
from prefixserve.models.thinking import CLOSE, OPEN, split_reasoning

# the split itself lives beside the tokenizer: the engine keys a finished turn by the answer alone
__all__ = ["CLOSE", "OPEN", "ReasoningStream", "reasoning_tokens", "split_reasoning"]


def reasoning_tokens(token_ids: Sequence[int], end_id: int | None) -> int:
    """How many of a split reply's output tokens are reasoning: those through its first </think> token
    (`end_id`), or all of them when it ended before closing the block."""
    for i, token_id in enumerate(token_ids):
        if token_id == end_id:
            return i + 1
    return len(token_ids)


@dataclass(slots=True)
class ReasoningStream:
    """Streaming side of `split_reasoning`: `feed` returns the (reasoning, content) safe to send now;
    `count` takes the same deltas' token ids for `num_tokens` (`reasoning_tokens` of the whole reply)."""

    thinking: bool
    end_id: int | None = None  # the </think> token's id
    _state: str = ""  # "start" (before a possible <think>), "think", "after" (skipping whitespace), "content"
    _held: str = ""
    _said: bool = False  # some reasoning went out (later leading whitespace is inner, not leading)
    _opened: bool = False  # the reasoning is split off: the prompt or the reply opened the block
    _num_counted: int = 0  # tokens through the first </think> token, or all so far
    _closed: bool = False  # the </think> token was counted

    def __post_init__(self) -> None:
        self._state = "think" if self.thinking else "start"
        self._opened = self.thinking

    @property
    def num_tokens(self) -> int:
        """The reply's reasoning tokens so far: 0 while (or once it is known that) it did not open a block."""
        return self._num_counted if self._opened else 0

    def count(self, token_ids: Sequence[int]) -> None:
        """Count one delta's generated token ids, in the order the engine made them."""
        if not self._closed:
            self._num_counted += reasoning_tokens(token_ids, self.end_id)
            self._closed = self.end_id in token_ids

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = ""
        if self._state == "start":
            head = self._held.lstrip()
            if head.startswith(OPEN):
                self._state, self._held, self._opened = "think", head[len(OPEN):], True
            elif OPEN.startswith(head):  # nothing yet, or a tag on its way
                return "", ""
            else:
                self._state = "content"
        if self._state == "think":
            end = self._held.find(CLOSE)
            if end == -1:
                tag = partial_len(self._held, CLOSE)  # a tag on its way, and whitespace that may be trailing
                base = self._held[: len(self._held) - tag]
                keep = tag + len(base) - len(base.rstrip())
                return self._reasoning(self._held[: len(self._held) - keep], keep), ""
            rest = self._held[end + len(CLOSE):]
            reasoning = self._reasoning(self._held[:end].rstrip(), 0)
            self._state, self._held = "after", rest
        if self._state == "after":
            self._held = self._held.lstrip()
            if not self._held:
                return reasoning, ""
            self._state = "content"
        out, self._held = self._held, ""
        return reasoning, out

    def finish(self) -> tuple[str, str]:
        """What is still held, as (reasoning, content), once the reply ended."""
        held, self._held = self._held, ""
        if self._state == "start":
            return "", held
        if self._state == "think":
            return (held.rstrip() if self._said else held.strip()), ""
        return "", "" if self._state == "after" else held

    def _reasoning(self, text: str, keep: int) -> str:
        if not self._said:
            text = text.lstrip()
        self._held = self._held[len(self._held) - keep:] if keep else ""
        self._said = self._said or bool(text)
        return text

