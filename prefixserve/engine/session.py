"""A request while the engine works on it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from prefixserve.cache import CachedState, Entry
from prefixserve.engine.detok import IncrementalDetokenizer
from prefixserve.engine.grammar import TokenMatcher
from prefixserve.runner import SessionState
from prefixserve.runner.state import KVPool
from prefixserve.types import FinishReason, Namespace, Request, TokenLogprob, Usage


class Snapshot(CachedState, Protocol):
    """What the engine's cache stores and a session starts from: a runner snapshot (runner/state.py
    KVSnapshot, runner/hybrid_state.py HybridSnapshot). The cache reads only its CachedState part."""

    @property
    def logits(self) -> torch.Tensor | None:
        """The logits of its last position (None unless `has_logits`)."""
        ...

    def restore(self, num_tokens: int, extra_capacity: int, pool: KVPool | None = None) -> SessionState:
        """A deep copy of its first `num_tokens` tokens (its own length or a resume point, unless
        truncatable) into a new session state with room for `extra_capacity` more tokens."""
        ...


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Session:
    """Engine-thread-only object. Region map of the prompt while prefilling:

    # [0, num_cached)            copied from the cache entry
    # [num_cached, num_computed) computed by this session so far
    # boundary                   where a boundary entry is inserted (0 = none); prefill chunks
    #                            end there, so snapshot-only states could be taken on the way
    # checkpoints                where a snapshot-only state keeps a recurrent checkpoint (chunks
    #                            end there too; engine/cache_writer.py plan, docs/hybrid.md)
    """

    request: Request
    detok: IncrementalDetokenizer
    generator: torch.Generator
    state: SessionState | None = None
    phase: Phase = Phase.WAITING
    num_cached: int = 0
    num_refilled: int = 0  # of num_cached: computed at admission for this prompt (a turn refill), billed as computed
    boundary: int = 0
    checkpoints: list[int] = field(default_factory=list)
    pending_restore: Entry[Snapshot] | None = None  # a pinned cache entry to copy from before the next forward
    to_insert: list[int] = field(default_factory=list)  # lengths to snapshot into the cache after the first token
    output_ids: list[int] = field(default_factory=list)
    pending_token: int | None = None  # sampled and emitted, fed to the model by the next step
    num_tiers_asked: int = 0  # lower tiers (disk, then shared) asked so far, each once (engine/disk_loads.py)
    cacheable: bool = True  # False once its namespace was flushed: it must not re-seed the cache
    finish_reason: FinishReason | None = None
    reserved_bytes: int = 0  # KV bytes admission reserved for it (Scheduler.admit)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    index: int = 0  # which choice of the request (n > 1: choice 0 forks the others after the prompt)
    choices: list[Session] = field(default_factory=list)  # all choices once forked (shared list)
    matcher: TokenMatcher | None = None  # constrained decoding: where the output stands in the grammar
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored so far (sampling.prompt_logprobs)
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # of output tokens whose text is not settled
    num_logprobs_out: int = 0  # output tokens whose logprobs went out (engine/outputs.py settled_logprobs)
    shared_with: dict[str, int] = field(default_factory=dict)  # prompt prefilling -> tokens shared (Scheduler.follows)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_computed(self) -> int:
        return 0 if self.state is None else self.state.num_tokens

    @property
    def key(self) -> tuple[str, int]:
        return self.request.request_id, self.index

    def usage(self) -> Usage:
        """Worker truth for the whole request: the prompt once, what choice 0 was served from cache,
        and what every choice produced so far. Until the prompt is done (its first token sampled),
        prompt_tokens counts the prompt tokens processed so far, cached and computed: a request
        aborted while queued bills nothing."""
        group = self.choices or [self]
        first = group[0]
        prompt = self.prompt_len
        if first.first_token_at is None:
            prompt = min(self.prompt_len, max(first.num_cached if first.phase is not Phase.WAITING else 0,
                                              first.num_computed))
        return Usage(prompt_tokens=prompt, completion_tokens=sum(len(c.output_ids) for c in group),
                     cached_tokens=min(first.num_cached - first.num_refilled, prompt))

    def remaining_prompt(self) -> int:
        return self.prompt_len - self.num_computed

    def next_prefill_chunk(self, chunk_tokens: int) -> tuple[int, int]:
        """[start, end) of the next prompt chunk: at most chunk_tokens, never crossing the boundary or
        a checkpoint."""
        start = self.num_computed
        end = min(self.prompt_len, start + chunk_tokens)
        for stop in (self.boundary, *self.checkpoints):
            if start < stop < end:
                end = stop
        return start, end


@dataclass(eq=False)
class TurnRefill:
    """A finished turn whose decoded tokens are fed again, by prefill, so that its state can be cached.

    With 4-bit decode rows a decoded token's KV has other bits than prefilling it would give, so the
    session's own state is not offered as it is. Instead (docs/exactness.md):
    # [0, num_tokens)            exact: the prompt's KV (prefilled, or copied from a cache entry)
    # [num_tokens, len(ids))     re-fed in prefill chunks in the background (engine/refill.py);
    #                            then the whole turn (prompt + reply) is inserted, exact by construction
    """

    namespace: Namespace
    token_ids: tuple[int, ...]
    state: SessionState
    eager: bool = False  # a turn of a conversation under way: re-fed under load too (engine/refill.py)


def tokens_needed(request: Request, max_model_len: int) -> int:
    """The tokens of KV one of a request's sessions may grow to: prompt + max_tokens, within the context."""
    return min(max_model_len, len(request.prompt_ids) + request.sampling.max_tokens)


def kv_bytes_needed(request: Request, max_model_len: int, kv_bytes_per_token: int) -> int:
    """The KV bytes a request's sessions may grow to (`tokens_needed` for each of its choices:
    n > 1 forks copy the prompt's KV): what admission reserves against `max_session_bytes`. The KV
    itself is allocated as it grows."""
    return request.num_choices * tokens_needed(request, max_model_len) * kv_bytes_per_token


def slots_needed(s: Session) -> int:
    """Session slots (`max_num_seqs`) `s` takes: a choice 0 not yet forked holds its request's n."""
    return s.request.num_choices if s.index == 0 and not s.choices else 1
