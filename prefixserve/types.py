"""Plain request/response data shared by every layer. No torch, nothing of ours imported."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORT = "abort"  # the client went away or the server is shutting down
    ERROR = "error"  # the engine failed this request


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who may share cached state: two requests share only if all three fields are equal."""

    model_id: str
    tenant_id: str
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    namespace: Namespace
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True, slots=True)
class Usage:
    """Worker truth: counted by the engine that served the request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Delta:
    """One step of a request's output stream. The last delta has finish_reason set; every delta
    carries the usage so far (a first delta with no tokens reports the cached tokens at admission)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None


class PromptTooLong(ValueError):
    """The prompt (plus at least one generated token) does not fit the context. A client error (400)."""


class TemplateError(ValueError):
    """The messages / tools could not be rendered through the chat template. A client error (400)."""


class Overloaded(RuntimeError):
    """The engine's queue is full; the client should retry later (429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(RuntimeError):
    """The engine is shutting down or cannot continue (503)."""


class InvalidRequest(ValueError):
    """Anything else about a request the engine cannot serve (e.g. token ids outside the vocabulary). 400."""


@dataclass(frozen=True, slots=True)
class FlushScope:
    """Which namespaces a cache flush forgets: one tenant's (None = every tenant: admin only), and
    within it one salt's (None = every salt of it, the unsalted namespace included)."""

    tenant_id: str | None = None
    cache_salt: str | None = None

    def selects(self, ns: Namespace) -> bool:
        return (self.tenant_id is None or ns.tenant_id == self.tenant_id) and (
            self.cache_salt is None or ns.cache_salt == self.cache_salt
        )
