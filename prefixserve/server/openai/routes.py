"""The OpenAI surface's routes: models, completions, chat, the Responses API and its stored
responses, tokenize / detokenize.

Each handler authenticates (server/operator/auth.py), parses its body (schemas.py), prepares the
engine request (completions.py, chat.py, responses/prepare.py) and answers it (respond.py). The
app's shared objects come from `server_state(request)` (server/state.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from prefixserve.server.errors import APIError
from prefixserve.server.openai.chat import prepare_chat
from prefixserve.server.openai.completions import prepare_completion
from prefixserve.server.openai.prompt_memo import NotRemembered
from prefixserve.server.openai.respond import respond
from prefixserve.server.openai.responses.items import listed
from prefixserve.server.openai.responses.prepare import prepare_response
from prefixserve.server.openai.responses.store import Stored
from prefixserve.server.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    parse_body,
)
from prefixserve.server.openai.shapes import Prepared
from prefixserve.server.openai.tokenize import detokenize, tokenize, tokenizer_info
from prefixserve.server.operator.accounting import RequestTracker
from prefixserve.server.request_input import authorization, read_body
from prefixserve.server.state import ServerState, server_state

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.keys.identify(authorization(request))
    return {"object": "list", "data": [model_card(state)]}


@router.get("/v1/models/{model_name:path}")
async def get_model(model_name: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.keys.identify(authorization(request))
    if model_name != state.engine.model_id:
        raise APIError(
            404, f"The model '{model_name}' does not exist", param="model", code="model_not_found"
        )
    return model_card(state)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    tenant_id = server_state(request).keys.tenant_for_generation(authorization(request))
    body = parse_body(await read_body(request), CompletionRequest)
    return await _generate(request, await _prepare(request, prepare_completion, body, tenant_id, inline=not body.echo))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    tenant_id = state.keys.tenant_for_generation(authorization(request))
    body = parse_body(await read_body(request), ChatCompletionRequest)
    # tools and response_format compile grammars: the thread pool
    inline = body.tools is None and body.response_format is None
    prepared = await _prepare(request, prepare_chat, body, tenant_id, inline=inline,
                              think_split=state.config.reasoning_parser != "none")
    return await _generate(request, prepared)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    state = server_state(request)
    tenant_id = state.keys.tenant_for_generation(authorization(request))
    body = parse_body(await read_body(request), ResponsesRequest)
    inline = body.tools is None and body.text is None  # grammars compile in the thread pool
    prepared = await _prepare(request, prepare_response, body, tenant_id, inline=inline, store=state.stored,
                              think_split=state.config.reasoning_parser != "none")
    return await _generate(request, prepared)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return stored_response(response_id, request).response


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, request: Request) -> dict[str, Any]:
    return listed(stored_response(response_id, request).items, dict(request.query_params))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    tenant_id = state.keys.tenant_for_generation(authorization(request))
    if state.stored is None or not state.stored.delete(tenant_id, response_id):
        raise APIError(404, f"No response with id '{response_id[:64]}' found.", param="response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/tokenize")
async def tokenize_prompt(request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.keys.tenant_for_generation(authorization(request))
    body = parse_body(await read_body(request), TokenizeRequest)
    return await run_in_threadpool(tokenize, body, state.engine)  # a long text: off the event loop


@router.post("/detokenize")
async def detokenize_ids(request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.keys.tenant_for_generation(authorization(request))
    body = parse_body(await read_body(request), DetokenizeRequest)
    return await run_in_threadpool(detokenize, body, state.engine)


@router.get("/tokenizer_info")
async def get_tokenizer_info(request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.keys.identify(authorization(request))  # any key, as /v1/models
    return await run_in_threadpool(tokenizer_info, state.engine)


def stored_response(response_id: str, request: Request) -> Stored:
    """The caller's stored response `response_id`; a 404 for another tenant's id as for an unknown one."""
    state = server_state(request)
    tenant_id = state.keys.tenant_for_generation(authorization(request))
    found = None if state.stored is None else state.stored.get(tenant_id, response_id)
    if found is None:  # another tenant's id is not found either
        raise APIError(404, f"No response with id '{response_id[:64]}' found.", param="response_id")
    return found


def model_card(state: ServerState) -> dict[str, Any]:
    """The served model as /v1/models lists it."""
    return {
        "id": state.engine.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "prefixserve",
        "max_model_len": state.engine.max_model_len,
        "default_max_tokens": state.config.default_max_tokens,
    }


async def _prepare(request: Request, prepare: Callable[..., Prepared], body: Any, tenant_id: str, inline: bool,
                   **options: Any) -> Prepared:
    """`prepare(body, engine, tenant_id, default_max_tokens, memo, **options)` on the event loop when its
    prompts are remembered (prompt_memo.py: no tokenizer work, and no thread hop, ~0.4 ms on an idle
    2-core VM), else in the thread pool: encoding a long prompt must not stall every other stream on
    the event loop. Nothing is prepared for a request the usage ledger could not record
    (ledger/ledger.py, `refusal`): a 503."""
    state = server_state(request)
    if state.ledger is not None and (why := state.ledger.refusal()) is not None:
        raise APIError(503, why, code="ledger_backlog", headers={"Retry-After": "5"})
    given = (body, state.engine, tenant_id, state.config.default_max_tokens)
    if inline:
        try:
            return prepare(*given, state.memo.recall_only(), **options)
        except NotRemembered:
            pass
    return await run_in_threadpool(prepare, *given, state.memo, **options)


async def _generate(request: Request, prepared: Prepared) -> Response:
    """Run `prepared` on the engine and answer it, its latency and usage accounted (operator/accounting.py)."""
    state = server_state(request)
    tracker = RequestTracker(
        state.metrics,
        state.ledger,
        request_id=prepared.request.request_id,
        tenant_id=prepared.tenant_id,
        model=state.engine.model_id,
        prompt_len=len(prepared.request.prompt_ids),
        http_id=request.scope.get("state", {}).get("request_id", ""),
    )
    return await respond(state.engine, prepared, request, tracker)
