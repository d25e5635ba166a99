"""Constrained decoding with llguidance: a request's `Constraint` -> one matcher per choice that says
which tokens may come next (see docs/architecture.md, "Structured outputs").

Why llguidance: one dependency-free abi3 wheel (xgrammar 0.2.9 pulls in triton and apache-tvm-ffi);
measured here on the embedded tokenizer (49,152 tokens), a 3-property JSON schema compiles in
0.5-1.7 ms (xgrammar 6-7 ms) and a next-token mask costs 11-14 us median (xgrammar 5-7 us), both
far below a decode step (13+ ms). Both libraries' torch mask helpers are slow on the CPU (a
torch.compile'd kernel, ~12-17 ms a call), so the bitmask is unpacked here with numpy (~0.1 ms).

JSON is compact (no free whitespace): a weak model otherwise fills `max_tokens` with newlines.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefixserve.types import Constraint, InvalidRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger("prefixserve.engine")

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
COMPACT: JsonCompileOptions = {"whitespace_flexible": False}  # llguidance's JSON options: no whitespace the model may add


INT_LIMIT = 2**53 - 1  # the bound of an integer a schema leaves unbounded (`compiled_schema`)


def compiled_schema(schema: Any, part_of_all: bool = False) -> Any:
    """`schema` as it is compiled, a new object:

    - every object schema that lists its `properties` (or `patternProperties`) and says nothing of
      other keys closed to them (`additionalProperties: false`), as vLLM's and xgrammar's structured
      outputs read a schema: a forced tool call or a structured reply holds the keys it declares, not
      ones a weak model invents (`{"city": "Oslo", "properties": {...}}`). Not a part of an `allOf` or
      a schema beside one, whose parts each list only some of the keys;
    - every integer the schema leaves unbounded held to |n| <= 2^53 - 1, the largest every JSON
      reader holds exactly (JavaScript's `Number.MAX_SAFE_INTEGER`; 16 digits, as llama.cpp's
      JSON-schema grammars hold integers): JSON allows any length, and a weak model then fills
      `max_tokens` with zeros (the embedded model's `{"population":1000000000...`, measured). A bound
      the schema gives is kept. (llguidance reads bounds as doubles: 10^16 - 1 would read as 10^16.)"""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: compiled_schema(s) for name, s in v.items()}
        elif k in SCHEMA_LISTS and isinstance(v, list):
            out[k] = [compiled_schema(s, k == "allOf") for s in v]
        elif k in SCHEMA_ONE:
            out[k] = compiled_schema(v)
        else:  # const, enum, default, examples, ...: values, not schemas
            out[k] = v
    opens = ("additionalProperties", "unevaluatedProperties", "allOf", "$ref")
    if not part_of_all and ("properties" in out or "patternProperties" in out) and not any(k in out for k in opens):
        out["additionalProperties"] = False
    types = out.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        _bound_integer(out)
    return out


def _bound_integer(schema: dict[str, Any]) -> None:
    """Adds `compiled_schema`'s default bounds to an integer schema where it gives none (one a given
    bound already puts past the default is left open on that side rather than made empty)."""
    def given(*keys: str) -> Any:
        return next((schema[k] for k in keys if isinstance(schema.get(k), int | float)
                     and not isinstance(schema.get(k), bool)), None)

    low, high = given("minimum", "exclusiveMinimum"), given("maximum", "exclusiveMaximum")
    if high is None and (low is None or low <= INT_LIMIT) and "maximum" not in schema:
        schema["maximum"] = INT_LIMIT
    if low is None and (high is None or high >= -INT_LIMIT) and "minimum" not in schema:
        schema["minimum"] = -INT_LIMIT


def grammar_source(constraint: Constraint) -> str:
    """The llguidance grammar (a string) for a constraint. Raises InvalidRequest if it cannot be built."""
    import llguidance

    try:
        if constraint.kind == "lark":
            return str(llguidance.LLMatcher.grammar_from_lark(constraint.source))
        return str(llguidance.LLMatcher.grammar_from_json_schema(_schema(constraint), defaults=COMPACT))
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"the schema cannot be compiled: {e}") from None


def _schema(constraint: Constraint) -> Any:
    """A json_schema / json_object constraint's schema as it is compiled (`compiled_schema`)."""
    return {"type": "object"} if constraint.kind == "json_object" else compiled_schema(json.loads(constraint.source))


def embedded_schema(constraint: Constraint) -> dict[str, Any]:
    """A json_schema / json_object constraint as a schema to embed in a Lark grammar (`%json {...}`)
    that holds the output to what `grammar_source` compiles for the constraint alone (`compiled_schema`),
    compact JSON (`COMPACT` unless the schema's own `x-guidance` says otherwise)."""
    if constraint.kind not in ("json_schema", "json_object"):
        raise ValueError(f"a {constraint.kind} constraint has no JSON schema")
    schema = _schema(constraint)
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**COMPACT, **(own if isinstance(own, dict) else {})}}


def schema_compiles(schema: Any) -> bool:
    """Whether llguidance compiles the JSON schema `schema` (as given: no objects closed, no defaults)."""
    import llguidance

    try:
        return not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except (ValueError, TypeError):
        return False


def check_constraint(constraint: Constraint) -> None:
    """Raises InvalidRequest with llguidance's message when the grammar is not valid (no tokenizer
    needed: the server calls this before any work is queued)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_source(constraint))
    if error:
        raise InvalidRequest(f"the schema cannot be compiled: {error}")


class GrammarCompiler:
    """Builds matchers for one tokenizer (a transformers fast tokenizer; built once, ~0.4 s)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf

        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    @classmethod
    def for_tokenizer(cls, tokenizer: object, vocab_size: int) -> GrammarCompiler:
        """From our models.Tokenizer (its transformers tokenizer `hf`). Raises InvalidRequest otherwise."""
        hf = getattr(tokenizer, "hf", None)
        if hf is None:
            raise InvalidRequest("constrained decoding needs a transformers tokenizer")
        return cls(hf, vocab_size)

    def matcher(self, constraint: Constraint) -> TokenMatcher:
        """A fresh matcher at the start of the output. Raises InvalidRequest for a bad grammar."""
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer, grammar_source(constraint), log_level=0)
        if m.is_error():
            raise InvalidRequest(f"the schema cannot be compiled: {m.get_error()}")
        return TokenMatcher(m, self.vocab_size)


class TokenMatcher:
    """Where one choice's output stands in the grammar. Engine-thread only; `fork` for n > 1."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens that keep the output in the grammar (EOS when it is complete)."""
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = torch.zeros(self._vocab_size, dtype=torch.bool)
        n = min(self._vocab_size, bits.shape[0])
        mask[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        return mask

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        self._m.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete (nothing more may follow) or the matcher failed."""
        return bool(self._m.is_stopped() or self._m.is_error())

    def fork(self) -> TokenMatcher:
        return TokenMatcher(self._m.deep_copy(), self._vocab_size)
