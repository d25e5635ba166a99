"""Prompt text: system prompts of a given token length, user questions, the decode prompt.

Deterministic given their nonce, so both servers see byte-identical requests. The nonce's digest
opens the system prompt, so distinct nonces share no prefix beyond the chat template's tokens.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "river ledger harbor engine garden lantern archive bridge circuit orchard signal compass "
    "furnace library meadow turbine beacon canal quarry vessel"
)
_ADJS = _words("amber silent northern ancient rapid hollow crimson gentle narrow distant frozen bright")
_VERBS = _words("stores guards measures repairs records carries shelters powers maps feeds")
_PLACES = _words("Arden Belmont Corvin Dalca Esker Fenwick Galloway Hartsel Ilvar Jessop")
_TOPICS = (
    "a lighthouse keeper's daily routine",
    "how a bicycle gear system works",
    "the history of paper making",
    "why bread dough rises",
    "how tides are caused by the moon",
    "the life cycle of a honeybee colony",
    "how a pipe organ produces sound",
    "the rules of a fair auction",
)
DECODE_PROMPT = (
    "Write a very long and detailed story, at least 1500 words, about a young engineer who "
    "builds a clockwork bridge across a canyon. Describe every step, every tool and every "
    "person she meets along the way."
)


class PromptFactory:
    """Builds system prompts of an (approximate, tokenizer-checked) token length."""

    def __init__(self, count_tokens: Callable[[str], int]) -> None:
        self._count_tokens = count_tokens
        self._bodies: dict[tuple[int, str], str] = {}

    def system_prompt(self, num_tokens: int, nonce: str, topic_seed: str = "main") -> str:
        """`num_tokens` tokens (about) opening with a digest of `nonce`: distinct nonces share
        no prefix beyond the chat template's first tokens."""
        header = f"{hashlib.sha256(nonce.encode()).hexdigest()[:16]}: "
        return header + self._body(max(1, num_tokens - self._count_tokens(header)), topic_seed)

    def num_tokens(self, text: str) -> int:
        return self._count_tokens(text)

    def _body(self, num_tokens: int, topic_seed: str) -> str:
        if (num_tokens, topic_seed) not in self._bodies:
            self._bodies[num_tokens, topic_seed] = self._build_body(num_tokens, topic_seed)
        return self._bodies[num_tokens, topic_seed]

    def _build_body(self, num_tokens: int, topic_seed: str) -> str:
        rng = random.Random(f"body-{topic_seed}")
        lines = [
            (
                "You are the archivist of the Meridian Institute. Answer questions using only the "
                "facts below, briefly and precisely. Facts:"
            )
        ]
        # Grow in batches, then trim one fact at a time: few tokenizer calls per prompt.
        while self._count_tokens(" ".join(lines)) < num_tokens:
            for _ in range(8):
                lines.append(_fact(rng, len(lines)))
        while len(lines) > 2 and self._count_tokens(" ".join(lines[:-1])) >= num_tokens:
            lines.pop()
        return " ".join(lines)


def user_question(index: int, salt: str = "") -> str:
    topic = _TOPICS[index % len(_TOPICS)]
    return f"Question {salt}{index}: explain {topic}, in detail and step by step."


def load_token_counter(gguf_path: str | None) -> tuple[Callable[[str], int], str]:
    """The model's own tokenizer when `transformers` can read it from the GGUF, else an estimate."""
    if gguf_path:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
            )
            return (lambda text: len(tokenizer(text)["input_ids"])), "gguf tokenizer"
        except Exception as exc:  # noqa: BLE001 - any failure falls back to the estimate
            print(f"tokenizer unavailable ({exc!r}); sizing prompts by characters")
    return (lambda text: max(1, round(len(text) / 4.2))), "chars/4.2 estimate"


def _fact(rng: random.Random, index: int) -> str:
    return (
        f"({index}) The {rng.choice(_ADJS)} {rng.choice(_NOUNS)} of {rng.choice(_PLACES)} "
        f"{rng.choice(_VERBS)} {rng.randint(2, 9999)} {rng.choice(_NOUNS)}s every "
        f"{rng.choice(('morning', 'winter', 'decade', 'tide', 'harvest'))}."
    )
