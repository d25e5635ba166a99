"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's shapes): the token ids the server
keys a prompt by, and the tokenizer's settings.

`/tokenize` takes vLLM's two request forms and answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` (`token_strs` null unless `return_token_strs`):

- ``{"model", "prompt", "add_special_tokens"}``: `prompt` text (or token ids, returned as given).
  `add_special_tokens` true (the default) encodes it exactly as /v1/completions does (with the BOS a
  tokenizer adds, where it adds one); false encodes the text alone, as evaluation harnesses ask
  (lm-eval's remote tokenizer). An empty text is no tokens (plus the special ones), not an error.
- ``{"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
  "tools", "tool_choice", "chat_template_kwargs"}``: rendered exactly as /v1/chat/completions renders
  them, the tools fallback included. `add_generation_prompt` (default true, false when
  `continue_final_message`) ends with the assistant header; `continue_final_message` ends with the
  last message's content (an assistant message) instead of the template's end-of-turn, so the model
  would go on writing it; both true is a 400, as in vLLM. `add_special_tokens` (default false here,
  as in vLLM: the template writes its own) adds the tokenizer's special tokens around the rendered
  ids.

With the defaults these are the ids the prefix cache keys on, so a client can see where two prompts
part before it sends them. `/detokenize`: ``{"model", "tokens": [ids]}`` -> ``{"prompt": text}``.
`/tokenizer_info`: the tokenizer's configuration as vLLM returns it (tokenizer_config.json's fields:
`bos_token`, `eos_token`, `pad_token`, `unk_token`, `model_max_length`, `chat_template`, ...,
plus `tokenizer_class`), with no file path of the server's. /tokenize and /detokenize need a key that
may generate and name the served model or none; /tokenizer_info any key (as /v1/models); nothing is
computed, nothing is cached or looked up.

/tokenize and /detokenize keep the control tokens' text (``<|im_start|>``), as vLLM's do: a
`messages` result detokenizes to the rendered prompt and a token_str is never "" for a real token.
(Generated text leaves them out: Tokenizer.decode's default.)
"""

from __future__ import annotations

import contextlib
from typing import Any

from prefixserve.engine.protocol import EngineClient, TokenizerLike
from prefixserve.server.errors import bad_request
from prefixserve.server.openai import params
from prefixserve.server.openai.chat import check_template_kwargs, check_tools, render_messages, render_prompt
from prefixserve.server.openai.completions import check_chars, prompt_token_ids
from prefixserve.server.openai.schemas import DetokenizeRequest, TokenizeRequest

CONTINUE_TAIL = 16  # the most template tokens after a final message's content that continue_final_message drops
CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "tools", "tool_choice", "chat_template_kwargs")
# tokenizer_config.json fields that name files on the server's disk: never sent
_PATH_FIELDS = ("name_or_path", "is_local", "local_files_only", "cache_dir")


def tokenize(body: TokenizeRequest, engine: EngineClient) -> dict[str, Any]:
    """Raises APIError(400) naming the first bad field (404 for another model)."""
    params.check_model(body.model, engine.model_id)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt" if body.prompt is not None else "messages")
    if body.messages is not None:
        ids = _chat_ids(body, engine)
    else:
        for name in CHAT_ONLY:
            if getattr(body, name) is not None:
                raise bad_request(f"{name} goes with messages, not prompt", name)
        ids = _prompt_ids(body.prompt, engine, body.add_special_tokens is not False)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": _token_strs(engine, ids) if body.return_token_strs else None}


def detokenize(body: DetokenizeRequest, engine: EngineClient) -> dict[str, Any]:
    params.check_model(body.model, engine.model_id)
    if not isinstance(body.tokens, list):
        raise bad_request("tokens must be a list of integer token ids", "tokens")
    ids = params.check_token_ids(body.tokens, engine.vocab_size, "tokens") if body.tokens else []
    return {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(engine: EngineClient) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's init settings (tokenizer_config.json's fields, special
    tokens as their text) with `tokenizer_class` and the chat template the server renders with.
    Fields naming files or folders on the server are left out; `model_max_length` is the served
    context where the tokenizer's own is unset (transformers' 1e30) or larger."""
    tok = engine.tokenizer
    hf = getattr(tok, "hf", None)
    if hf is None:  # a tokenizer without transformers' settings: the fields a client reads
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
        if tok.eos_token_ids:
            info["eos_token"] = tok.decode([tok.eos_token_ids[0]], skip_special_tokens=False)
    else:
        with _lock(tok):
            init = dict(getattr(hf, "init_kwargs", None) or {})
            info = {k: _jsonable(v) for k, v in init.items()
                    if not k.endswith("_file") and k not in _PATH_FIELDS}
            for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
                if info.get(name) is None and (value := getattr(hf, name, None)) is not None:
                    info[name] = str(value)
            if template := getattr(hf, "chat_template", None):
                info["chat_template"] = template
            info["tokenizer_class"] = type(hf).__name__
    limit = info.get("model_max_length")
    if not isinstance(limit, int) or limit > engine.max_model_len:
        info["model_max_length"] = engine.max_model_len
    return info


def _prompt_ids(prompt: Any, engine: EngineClient, special: bool) -> list[int]:
    if isinstance(prompt, str) and not prompt:  # vLLM's answer: no tokens but the special ones
        prefix, suffix = _affixes(engine.tokenizer) if special else ([], [])
        return prefix + suffix
    if special or not isinstance(prompt, str):
        return prompt_token_ids(prompt, engine)  # exactly what /v1/completions sends
    check_chars(len(prompt), engine.max_model_len, "prompt")
    return _plain(engine.tokenizer, params.check_text(prompt, "prompt"))


def _chat_ids(body: TokenizeRequest, engine: EngineClient) -> list[int]:
    cont = body.continue_final_message is True
    if cont and body.add_generation_prompt is True:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    messages = render_messages(body.messages or [])
    add_generation_prompt = body.add_generation_prompt if body.add_generation_prompt is not None else not cont
    ids = render_prompt(engine, messages, check_tools(body), add_generation_prompt,
                        check_template_kwargs(body.chat_template_kwargs))
    if cont:
        ids = _continued(engine, ids, messages[-1])
    if body.add_special_tokens is True:
        prefix, suffix = _affixes(engine.tokenizer)
        ids = prefix + ids + suffix
    return ids


def _continued(engine: EngineClient, ids: list[int], last: dict[str, Any]) -> list[int]:
    """`ids` cut just after the final message's content: the template's end-of-turn tokens dropped
    (vLLM's continue_final_message). Raises APIError(400) for a final message that is not an
    assistant's with content, or a template that does not end it with its content."""
    content = str(last.get("content") or "")
    want = content.rstrip()  # as a template that trims it writes it
    if last["role"] != "assistant" or not want or last.get("tool_calls"):
        raise bad_request("continue_final_message continues a final assistant message with text content",
                          "messages")
    for end in range(len(ids), max(0, len(ids) - CONTINUE_TAIL) - 1, -1):
        text = engine.tokenizer.decode(ids[:end], skip_special_tokens=False)
        if text.endswith((content, want)):
            return ids[:end]
    raise bad_request("this chat template does not end the final message with its content; it cannot be continued",
                      "continue_final_message")


def _lock(tok: TokenizerLike) -> Any:
    """The lock models/tokenizer.py's Tokenizer serializes its transformers calls on (a fast
    tokenizer used from two threads at once can fail); no lock for one without."""
    return getattr(tok, "_lock", None) or contextlib.nullcontext()


def _plain(tok: TokenizerLike, text: str) -> list[int]:
    """`text` encoded without the special tokens the tokenizer adds (add_special_tokens=False)."""
    hf = getattr(tok, "hf", None)
    if hf is None:  # a tokenizer that adds none (the tests' fake)
        return list(tok.encode(text))
    with _lock(tok):
        return list(hf.encode(text, add_special_tokens=False))


def _affixes(tok: TokenizerLike) -> tuple[list[int], list[int]]:
    """The special tokens encoding adds before and after a text (a BOS, say), read off a one-letter text."""
    hf = getattr(tok, "hf", None)
    if hf is None:
        return [], []
    with _lock(tok):
        full, bare = list(hf.encode("a", add_special_tokens=True)), list(hf.encode("a", add_special_tokens=False))
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return [], []


def _jsonable(value: Any) -> Any:
    """A tokenizer setting as JSON: special tokens (transformers' AddedToken) as their text."""
    if hasattr(value, "content"):
        return str(value.content)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _token_strs(engine: EngineClient, ids: list[int]) -> list[str]:
    """Each id decoded alone (U+FFFD for part of a character), once per distinct id."""
    texts = {i: engine.tokenizer.decode([i], skip_special_tokens=False) for i in set(ids)}
    return [texts[i] for i in ids]
