"""A model-free EngineClient for fast HTTP-layer tests.

`FakeTokenizer` maps each UTF-8 byte b to token id b + 3 (ids 0..2 are special; 0 is EOS).
`FakeEngine.generate` replays the prompt's own tokens, cycling, one token per delta (so the output of
a prompt is predictable: "abc" -> "abcabc..."), and has a tiny exact-prefix cache per Namespace so
cached_tokens behaves like the real one: 0 on first sight, then the longest common prefix with an
earlier prompt of the same namespace (capped at len - 1). It records what happened to each request
in `events[request_id]`: "started", then "finished" or "closed" (iterator closed early = aborted).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from prefixserve.engine.protocol import (
    EngineHealth,
    FlushReport,
    InvalidRequest,
    PromptTooLong,
    TemplateError,
    TierFlush,
)
from prefixserve.types import Delta, FinishReason, FlushScope, Namespace, Request, TokenLogprob, Usage

OFFSET = 3


class FakeTokenizer:
    eos_token_ids = (0,)
    vocab_size = 256 + OFFSET
    thinks = False  # a test sets it to split replies as a thinking model's
    opens_think = False  # ... and this for a template whose generation prompt opens <think>
    think_end_id: int | None = None  # its tags are bytes, no one token: a split reply's tokens all count as reasoning
    form: tuple[int, str, int | None] = (0, "", None)  # history_form's answer

    def encode(self, text: str) -> list[int]:
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:  # no special tokens
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - OFFSET]) if token_id >= OFFSET else b""

    def history_form(self, template_kwargs: dict[str, Any] | None = None) -> tuple[int, str, int | None]:
        return self.form  # a test sets it for a template that writes replies back its own way

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        text = ""
        if template_kwargs:
            text += "<kwargs>" + json.dumps(template_kwargs, sort_keys=True) + "</kwargs>\n"
        if tools:
            text += "<tools>" + json.dumps(tools, sort_keys=True) + "</tools>\n"
        for m in messages:
            if "RAISE_TEMPLATE_ERROR" in m["content"]:
                raise TemplateError("this template refuses the message")
            thought = f"<think>{m['reasoning_content']}</think>" if m.get("reasoning_content") else ""
            text += f"<{m['role']}>{thought}{m['content']}"
            if m.get("tool_calls"):
                text += json.dumps(m["tool_calls"], sort_keys=True)
            text += "\n"
        if add_generation_prompt:
            text += "<assistant>" + ("<think>" if self.opens_think or (template_kwargs or {}).get("open_think") else "")
        return self.encode(text)


class FakeEngine:
    """Implements prefixserve.engine.protocol.EngineClient. `token_delay` seconds between deltas."""

    def __init__(
        self, model_id: str = "fake-model", max_model_len: int = 512, token_delay: float = 0.0,
        max_session_tokens: int | None = None, max_num_seqs: int | None = None,
    ) -> None:
        self.model_id = model_id
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_session_tokens = max_model_len if max_session_tokens is None else max_session_tokens
        self.session_budget_tokens = 1 << 30 if max_session_tokens is None else max_session_tokens  # 4 GiB's, roughly
        self.tokenizer = FakeTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.token_delay = token_delay
        self.requests: list[Request] = []
        self.events: dict[str, list[str]] = {}
        self.shutdown_calls: list[bool] = []
        self.redis_down = False  # set: flushes report a shared tier that did not answer
        self.fail_with: str | None = None  # set: every request's final delta is an ERROR with this text
        self.fail_after = 0  # with fail_with: the tokens each choice streams before its ERROR
        self._cache: dict[Namespace, list[tuple[int, ...]]] = {}
        self._running = 0
        self._evictions = 0
        self._abandoned: dict[str, Usage] = {}

    async def generate(self, request: Request) -> AsyncIterator[Delta]:
        ids = request.prompt_ids
        if len(ids) + int(request.sampling.max_tokens > 0) > self.max_model_len:  # as AsyncEngine.validate
            raise PromptTooLong(f"prompt of {len(ids)} tokens does not fit {self.max_model_len}")
        if len(ids) + request.sampling.max_tokens > self.max_session_tokens:  # as AsyncEngine.validate
            raise InvalidRequest(f"{len(ids)} + {request.sampling.max_tokens} tokens exceed the session budget")
        if self.max_num_seqs is not None and request.num_choices > self.max_num_seqs:  # as AsyncEngine.validate
            raise InvalidRequest(f"{request.num_choices} choices need as many session slots", "n")
        self.requests.append(request)
        events = self.events.setdefault(request.request_id, [])
        events.append("started")
        cached = self._lookup(request.namespace, ids)
        self._cache.setdefault(request.namespace, []).append(ids)
        self._running += 1
        finished = False
        abandoned = Usage(prompt_tokens=len(ids), completion_tokens=0, cached_tokens=cached)
        try:
            budget = min(request.sampling.max_tokens, self.max_model_len - len(ids))
            out = [ids[n % len(ids)] for n in range(budget)]
            reason = FinishReason.LENGTH
            full = self.tokenizer.decode(out)
            cuts = [full.index(s) for s in request.sampling.stop if s in full]
            if cuts:  # one byte per token for ASCII prompts: cut the tokens at the stop string
                out, reason = out[: min(cuts)], FinishReason.STOP
            k = request.sampling.num_logprobs
            if (pk := request.sampling.prompt_logprobs) is not None:  # echo with logprobs: -1 each, once per choice
                scored = tuple(TokenLogprob(t, -1.0, tuple((t + j, -1.0 - j) for j in range(pk))) for t in ids[1:])
                for index in range(request.num_choices):
                    yield Delta("", (), None, abandoned, index=index, prompt_logprobs=scored)
            for index in range(request.num_choices):  # n choices, one after the other, the same output
                done = index * len(out)
                for n, tok in enumerate(out, 1):
                    await asyncio.sleep(self.token_delay)
                    usage = Usage(prompt_tokens=len(ids), completion_tokens=done + n, cached_tokens=cached)
                    abandoned = usage  # closed from here on: the tokens made so far
                    if self.fail_with is not None and n > self.fail_after:
                        finished = True
                        yield Delta("", (), FinishReason.ERROR, usage, error=self.fail_with)
                        return
                    piece = self.tokenizer.decode([tok])
                    lps = () if k is None else (TokenLogprob(tok, -0.5, tuple((tok + j, -0.5 - j) for j in range(k))),)
                    last = n == len(out)
                    finished = last and index == request.num_choices - 1
                    yield Delta(piece, (tok,), reason if last else None, usage, index=index, logprobs=lps)
                if not out:
                    finished = index == request.num_choices - 1
                    yield Delta("", (), reason, Usage(prompt_tokens=len(ids), completion_tokens=0,
                                                      cached_tokens=cached), index=index)
            finished = True
        finally:
            self._running -= 1
            events.append("finished" if finished else "closed")
            if not finished:  # what the "engine" computed: the prompt, and the tokens it made so far
                self._abandoned[request.request_id] = abandoned

    async def abandoned_usage(self, request_id: str) -> Usage | None:
        return self._abandoned.pop(request_id, None)

    def health(self) -> EngineHealth:
        return EngineHealth(True, True, "fake engine", self._running, 0, fingerprint="fp_fake")

    def build_grammars_soon(self) -> None:
        """Nothing to build: the fake engine constrains nothing."""

    def metrics(self) -> dict[str, float]:
        entries = sum(len(v) for v in self._cache.values())
        return {
            "cache_bytes": float(entries * 100),
            "cache_entries": float(entries),
            "evictions": 0.0,
            "cache_hits": 1.0,
            "cache_misses": 3.0,
            "weird-key.name": 7.0,
        }

    async def shutdown(self, drain: bool = True) -> None:
        self.shutdown_calls.append(drain)

    async def flush_cache(self, scope: FlushScope) -> FlushReport:
        """Forget the selected namespaces' prompts (100 bytes each, as `metrics` counts them)."""
        gone = [ns for ns in self._cache if scope.selects(ns)]
        num = sum(len(self._cache.pop(ns)) for ns in gone)
        redis = (TierFlush("redis", 0, 0, complete=False),) if self.redis_down else ()
        return FlushReport((TierFlush("ram", num, num * 100), *redis))

    def _lookup(self, ns: Namespace, ids: tuple[int, ...]) -> int:
        best = 0
        for seen in self._cache.get(ns, []):
            n = 0
            for a, b in zip(seen, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1)
