"""A thinking model's reply text split into its reasoning and its answer (Qwen3 family: ``<think>``
reasoning ``</think>`` answer). The server sends the two apart (server/openai/reasoning.py), and a client
sends only the answer back in its next request, which is what the cache keys a finished turn by
(models/tokenizer.py `next_turn`)."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply; `thinking`: the prompt opened the block."""
    if not thinking:
        if not text.lstrip().startswith(OPEN):
            return None, text
        text = text.lstrip()[len(OPEN):]
    end = text.find(CLOSE)
    if end == -1:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(CLOSE):].lstrip()
