"""Schema fuzzing of the live server with schemathesis: zero 5xx, every 4xx OpenAI-shaped.

The server's own `/openapi.json` is fetched from the running process. Its POST endpoints read the
raw body (so that every body error is ours to word) and therefore declare no request body, and
`/v1/usage` reads its query itself; fuzzing that document alone would only ever send empty bodies.
So the document is completed here, before fuzzing, with the request models the server validates
against (`prefixserve.server.openai.schemas`) and the usage query parameters, and every operation is run in
schemathesis' positive mode (schema-valid data, which reaches the model) and negative mode (data
that breaks the schema). The target is the `tiny` server (`--max-model-len 64`), so that a
schema-valid case costs at most a few dozen generated tokens.

`make test`: 40 examples per operation and mode, derandomised (the same cases every run);
`make soak`: 200 per operation and mode, random.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from prefixserve.server.openai.schemas import ChatCompletionRequest, CompletionRequest
from tests.reliability.client import ERROR_KEYS, Target, count_5xx, health, scrape, wait_idle
from tests.reliability.conftest import SOAK, scaled

pytestmark = pytest.mark.slow

USAGE_PARAMS = [
    {"name": "start_time", "in": "query", "required": True, "schema": {"type": "integer"}},
    {"name": "end_time", "in": "query", "schema": {"type": "integer"}},
    {"name": "bucket_width", "in": "query", "schema": {"type": "string", "enum": ["1m", "1h", "1d"]}},
    {"name": "group_by", "in": "query", "schema": {"type": "string"}},
    {"name": "tenant_id", "in": "query", "schema": {"type": "string"}},
    {"name": "models", "in": "query", "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "schema": {"type": "integer"}},
    {"name": "page", "in": "query", "schema": {"type": "string"}},
]


def completed_document(served: dict[str, Any]) -> dict[str, Any]:
    """The served OpenAPI document plus request bodies and the usage query (see the module docstring)."""
    doc = copy.deepcopy(served)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (
        ("/v1/completions", CompletionRequest),
        ("/v1/chat/completions", ChatCompletionRequest),
    ):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    doc["paths"]["/v1/usage"]["get"]["parameters"] = USAGE_PARAMS
    return doc


_TEXT = {"type": "string", "minLength": 1, "maxLength": 80}
_SAMPLING = {
    # enums, not integer ranges: JSON Schema's integer admits 5.0, which the server's strict parsing refuses
    "max_tokens": {"enum": [1, 2, 3, 5, 8]},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"enum": [-1, 0, 1, 5, 50]},
    "seed": {"enum": [0, 1, 42, 2**32, 2**63 - 1]},
    "stop": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 256},
    "user": {"type": "string"},
    "ignore_eos": {"type": "boolean"},
}
_REFINED_BODIES = {
    "/v1/completions": {
        "type": "object", "additionalProperties": False, "required": ["prompt", "max_tokens"],
        "properties": {**_SAMPLING, "prompt": {"anyOf": [
            _TEXT, {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 49151}, "minItems": 1,
                    "maxItems": 24}]}},
    },
    "/v1/chat/completions": {
        "type": "object", "additionalProperties": False, "required": ["messages", "max_tokens"],
        "properties": {**_SAMPLING, "messages": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "user", "assistant"]},
                "content": {"anyOf": [_TEXT, {"type": "array", "maxItems": 2, "items": {
                    "type": "object", "additionalProperties": False, "required": ["type", "text"],
                    "properties": {"type": {"const": "text"}, "text": _TEXT}}}]},
            }}}},
    },
}  # fmt: skip


def refined_document(completed: dict[str, Any]) -> dict[str, Any]:
    """`completed` with each generation body narrowed to what the server accepts (short prompts,
    max_tokens <= 8, supported fields only), so that positive-mode cases mostly reach the model."""
    doc = copy.deepcopy(completed)
    for path, body in _REFINED_BODIES.items():
        doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"] = body
    return doc


def check_response(status: int, content: bytes, label: str) -> str | None:
    """None if fine; otherwise what is wrong."""
    if status >= 500:
        return f"{label}: {status} {content[:300]!r}"
    if 400 <= status < 500:
        try:
            body = json.loads(content)
        except ValueError:
            return f"{label}: {status} with a non-JSON body {content[:200]!r}"
        if not (isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == ERROR_KEYS):
            return f"{label}: {status} not OpenAI-shaped: {content[:300]!r}"
    return None


def fuzz(target: Target, op: Any, mode: GenerationMode, label: str, examples: int, statuses: Counter[str],
         problems: list[str]) -> None:  # fmt: skip
    """Send up to `examples` generated cases of one operation; count statuses, note every bad answer."""
    auth = target.auth("alice")

    @settings(max_examples=examples, deadline=None, database=None, derandomize=not SOAK,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])  # fmt: skip
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=target.base_url, headers=auth, timeout=300)
        statuses[f"{response.status_code // 100}xx"] += 1
        problem = check_response(response.status_code, response.content, label)
        if problem is not None:
            body = json.dumps(case.body, ensure_ascii=True) if case.body is not None else ""
            problems.append(
                f"{problem}\n    sent: {case.method} {case.formatted_path} query={case.query} body={body}"
            )

    try:
        run()
    except Exception as e:  # negative mode of an operation with nothing to break is unsatisfiable
        if "unsatisfiable" not in f"{type(e).__name__} {e}".lower():
            raise


def test_schema_fuzz_finds_no_5xx(tiny: Target) -> None:
    served = httpx.get(tiny.base_url + "/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(served["paths"])
    completed = completed_document(served)
    runs = []
    for name, doc, modes in (("", completed, (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)),
                             (" refined", refined_document(completed), (GenerationMode.POSITIVE,))):  # fmt: skip
        results = list(schemathesis.openapi.from_dict(doc).get_all_operations())
        operations = [result.ok() for result in results if isinstance(result, Ok)]
        assert len(operations) == len(results) >= 7, [
            result for result in results if not isinstance(result, Ok)
        ]
        runs += [(op, mode, name) for op in operations for mode in modes if name == "" or op.method == "post"]
    statuses: Counter[str] = Counter()
    problems: list[str] = []
    before = scrape(tiny)
    for op, mode, name in runs:
        fuzz(
            tiny,
            op,
            mode,
            f"{op.method.upper()} {op.path} [{mode.value}{name}]",
            scaled(40, 200),
            statuses,
            problems,
        )
    wait_idle(tiny)
    after = scrape(tiny)
    total = sum(statuses.values())
    print(
        f"\nschema fuzz: {total} cases in {len(runs)} runs (operation x mode): {dict(sorted(statuses.items()))}"
    )
    assert not problems, "\n".join(problems[:20])
    assert count_5xx(after) == count_5xx(before)
    assert statuses["2xx"] > 0 and statuses["4xx"] > 0
    assert health(tiny)["ok"]
