"""Tokenizer and chat template through `transformers` (from a GGUF file or a model folder)."""

from __future__ import annotations

import copy
import json
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from prefixserve.models.arch import ModelLoadError
from prefixserve.models.thinking import split_reasoning
from prefixserve.types import HistoryForm, TemplateError, lcp

MARK_OPEN, MARK_CLOSE = "\ue000\ue001", "\ue002"  # private-use characters around a written text's number
MARK = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")
ECHO_CONTEXT = 64  # prompt tokens before a reply that `next_turn` re-encodes with it, at most
MAX_FORMS = 64  # template kwargs whose history_form is kept
PROBE = "Reply-7f3a9."  # the assistant message `history_form` renders to find where a reply goes
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback: one raw byte


def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE spells byte b as one printable
    character (bytes that are already printable as themselves, the others as chr(256 + k))."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    extra = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + k): b for k, b in enumerate(extra)}}


BYTE_LEVEL_CHARS = _unicode_to_bytes()


END_TOKENS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>"})


class Tokenizer:
    """Wraps a transformers tokenizer. Thread-safe: one lock around every call, since a Hugging Face
    fast tokenizer used from two threads at once can fail ("Already borrowed", huggingface/tokenizers
    #537). The server's worker threads share one instance under its lock; the engine thread gets its
    own copy (`copy()`), so encoding a huge prompt never holds up the streams it detokenises."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        self._extra_eos_ids = tuple(extra_eos_ids)
        self._lock = threading.Lock()
        eos = [i for i in [hf_tokenizer.eos_token_id, *extra_eos_ids] if isinstance(i, int)]
        # and the control tokens that only ever end a text or a turn (as llama.cpp's end-of-generation
        # set): the embedded model's file names <|im_end|> its eos, yet a raw completion that samples
        # <|endoftext|> has ended its document
        eos += sorted(i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()
                      if getattr(t, "special", False) and t.content in END_TOKENS)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.vocab_size = len(hf_tokenizer)
        specials = sorted({t.content for t in getattr(hf_tokenizer, "added_tokens_decoder", {}).values()
                           if getattr(t, "special", False) and t.content}, key=len, reverse=True)
        # the control tokens' texts: in a chat message they are text, never the tokens (render_chat)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._added = set(getattr(hf_tokenizer, "added_tokens_decoder", {}))
        self._special_ids = {i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()
                             if getattr(t, "special", False)}
        self._forms: dict[str, tuple[int, str, int | None]] = {}  # history_form's, per template kwargs
        # a thinking model's </think> token, which ends a reply's reasoning (server/openai/reasoning.py); else None
        self.think_end_id = _think_end_id(hf_tokenizer)
        self.thinks = self.think_end_id is not None
        decoder = getattr(getattr(hf_tokenizer, "backend_tokenizer", None), "decoder", None)
        state = decoder.__getstate__() if decoder is not None else b""
        self._byte_level = b'"type":"ByteLevel"' in state or hasattr(hf_tokenizer, "byte_decoder")

    @property
    def extra_eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids beyond the tokenizer's own (a folder's generation_config.json)."""
        return self._extra_eos_ids

    def copy(self) -> Tokenizer:
        """An independent tokenizer (its own backend and lock) for another thread."""
        with self._lock:
            return Tokenizer(copy.deepcopy(self.hf), self._extra_eos_ids)

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Generated text leaves the control tokens out; /detokenize keeps them (server/openai/tokenize.py)."""
        with self._lock:
            return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for. Decoding a single id cannot give them when the token
        is part of a UTF-8 character (an emoji's first bytes decode to U+FFFD), and OpenAI's logprobs
        `bytes` exist so that a client can join such tokens back into the character. Byte-level BPE
        (GPT-2, SmolLM2, Qwen): the token's characters through the inverse of bytes_to_unicode;
        SentencePiece: `<0xF0>` is that byte and "▁" a space; special and added tokens, and any
        other tokenizer, their decoded text."""
        with self._lock:
            piece = self.hf.convert_ids_to_tokens(token_id)
            if token_id in self._added or not isinstance(piece, str):
                return str(self.hf.decode([token_id], skip_special_tokens=True)).encode()
            if self._byte_level and all(c in BYTE_LEVEL_CHARS for c in piece):
                return bytes(BYTE_LEVEL_CHARS[c] for c in piece)
            if m := BYTE_TOKEN.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            if "\u2581" in piece:
                return piece.replace("\u2581", " ").encode()
            return str(self.hf.decode([token_id], skip_special_tokens=True)).encode()

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The template's text as token ids (`template_kwargs`: extra template variables). Text a client wrote (message contents, tool calls and
        definitions) that spells a control token, say `<|im_end|>`, stays text: it is swapped for a
        marker while the template runs and encoded with special tokens split, so no message can open
        a turn of its own (as OpenAI's API treats such text). Prompts without such text encode as
        the template's whole text always has."""
        if not getattr(self.hf, "chat_template", None):
            raise TemplateError("this model has no chat template; use /v1/completions")
        written: list[str] = []
        if self._specials is not None:
            messages, tools = self._marked(messages, written), self._marked(tools, written)
            template_kwargs = self._marked(template_kwargs, written)
        with self._lock:
            try:
                text = self.hf.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
                    **(template_kwargs or {}),
                )
            except Exception as e:  # jinja errors, raise_exception() in templates, bad message shapes
                raise TemplateError(f"chat template rejected the messages: {e}") from e
            if not written:
                return list(self.hf.encode(text, add_special_tokens=False))
            pieces = MARK.split(text)  # template text, marker number, template text, ...
            if sorted(int(k) for k in pieces[1::2]) != list(range(len(written))):
                raise TemplateError("a message spells one of the model's control tokens in a place this chat "
                                    "template rewrites; remove the control token text")
            ids: list[int] = []
            for k, piece in enumerate(pieces):
                if k % 2:
                    ids += self.hf.encode(written[int(piece)], add_special_tokens=False, split_special_tokens=True)
                elif piece:
                    ids += self.hf.encode(piece, add_special_tokens=False)
            return ids

    def next_turn(self, prompt_ids: Sequence[int], reply_ids: Sequence[int],
                  form: HistoryForm | None = None) -> tuple[int, ...] | None:
        """Prompt + reply as a client's next request holds them when it sends the reply back as text.
        A model may sample another split of the same text than the tokenizer's ("\n\n" then "1" where
        encoding gives "\n" then "\n1"); a chat template may write the reply back otherwise than
        its generation prompt led into it (`form`: an empty think block gone, the reasoning left
        out); and the next turn's cache hit would end there (docs/cache.md, "Finished turns").
        The prompt, less `form.drop` tokens, then the encoding of its last text run (after its last
        added token, where encoding starts afresh) followed by `form.lead` and the reply's text (its
        answer, where the server splits the reasoning off), less that run; a stop token ending the
        reply stays as it is, or becomes the template's own end of a turn (`form.end`: a model that
        ended its reply with another of its stop tokens, `<|endoftext|>` where the template writes
        `<|im_end|>`, is sent back with the template's). A run longer than ECHO_CONTEXT tokens is cut to its last ones:
        splitting text into words looks a few characters back, so the reply's tokens come out the
        same, and the work stays small (a wrong guess would only cost a cache hit: the entry is
        exact for its key whatever it is). None where that encoding would not be the next
        request's: a prompt run that does not encode to itself, a reply holding control tokens or
        their text."""
        drop, lead, thinking = (0, "", None) if form is None else (form.drop, form.lead, form.thinking)
        end = next((k for k, t in enumerate(reply_ids) if t in self.eos_token_ids), len(reply_ids))
        content, rest = list(reply_ids[:end]), tuple(reply_ids[end:])
        if form is not None and form.end is not None and len(rest) == 1:
            rest = (form.end,)
        head = prompt_ids[: len(prompt_ids) - drop]
        start = len(head)
        while start > 0 and head[start - 1] not in self._added and len(head) - start < ECHO_CONTEXT:
            start -= 1
        run = list(head[start:])
        if any(t in self._special_ids for t in content):
            return None
        with self._lock:
            run_text = self.hf.decode(run, skip_special_tokens=False) if run else ""
            text = self.hf.decode(content, skip_special_tokens=False)
            if self._specials is not None and self._specials.search(text):
                return None
            if thinking is not None:
                text = split_reasoning(text, thinking)[1]
            ids = list(self.hf.encode(run_text + lead + text, add_special_tokens=False))
        if ids[: len(run)] != run:
            return None
        return tuple(head) + tuple(ids[len(run):]) + rest

    def history_form(self, template_kwargs: dict[str, Any] | None = None) -> tuple[int, str, int | None]:
        """(drop, lead, end) of `HistoryForm` for this chat template: how it writes an assistant reply
        into a later request's history against how its generation prompt ends (Qwen3's with thinking
        off: the prompt ends in an empty think block the history does not have, drop 4), and the stop
        token it writes right after a reply (`<|im_end|>`; None where it writes none). Probed once per
        template kwargs by rendering a user message alone and again followed by a reply and another
        message; (0, "", None) where the template refuses the probe or writes the reply elsewhere."""
        key = json.dumps(template_kwargs or {}, sort_keys=True, default=str)
        if key not in self._forms:
            if len(self._forms) >= MAX_FORMS:  # kwargs are the client's: never an unbounded memo
                self._forms.clear()
            ask = [{"role": "user", "content": "Hi."}]
            try:
                prompt = self.render_chat(ask, None, True, template_kwargs)
                history = self.render_chat(ask + [{"role": "assistant", "content": PROBE}, {"role": "user", "content": "Ok."}],
                                           None, False, template_kwargs)
            except TemplateError:
                self._forms[key] = (0, "", None)
                return self._forms[key]
            n = lcp(prompt, history)
            with self._lock:
                after = self.hf.decode(history[n:], skip_special_tokens=False)
                # the token after the reply's last: the first k whose decoded prefix holds all of PROBE
                k = next((k for k in range(n, len(history)) if PROBE in self.hf.decode(history[n : k + 1])), None)
            at = after.find(PROBE)
            follows = history[k + 1] if k is not None and k + 1 < len(history) else None
            end = follows if follows in self.eos_token_ids else None
            self._forms[key] = (len(prompt) - n, after[:at], end) if at >= 0 else (0, "", None)
        return self._forms[key]

    def _marked(self, value: Any, written: list[str]) -> Any:
        """`value` with each string that spells a control token replaced by a marker (its text kept in
        `written`); the same object where nothing is replaced."""
        assert self._specials is not None
        if isinstance(value, str):
            if not self._specials.search(value):
                return value
            written.append(value)
            return f"{MARK_OPEN}{len(written) - 1}{MARK_CLOSE}"
        if isinstance(value, dict):
            new = {k: self._marked(v, written) for k, v in value.items()}
            return value if all(new[k] is value[k] for k in value) else new
        if isinstance(value, list):
            items = [self._marked(v, written) for v in value]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        return value


def _think_end_id(hf: Any) -> int | None:
    """</think>'s id for a thinking model's tokenizer: <think> and </think> are tokens that decode as text
    (not skipped as special) and the chat template writes them (server/openai/reasoning.py splits such replies)."""
    template = hf.chat_template if isinstance(getattr(hf, "chat_template", None), str) else ""
    if "<think>" not in template:
        return None
    added = {t.content: t for t in getattr(hf, "added_tokens_decoder", {}).values()}
    vocab = hf.get_vocab()
    if not all(tag in vocab and not getattr(added.get(tag), "special", False) for tag in ("<think>", "</think>")):
        return None
    return int(vocab["</think>"])


def load_tokenizer_gguf(path: str, architecture: str | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file, as `AutoTokenizer.from_pretrained(folder, gguf_file=...)` builds it.

    `architecture`: the file's general.architecture where the caller has read it (else read here).
    Where AutoTokenizer would pick the generic `TokenizersBackend` (`_gguf_tokenizer_class`), that
    class is called directly with the same arguments: the same tokenizer (tests/runner/
    test_tokenizer_gguf.py), without AutoTokenizer's config step, which parsed the whole file again
    with the `gguf` package's reader (the 49k-token vocabulary field by field: ~7 s of a first start
    on the 2-core machine). Raises ModelLoadError where the tokenizer cannot be built."""
    import transformers

    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    try:
        if architecture is None:
            from prefixserve.models.loaders.hybrid_gguf import gguf_architecture

            architecture = gguf_architecture(path)
        cls = _gguf_tokenizer_class(folder, architecture) or transformers.AutoTokenizer
        tok = cls.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {type(e).__name__}: {e}") from e
    return Tokenizer(tok)


# GGUF architectures whose transformers model type maps to no tokenizer class of its own (llama) or to
# TokenizersBackend (mistral): AutoTokenizer builds such a file's tokenizer with TokenizersBackend
# (tests/runner/test_tokenizer_gguf.py checks the mapping against the installed transformers)
GENERIC_TOKENIZER_ARCHS = ("llama", "mistral")


def _gguf_tokenizer_class(folder: str, architecture: str | None) -> Any:
    """`TokenizersBackend` where AutoTokenizer resolves a GGUF file in `folder` to it without reading
    anything but the file: an architecture in GENERIC_TOKENIZER_ARCHS and no tokenizer_config.json
    beside the file (which could name another class). None otherwise: the caller asks AutoTokenizer."""
    if architecture not in GENERIC_TOKENIZER_ARCHS or os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        return None
    from transformers import TokenizersBackend

    return TokenizersBackend


def _tokenizer_class(folder: str) -> Any:
    """The class its tokenizer_config.json names where transformers exports it, else AutoTokenizer
    (which resolves the same class; importing its model registry took ~0.4-0.65 s of a start-up)."""
    import transformers

    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str) and name.isidentifier() and name.endswith(("Backend", "TokenizerFast")):
        cls = getattr(transformers, name, None)
        if cls is not None and hasattr(cls, "from_pretrained"):
            return cls
    return transformers.AutoTokenizer


def load_tokenizer_folder(folder: str, extra_eos_ids: Sequence[int] | None = None) -> Tokenizer:
    """extra_eos_ids: None = from the folder's generation_config.json."""
    try:
        tok = _tokenizer_class(folder).from_pretrained(folder)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {folder}: {type(e).__name__}: {e}") from e
    extra: list[int] = list(extra_eos_ids or ())
    gen_path = os.path.join(folder, "generation_config.json")
    if extra_eos_ids is None and os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
        except (OSError, ValueError):
            pass
    return Tokenizer(tok, extra)
