"""The schema a structured reply is held to (`grammar.compiled_schema`): integers a schema leaves
unbounded hold |n| <= 2^53 - 1 (16 digits, as in llama.cpp's JSON-schema grammars); a bound the
schema gives is kept.
QA (AMD EPYC Zen 4, 2026-12-06): the embedded model wrote `{"name":"Lisbon","population":1000...` to
`max_tokens` under an unbounded integer, and a `json_schema` reply never finished."""

from __future__ import annotations

import json

import pytest

from prefixserve.engine.grammar import INT_LIMIT, compiled_schema
from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_gguf
from prefixserve.types import Constraint
from tests.server.test_tool_call_echo import matches

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer_gguf(embedded_model_path())


def city(population: str) -> str:
    return '{"name":"Lisbon","population":' + population + "}"


def test_an_unbounded_integer_is_held_to_what_every_json_reader_holds_exactly(tok: Tokenizer) -> None:
    c = Constraint("json_schema", json.dumps(CITY))
    for n in ("0", "-7", "545000", str(2**53 - 1), str(1 - 2**53)):
        assert matches(tok, c, city(n)), n
    for n in (str(2**53), str(-(2**53)), "1" + "0" * 16, "9" * 16, "0" * 20, "01"):
        assert not matches(tok, c, city(n)), n


def test_a_bound_the_schema_gives_is_kept(tok: Tokenizer) -> None:
    small = {**CITY, "properties": {**CITY["properties"], "population": {"type": "integer", "maximum": 100}}}
    c = Constraint("json_schema", json.dumps(small))
    assert matches(tok, c, city("100")) and matches(tok, c, city(str(1 - 2**53)))
    assert not matches(tok, c, city("101"))
    # a minimum past the default maximum leaves the maximum open rather than the schema empty
    big = {"type": "integer", "minimum": 10**17}
    assert compiled_schema(big) == {"type": "integer", "minimum": 10**17}
    c = Constraint("json_schema", json.dumps(big))
    assert matches(tok, c, "1" + "0" * 25) and not matches(tok, c, "9" * 16)


def test_bounds_reach_nested_optional_and_tool_schemas() -> None:
    schema = {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": ["integer", "null"]}},
        "n": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "string"}]},
        "f": {"type": "number"}, "b": {"type": "boolean"}}}
    out = compiled_schema(schema)
    assert out["properties"]["xs"]["items"] == {"type": ["integer", "null"], "minimum": -INT_LIMIT, "maximum": INT_LIMIT}
    assert out["properties"]["n"]["anyOf"][0] == {"type": "integer", "exclusiveMinimum": 0, "maximum": INT_LIMIT}
    assert out["properties"]["f"] == {"type": "number"} and out["properties"]["b"] == {"type": "boolean"}
    assert out["additionalProperties"] is False and "maximum" not in schema["properties"]["xs"]["items"]
