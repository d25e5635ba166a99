"""Whether a request fits this engine: its prompt, context, session slots and session memory. Checked
on the caller's side, before any work is queued (AsyncEngine.generate)."""

from __future__ import annotations

from prefixserve.engine.core import EngineCore
from prefixserve.engine.session import kv_bytes_needed
from prefixserve.types import InvalidRequest, PromptTooLong, Request


def kv_bytes(core: EngineCore, request: Request) -> int:
    """The KV bytes admission will reserve for `request` against --max-session-bytes."""
    return kv_bytes_needed(request, core.max_model_len, core.runner.kv_bytes_per_token())


def validate(core: EngineCore, vocab_size: int, request: Request) -> None:
    """Raises PromptTooLong / InvalidRequest when `request` can never be served here. Reads only what
    never changes after start (limits, the model's sizes): safe on any thread."""
    n = len(request.prompt_ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty")
    if request.num_choices > core.config.max_num_seqs:  # each choice is a session, all run at once
        raise InvalidRequest(f"{request.num_choices} choices need {request.num_choices} session slots; this "
                             f"server runs at most {core.config.max_num_seqs} at once (--max-num-seqs)", "n")
    generating = int(request.sampling.max_tokens > 0)  # 0: the prompt alone, scored (completions' echo)
    if n + generating > core.max_model_len:
        raise PromptTooLong(
            f"the prompt has {n} tokens; this model's context is {core.max_model_len} tokens"
            + (" (including at least one generated token)" if generating else "")
        )
    budget = core.config.max_session_bytes
    if n + generating > core.max_session_tokens:  # budget-bound: the context's bound was checked above
        raise InvalidRequest(
            f"the prompt alone ({n} tokens) exceeds the server's session budget: {budget:,} bytes hold "
            f"{core.max_session_tokens} tokens of KV, including at least one generated token; shorten the prompt"
        )
    need = kv_bytes(core, request)
    if need > budget:
        raise InvalidRequest(
            f"the prompt plus max_tokens{f', for each of {request.num_choices} choices,' if request.num_choices > 1 else ''}"
            f" needs {need:,} bytes of KV, more than the server's session budget of {budget:,} bytes: lower "
            f"max_tokens{' or n' if request.num_choices > 1 else ''} or shorten the prompt"
        )
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
