"""Checks shared by the generation endpoints: model, sampling fields, unsupported options (the
cache_salt and namespace: server/namespaces.py).

Each function either returns a clean value or raises APIError(400) naming the parameter. Nothing here
touches the engine beyond reading `model_id`, `max_model_len`, `max_session_tokens` and the tokenizer's
vocabulary size.
"""

from __future__ import annotations

import json
from typing import Any

from prefixserve.engine.grammar import check_constraint
from prefixserve.server.errors import APIError, bad_request
from prefixserve.server.openai.schemas import SamplingFields
from prefixserve.types import MAX_CHOICES, Constraint, InvalidRequest, SamplingParams

MAX_PROMPT_CACHE_KEY_CHARS = 1024  # a bound on what a Responses object echoes and stores
MAX_STOP_SEQUENCES = 16
MAX_TEMPERATURE = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def check_model(requested: str | None, model_id: str) -> str:
    """The model name to echo in responses; 404 model_not_found (as OpenAI and vLLM answer) for any
    model this server does not serve."""
    if requested is None or requested == model_id:
        return model_id
    raise APIError(
        404, f"The model '{requested}' does not exist; this server serves '{model_id}'",
        param="model", code="model_not_found",
    )


def check_prompt_cache_key(value: Any) -> str | None:
    """OpenAI's `prompt_cache_key`: a string (at most MAX_PROMPT_CACHE_KEY_CHARS) or absent, returned as
    given. It is a placement hint for whatever routes requests (a gateway can hash on it to send one
    key's requests to one replica) and is never part of the cache namespace: requests of one tenant
    and `cache_salt` share cached prefixes whatever their keys, and one key never reaches another
    tenant's or salt's entries (`namespace` does not take it)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request("prompt_cache_key must be a string", "prompt_cache_key")
    if len(value) > MAX_PROMPT_CACHE_KEY_CHARS:
        raise bad_request(f"prompt_cache_key must be at most {MAX_PROMPT_CACHE_KEY_CHARS} characters",
                          "prompt_cache_key")
    return check_text(value, "prompt_cache_key")


def check_unsupported(body: SamplingFields) -> None:
    """Refuse, by name, options we accept only at their neutral value."""
    if body.repetition_penalty is not None and body.repetition_penalty != 1:
        raise bad_request("repetition_penalty is not supported (only 1)", "repetition_penalty")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def check_absent(body: Any, features: tuple[tuple[str, str], ...]) -> None:
    """Refuse, by name, OpenAI fields of features this server does not have, each (field, why), unless
    the field is absent, null or empty: a silently ignored option reads as one that took effect."""
    for name, why in features:
        value = getattr(body, name)
        if isinstance(value, dict) and all(v is None for v in value.values()):
            continue  # e.g. {"effort": null}: nothing asked for
        if value not in (None, False, 0, []):
            raise bad_request(f"{name} is not supported here ({why})", name)


def check_n(value: int | None, param: str = "n") -> int:
    """n (choices per request): 1 .. MAX_CHOICES."""
    n = 1 if value is None else value
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"{param} must be between 1 and {MAX_CHOICES}", param)
    return n


def check_logit_bias(value: dict[str, Any] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": bias in [-100, 100]} with ids in the vocabulary."""
    out: list[tuple[int, float]] = []
    for key, bias in (value or {}).items():
        if not key.isascii() or not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids (got {key[:32]!r})", "logit_bias")
        token_id = int(key)
        if token_id >= vocab_size:
            raise bad_request(f"logit_bias: token id {token_id} is outside the vocabulary", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                              "logit_bias")
        out.append((token_id, float(bias)))
    return tuple(out)


def sampling_params(
    body: SamplingFields, max_tokens: int | None, default_max_tokens: int, max_model_len: int, prompt_len: int,
    vocab_size: int, num_logprobs: int | None = None, constraint: Constraint | None = None,
    prompt_logprobs: int | None = None, zero_tokens_ok: bool = False, max_tokens_name: str = "max_tokens",
    *, session_budget_tokens: int, num_choices: int = 1,
) -> SamplingParams:
    """The engine's SamplingParams for a prompt of `prompt_len` tokens (the longest, for several).

    A given max_tokens must fit beside the prompt: prompt + max_tokens beyond the context is a 400
    `context_length_exceeded` (as OpenAI and vLLM answer), never a silent cut; one beyond the session
    budget the engine refuses (400). Without one, the server's `--default-max-tokens` applies, capped by
    the room the prompt leaves in the context and in `session_budget_tokens` (the engine's
    `--max-session-bytes` in tokens, not capped by the context), at least 1: a prompt that leaves no room at all
    is then the engine's 400 naming the prompt alone; a given one past the budget is a 400 naming it. `zero_tokens_ok`:
    max_tokens 0 (completions' echo: the prompt alone, scored with `prompt_logprobs`) is valid.
    `max_tokens_name`: the field the client set it with (chat's max_completion_tokens), for errors.
    `num_choices`: n (best_of): each choice holds the prompt and its tokens in the session budget, so
    the default is fitted into its n-th part (each choice has the whole context)."""
    room = max_model_len - prompt_len  # >= 1 (0 scoring a prompt alone): the caller checked it fits (check_fits)
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, room, session_budget_tokens // max(1, num_choices) - prompt_len))
    elif max_tokens < (0 if zero_tokens_ok else 1):
        raise bad_request(f"{max_tokens_name} must be at least 1", max_tokens_name)
    elif max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or {max_tokens_name}.", max_tokens_name, "context_length_exceeded",
        )
    elif num_choices * (prompt_len + max_tokens) > session_budget_tokens and prompt_len < session_budget_tokens:
        each = f", for each of {num_choices} choices," if num_choices > 1 else ""
        raise bad_request(  # the prompt alone past the budget: the engine's 400 names the prompt
            f"the prompt plus {max_tokens_name}{each} needs {num_choices * (prompt_len + max_tokens)} tokens of KV, "
            f"more than the server's session budget holds ({session_budget_tokens} tokens, --max-session-bytes): "
            f"lower {max_tokens_name}{' or n' if num_choices > 1 else ''} or shorten the prompt", max_tokens_name,
        )
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(f"temperature must be between 0 and {MAX_TEMPERATURE:g}", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    top_k = 0 if body.top_k is None or body.top_k == -1 else body.top_k
    if top_k < 0:
        raise bad_request("top_k must be -1, 0 (off) or a positive integer", "top_k")
    if body.seed is not None and not SEED_MIN <= body.seed <= SEED_MAX:
        raise bad_request("seed is out of range (a 64-bit integer)", "seed")
    stop_token_ids = tuple(body.stop_token_ids or ())
    if any(t < 0 for t in stop_token_ids):
        raise bad_request("stop_token_ids must be non-negative", "stop_token_ids")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        penalties[name] = 0.0 if value is None else float(value)
        if not -MAX_PENALTY <= penalties[name] <= MAX_PENALTY:
            raise bad_request(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}", name)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=body.seed,
        stop=check_stop(body.stop),
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(body.ignore_eos),
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        logit_bias=check_logit_bias(body.logit_bias, vocab_size),
        num_logprobs=num_logprobs,
        constraint=constraint,
        prompt_logprobs=prompt_logprobs,
    )


def check_stop(value: Any) -> tuple[str, ...]:
    """stop: absent, a string, or a list of up to 16 non-empty strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_SEQUENCES:
        raise bad_request(f"stop allows at most {MAX_STOP_SEQUENCES} sequences", "stop")
    if any(not s for s in items):
        raise bad_request("stop sequences must not be empty", "stop")
    for s in items:
        check_text(s, "stop")
    return tuple(dict.fromkeys(items))


def check_token_ids(ids: list[Any], vocab_size: int, param: str) -> list[int]:
    """A list of token ids: ints (not bools) in [0, vocab_size)."""
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            raise bad_request(f"{param} must be a string or a list of integer token ids", param)
        if i < 0 or i >= vocab_size:
            raise bad_request(f"token id {i} is outside the vocabulary", param)
    return list(ids)


def check_text(text: str, param: str) -> str:
    """Strings must be encodable (no lone surrogates) before they reach the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} contains invalid unicode", param) from None
    return text


def response_constraint(fmt: dict[str, Any] | None) -> Constraint | None:
    """response_format -> a Constraint: text (None), json_object, or json_schema {name, schema, strict}."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise bad_request("response_format type must be 'text', 'json_object' or 'json_schema'", "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema needs a 'name' (without a 'schema', any JSON object)",
                          "response_format.json_schema")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request("the schema must be a JSON object", "response_format.json_schema.schema")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise bad_request("strict must be a boolean", "response_format.json_schema.strict")
    return checked(Constraint("json_schema", json.dumps(schema)), "response_format.json_schema.schema")


def checked(constraint: Constraint, param: str) -> Constraint:
    try:
        check_constraint(constraint)
    except InvalidRequest as e:
        raise bad_request(str(e), param) from None
    return constraint


def check_metadata(metadata: dict[str, Any] | None) -> None:
    """OpenAI's bounds: at most 16 pairs, keys of at most 64 characters, string values of at most 512."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise bad_request("metadata may have at most 16 key-value pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise bad_request("metadata keys may have at most 64 characters", "metadata")
        if not isinstance(value, str) or len(value) > 512:
            raise bad_request(f"metadata[{key[:64]!r}] must be a string of at most 512 characters", "metadata")


def check_text_only(modalities: Any, audio: Any) -> None:
    """Chat's `modalities` / `audio`: this server answers in text; a request for audio output is refused
    by name rather than answered without it."""
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise bad_request("modalities must be a list of strings", "modalities")
        if any(m != "text" for m in modalities):
            raise bad_request('only text output is supported here: modalities must be ["text"]', "modalities")
    if audio is not None:
        raise bad_request("audio output is not supported here (the model answers in text)", "audio")
