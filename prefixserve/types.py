"""Plain request/response data shared by every layer. No torch, nothing of ours imported."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

# The one tenant of an open server (no API keys). Its id has characters no tenant name may hold
# (server/operator/auth.py: names are 1-64 of A-Z a-z 0-9 _ . : @ -) and no unnamed key's id has, so no key
# file can give a tenant the open server's cached prompts, usage or stored responses.
OPEN_TENANT_ID = "(open)"
# The id an open server gave its tenant before that, which a key file could also name: ledgers and
# stored-responses files of then are migrated once (ledger/store.py, server/openai/responses/disk.py).
LEGACY_OPEN_TENANT_ID = "default"


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


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
class Constraint:
    """Constrained decoding: every sampled token keeps the output a prefix of the grammar's language,
    and the request finishes when the grammar is complete (engine/grammar.py compiles it).

    kind "json_schema": `source` is a JSON schema (as a JSON string); "json_object": any JSON object
    (`source` unused); "lark": `source` is a Lark grammar in llguidance's dialect."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object", "lark"):
            raise ValueError(f"unknown constraint kind {self.kind!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each token. Penalties and logit_bias shift the fp32 logits before temperature
    (OpenAI's definitions); logprobs are always of the raw logits (log_softmax before any of it)."""

    max_tokens: int = 16  # 0: no token is generated (the prompt is only fed: with prompt_logprobs, scored)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # (open, close): stop strings do not match from an open tag to its close (tool calls; engine/detok.py)
    stop_skip: tuple[str, str] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # -= p for every token already generated
    frequency_penalty: float = 0.0  # -= f * (times it was generated)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    num_logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the top k
    constraint: Constraint | None = None
    # None: off; k >= 0: every prompt token after the first gets its logprob given the tokens before
    # it, and the top k (completions' echo with logprobs). The prompt is then computed, never served
    # from the cache: a cached entry holds no logits but its last
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError("penalties must be in [-2, 2]")
        if self.num_logprobs is not None and not 0 <= self.num_logprobs <= 20:
            raise ValueError("num_logprobs must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


MAX_CHOICES = 16  # n per request


@dataclass(frozen=True, slots=True)
class HistoryForm:
    """How a chat's next request writes this turn's reply back into its history, where that is not
    prompt + reply (models/tokenizer.py `history_form` and `next_turn`; docs/cache.md "Finished
    turns"): the history lacks the prompt's last `drop` tokens (the empty think block Qwen3's template
    writes into a generation prompt with thinking off), writes `lead` before the reply's text, and,
    for a reply whose reasoning the server splits off (`thinking` not None; True: the prompt opened
    the <think> block), holds only the answer, and ends it with the stop token `end` whichever of the
    model's stop tokens ended the reply (None: as sampled)."""

    drop: int = 0
    lead: str = ""
    thinking: bool | None = None
    end: int | None = None


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    namespace: Namespace
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_choices: int = 1  # n: the prompt is prefilled once, each choice continues from its own copy
    # the client sends this turn back as text (a chat history, a text prompt + the completion): the
    # finished turn is cached as the tokenizer encodes its reply; False: as sampled (a prompt of token
    # ids, whose client sends the ids back). engine/cache_writer.py offer_turn
    text_history: bool = True
    history: HistoryForm | None = None  # a chat's: how its template writes the reply back (None: as it follows the prompt)
    # likely to be continued: the prompt holds an earlier reply (a chat with an assistant turn), or offers tools
    # (a call's result comes back in the next turn), so its turn refill runs under load too (engine/refill.py)
    continues: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.num_choices <= MAX_CHOICES:
            raise ValueError(f"num_choices must be in [1, {MAX_CHOICES}]")
        if self.sampling.max_tokens == 0 and self.num_choices > 1:
            raise ValueError("max_tokens 0 feeds the prompt once: num_choices must be 1")



@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and the `top` most likely tokens at its position,
    most likely first. From the fp32 logits that sampled it."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    """One step of one choice's output stream. Each choice's last delta has finish_reason set; every
    delta carries the usage so far of the whole request (all choices: the prompt counted once), so
    the last delta of the request carries its total. A first delta with no tokens reports the cached
    tokens at admission."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    index: int = 0  # the choice (0 .. num_choices - 1)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them
    # sampling.prompt_logprobs: prompt tokens 1 .. len - 1 (the first has no context), once per choice,
    # on a delta of its own before the choice's first token; None on every other delta
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


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
    """Anything else about a request the engine cannot serve (e.g. token ids outside the vocabulary). 400
    naming `param`."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


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
