"""The engine's running totals since start, as /metrics and usage report them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineCounters:
    """Since start. The prompt counters count what was served, as usage bills it: a request aborted
    mid-prefill adds the tokens it reached, not its prompt's length (prompt = cached + computed).
    Engine thread only: EngineCore counts requests and steps, its admission the cached and refilled
    prompt tokens, the OutputProcessor computed prompt tokens, completions and finishes."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_steps: int = 0
