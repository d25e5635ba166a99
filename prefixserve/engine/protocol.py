"""What the HTTP layer may rely on from the engine. The server imports this; nothing here imports the server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixserve.types import (
    Delta,
    FlushScope,
    HistoryForm,
    InvalidRequest,
    Overloaded,
    PromptTooLong,
    Request,
    TemplateError,
    Unavailable,
    Usage,
)

__all__ = [
    "EngineClient", "EngineHealth", "FlushReport", "FlushScope", "InvalidRequest", "Overloaded", "PromptTooLong",
    "TemplateError", "TokenizerLike", "Unavailable",
]


@dataclass(frozen=True, slots=True)
class EngineHealth:
    ok: bool
    exact_reuse: bool  # the start-up self-test found the runtime batch/split invariant; else no reuse
    detail: str
    num_running: int  # sessions running
    num_waiting: int  # requests not started yet: in the engine's queue, or handed over and not yet taken in
    num_queued: int = 0  # of those, the ones the next step could not start (no free slot or session bytes)
    decode_kernel: str = "dense"  # int4: decode rows run the model's 4-bit weights (models/kernels/int4.py)
    fingerprint: str = ""  # responses' system_fingerprint: model, dtype, kernels, self-test verdict
    dtype: str = ""  # the runtime dtype the self-test chose ("bfloat16" / "float32")
    tiles: str = ""  # row tiles of every dense matmul (docs/exactness.md), e.g. "64"


@dataclass(frozen=True, slots=True)
class TierFlush:
    """What one cache tier forgot."""

    tier: str  # "ram", "disk", "redis"
    num_entries: int
    num_bytes: int
    complete: bool = True  # False: the tier did not answer; the scope's entries there may remain


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What a cache flush forgot, per tier. Totals add the tiers: an entry held in RAM and on disk
    counts in both (two copies went)."""

    tiers: tuple[TierFlush, ...]

    @property
    def num_entries(self) -> int:
        return sum(t.num_entries for t in self.tiers)

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tiers)


class TokenizerLike(Protocol):
    eos_token_ids: tuple[int, ...]
    thinks: bool  # its chat template and vocabulary have <think> ... </think> (server/openai/reasoning.py)
    think_end_id: int | None  # </think>'s token id when it thinks: usage's reasoning_tokens count through it

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for: part of a UTF-8 character for some byte-level tokens,
        which decoding the single id turns into U+FFFD (logprobs' `bytes`, server/openai/logprobs.py)."""
        ...

    def next_turn(self, prompt_ids: Sequence[int], reply_ids: Sequence[int],
                  form: HistoryForm | None = None) -> tuple[int, ...] | None:
        """Prompt + reply as a client's next request holds them when it sends the reply back as text;
        None where that cannot be told (models/tokenizer.py)."""
        ...

    def history_form(self, template_kwargs: dict[str, Any] | None = None) -> tuple[int, str, int | None]:
        """(drop, lead, end): how the chat template writes a reply back into a later history (types.HistoryForm)."""
        ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Chat template -> token ids (`template_kwargs`: extra template variables). Raises
        TemplateError on messages the template rejects."""
        ...


class EngineClient(Protocol):
    model_id: str  # the served model name, also the cache namespace's model_id
    max_model_len: int
    # the most tokens (prompt + max_tokens) one request may reserve: --max-session-bytes over the KV bytes
    # of a token, at most max_model_len; a request without max_tokens gets its default fitted into it too
    max_session_tokens: int
    # the whole --max-session-bytes in tokens of KV (not capped by the context): the n choices of a
    # request share it, so a default max_tokens for n > 1 is fitted into its n-th part
    session_budget_tokens: int
    vocab_size: int  # token ids outside [0, vocab_size) are refused before they reach the engine
    tokenizer: TokenizerLike

    def generate(self, request: Request) -> AsyncIterator[Delta]:
        """Stream the request's output: the Deltas of all its choices (`Delta.index`), interleaved.
        Raises PromptTooLong before yielding if it cannot fit. Closing the iterator early (client
        gone) aborts the request and frees its sessions. The iterator ends after every choice's
        final Delta (or the first ERROR / ABORT one); the last Delta carries the request's
        worker-truth usage (also for aborts)."""
        ...

    async def abandoned_usage(self, request_id: str) -> Usage | None:
        """The worker-truth usage of a request whose iterator was closed early (what its abort found
        computed; a request still queued bills nothing), once the engine has processed the abort
        (bounded wait). Returned once; None when unknown."""
        ...

    def health(self) -> EngineHealth: ...

    def build_grammars_soon(self) -> None:
        """Start building what constrained decoding (tools, response_format) needs, off the caller's
        thread; called once the server serves. Returns at once."""
        ...

    def metrics(self) -> dict[str, float]:
        """Aggregate counters and gauges (no tenant labels): cache_bytes, cache_entries, evictions, ...
        Never waits for a step (the event loop and /metrics scrapes call it)."""
        ...

    async def flush_cache(self, scope: FlushScope) -> FlushReport:
        """Forget every cached entry of the namespaces `scope` selects, in every tier; no later lookup
        finds them. Who may flush what is the caller's check."""
        ...

    def end_all(self, error: str) -> None:
        """Refuse new requests (Unavailable) and end every request held, running or queued, soon
        (between steps): each choice's last Delta has finish_reason ABORT, `error` for the client and
        the usage computed so far. Returns at once. The bounded shutdown's cut (server/shutdown.py)."""
        ...

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting work; with drain, finish what is running first."""
        ...
