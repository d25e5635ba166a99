"""POST /tokenize and POST /detokenize (vLLM's shapes): the token ids the server keys a prompt by.

`/tokenize` takes a `prompt` (text, encoded exactly as /v1/completions encodes it, or token ids) or
`messages` (with `tools` and `tool_choice` as a chat request takes them, rendered exactly as
/v1/chat/completions renders them, the tools fallback included; `add_generation_prompt` false leaves
the assistant header off) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``. These
are the ids the prefix cache keys on, so a client can see where two prompts part before it sends
them. `/detokenize`: ``{"tokens": [ids]}`` -> ``{"prompt": text}``. Both need a key that may
generate and name the served model or none; nothing is computed, nothing is cached or looked up.

Both keep the control tokens' text (``<|im_start|>``), as vLLM's do: a `messages` result detokenizes
to the rendered prompt and a token_str is never "" for a real token. (Generated text leaves them out:
Tokenizer.decode's default.)
"""

from __future__ import annotations

from typing import Any

from prefixserve.engine.protocol import EngineClient
from prefixserve.server import params
from prefixserve.server.chat import check_template_kwargs, check_tools, render_messages, render_prompt
from prefixserve.server.completions import prompt_token_ids
from prefixserve.server.errors import bad_request
from prefixserve.server.schemas import DetokenizeRequest, TokenizeRequest


def tokenize(body: TokenizeRequest, engine: EngineClient) -> dict[str, Any]:
    """Raises APIError(400) naming the first bad field (404 for another model)."""
    params.check_model(body.model, engine.model_id)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt" if body.prompt is not None else "messages")
    if body.add_special_tokens is False:
        raise bad_request("add_special_tokens false is not supported: the ids are those /v1/completions uses",
                          "add_special_tokens")
    if body.messages is not None:
        ids = render_prompt(engine, render_messages(body.messages), check_tools(body),
                            body.add_generation_prompt is not False, check_template_kwargs(body.chat_template_kwargs))
    else:
        for name in ("add_generation_prompt", "tools", "chat_template_kwargs"):
            if getattr(body, name) is not None:
                raise bad_request("add_generation_prompt, tools and chat_template_kwargs go with messages", name)
        ids = prompt_token_ids(body.prompt, engine)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": _token_strs(engine, ids) if body.return_token_strs else None}


def detokenize(body: DetokenizeRequest, engine: EngineClient) -> dict[str, Any]:
    params.check_model(body.model, engine.model_id)
    if not isinstance(body.tokens, list):
        raise bad_request("tokens must be a list of integer token ids", "tokens")
    ids = params.check_token_ids(body.tokens, engine.vocab_size, "tokens")
    return {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}


def _token_strs(engine: EngineClient, ids: list[int]) -> list[str]:
    """Each id decoded alone (U+FFFD for part of a character), once per distinct id."""
    texts = {i: engine.tokenizer.decode([i], skip_special_tokens=False) for i in set(ids)}
    return [texts[i] for i in ids]
