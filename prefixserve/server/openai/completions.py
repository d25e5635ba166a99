"""POST /v1/completions: body -> prompt token ids, SamplingParams and Namespace.

The prompt is a string, a list of token ids, or a list of up to 16 of either: prompt k's choices are
k * n .. k * n + n - 1 and `usage` sums the prompts (server/openai/multi_prompt.py). `n` choices share one prefill; `best_of` > n
samples best_of choices and returns the n with the highest cumulative logprob (not streamed, as
OpenAI); `echo` puts the prompt's text before each choice, and with `logprobs` the prompt's tokens lead the
choice's logprobs (the first with null, as OpenAI): the prompt is then computed, not served from the
cache, whose entries keep no logits but their last. `max_tokens` 0 with `echo` returns the prompt
alone (scoring a text: the loglikelihood requests of evaluation harnesses). `suffix` needs
fill-in-the-middle tokens, which no model served here has (400).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefixserve.config import DEFAULT_MAX_TOKENS
from prefixserve.engine.protocol import EngineClient
from prefixserve.server.errors import bad_request
from prefixserve.server.namespaces import check_salt, namespace
from prefixserve.server.openai import params
from prefixserve.server.openai.logprobs import LogprobRenderer
from prefixserve.server.openai.prompt_memo import PromptMemo, input_digest
from prefixserve.server.openai.schemas import CompletionRequest
from prefixserve.server.openai.shapes import CompletionShape, Prepared, Shape, new_id
from prefixserve.types import MAX_CHOICES, HistoryForm, Namespace, Request, SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions (within the server's --default-max-tokens)
MAX_COMPLETION_LOGPROBS = 5  # the legacy API's limit
MAX_PROMPTS = 16


def prepare_completion(
    body: CompletionRequest, engine: EngineClient, tenant_id: str, default_max_tokens: int = DEFAULT_MAX_TOKENS,
    memo: PromptMemo | None = None,
) -> Prepared:
    """Validate a completions body for `tenant_id`. Raises APIError(400) naming the first bad field.
    Without max_tokens: OpenAI's 16, within the server's `default_max_tokens`. `memo`: recently
    encoded text prompts, per namespace (server/openai/prompt_memo.py)."""
    model = params.check_model(body.model, engine.model_id)
    salt = check_salt(body.cache_salt)
    params.check_prompt_cache_key(body.prompt_cache_key)  # a routing hint only: not in the namespace
    params.check_unsupported(body)
    n = params.check_n(body.n)
    best_of = n if body.best_of is None else body.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise bad_request(f"best_of must be between n ({n}) and {MAX_CHOICES}", "best_of")
    if best_of > n and body.stream:
        raise bad_request("best_of > n cannot be streamed", "best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}", "logprobs")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")
    if body.max_tokens == 0 and best_of > 1:
        raise bad_request("max_tokens 0 returns the prompt once: n and best_of must be 1", "n")
    if body.suffix:
        raise bad_request("suffix needs a model with fill-in-the-middle tokens; this model has none", "suffix")
    constraint = params.response_constraint(body.response_format)
    keyed = None if memo is None else (memo, namespace(engine.model_id, tenant_id, salt))
    given = given_prompts(body.prompt)
    prompts = [prompt_token_ids(p, engine, keyed) for p in given]
    for ids in prompts:
        check_fits(len(ids), engine.max_model_len, scoring=bool(body.echo) and body.max_tokens == 0)
    if len(prompts) > 1 and best_of > n:
        raise bad_request("best_of > n needs a single prompt", "best_of")
    prompt_ids = prompts[0]
    num_logprobs = body.logprobs if body.logprobs is not None else (0 if best_of > n else None)
    sampling = params.sampling_params(body, body.max_tokens, min(COMPLETION_MAX_TOKENS, default_max_tokens),
                                      engine.max_model_len, max(len(ids) for ids in prompts),
                                      engine.vocab_size, num_logprobs, constraint,
                                      prompt_logprobs=body.logprobs if body.echo else None,
                                      zero_tokens_ok=bool(body.echo), session_budget_tokens=engine.session_budget_tokens,
                                      num_choices=best_of)
    shape = CompletionShape(id=new_id("cmpl"), model=model, include_usage=include_usage(body),
                            fingerprint=engine.health().fingerprint,
                            logprobs=None if body.logprobs is None else LogprobRenderer(engine.tokenizer),
                            echo=tuple((engine.tokenizer.decode(ids, skip_special_tokens=False), ids[0]) for ids in prompts)
                            if body.echo else (),
                            per_prompt=best_of)
    # a text prompt's client sends the completion back as text, a prompt of ids as ids (engine/cache_writer.py)
    first = prepared(engine, body, prompt_ids, sampling, tenant_id, salt, shape, best_of, n,
                     text_history=isinstance(given[0], str))
    more = tuple(replace(first.request, request_id=f"{shape.id}-{k}", prompt_ids=tuple(ids),
                         text_history=isinstance(given[k], str))
                 for k, ids in enumerate(prompts[1:], 1))
    return replace(first, more=more)


def prepared(
    engine: EngineClient, body: Any, prompt_ids: list[int], sampling: SamplingParams, tenant_id: str,
    salt: str, shape: Shape, num_choices: int = 1, num_returned: int | None = None, history: HistoryForm | None = None,
    text_history: bool = True, continues: bool = False,
) -> Prepared:
    """The engine Request (namespace from the tenant and salt alone) and the response shape;
    `history`, `text_history`: how the client's next request holds the reply; `continues`: the reply is
    likely to be continued (types.Request)."""
    request = Request(
        request_id=shape.id,
        namespace=namespace(engine.model_id, tenant_id, salt),
        prompt_ids=tuple(prompt_ids),
        sampling=sampling,
        num_choices=num_choices,
        text_history=text_history,
        history=history,
        continues=continues,
    )
    return Prepared(request=request, shape=shape, stream=bool(body.stream), tenant_id=tenant_id,
                    num_returned=num_returned if num_returned != num_choices else None)


def include_usage(body: Any) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def given_prompts(prompt: Any) -> list[Any]:
    """str | list[int] | [str, ...] | [list[int], ...] -> the prompts as given, one per entry."""
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        return prompt
    return [prompt]


def prompt_token_ids(prompt: Any, engine: EngineClient, memo: tuple[PromptMemo, Namespace] | None = None) -> list[int]:
    """str | list[int] -> token ids (non-empty)."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        check_chars(len(prompt), engine.max_model_len, "prompt")
        text = params.check_text(prompt, "prompt")
        if memo is None:
            ids = engine.tokenizer.encode(text)
        else:
            ids = memo[0].ids(memo[1], input_digest("text", text), lambda: engine.tokenizer.encode(text))
        if not ids:
            raise bad_request("prompt encodes to no tokens", "prompt")
        return list(ids)
    if isinstance(prompt, list):
        return params.check_token_ids(prompt, engine.vocab_size, "prompt")
    raise bad_request("prompt must be a string or a list of integer token ids", "prompt")


MAX_CHARS_PER_TOKEN = 64  # far above any real text's average; bounds tokenizer work on hostile input


def check_chars(num_chars: int, max_model_len: int, param: str) -> None:
    """Refuse text that cannot fit the context before spending seconds tokenizing it."""
    if num_chars > max_model_len * MAX_CHARS_PER_TOKEN:
        raise bad_request(
            f"the prompt is {num_chars} characters; this model's context is {max_model_len} tokens",
            param,
            "context_length_exceeded",
        )


def check_fits(prompt_len: int, max_model_len: int, scoring: bool = False, param: str = "prompt") -> None:
    """The prompt plus at least one generated token must fit the context (the engine checks it too);
    `scoring` (echo with max_tokens 0: nothing is generated) the prompt alone, as evaluation harnesses
    send windows of exactly the context's length. `param`: the field the prompt came from (chat's
    `messages`)."""
    if prompt_len + (0 if scoring else 1) > max_model_len:
        raise bad_request(
            f"the prompt is {prompt_len} tokens; this model's context is {max_model_len} tokens"
            + ("" if scoring else " including at least one generated token"),
            param,
            "context_length_exceeded",
        )
