"""The FastAPI application: routes, auth, lifespan.

`create_app(engine, server_config, ledger=None)` takes ownership of the engine, the ledger and the
stored responses: at shutdown (after uvicorn has drained in-flight connections) it calls
``engine.shutdown(drain=True)``, ``ledger.close()`` and the response store's ``close()``. No
module-level state: everything lives in the closure of one app.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from prefixserve.config import ServerConfig
from prefixserve.engine.protocol import EngineClient
from prefixserve.server.auth import KeyStore, reload_keys
from prefixserve.server.chat import prepare_chat
from prefixserve.server.completions import prepare_completion
from prefixserve.server.endings import Endings, EndingsMiddleware
from prefixserve.server.errors import APIError, bad_request, install_error_handlers
from prefixserve.server.flush import flush_payload, flush_scope
from prefixserve.server.generation import respond
from prefixserve.server.metrics import CONTENT_TYPE, ServerMetrics
from prefixserve.server.middleware import RequestCounter
from prefixserve.server.prompt_memo import NotRemembered, PromptMemo
from prefixserve.server.response_items import listed
from prefixserve.server.response_store import ResponseStore, Stored, open_response_store
from prefixserve.server.responses import Prepared
from prefixserve.server.responses_api import prepare_response
from prefixserve.server.schemas import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    parse_body,
)
from prefixserve.server.tokenize import detokenize, tokenize, tokenizer_info
from prefixserve.server.tracking import RequestTracker

logger = logging.getLogger("prefixserve.server")


def create_app(
    engine: EngineClient,
    server_config: ServerConfig,
    ledger: Any | None = None,
    *,
    keys: KeyStore | None = None,
    keys_source: Callable[[], KeyStore] | None = None,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """An app serving `engine`. `keys` defaults to the key specs in `server_config.api_keys`
    ('KEY' or 'TENANT KEY') plus its admin key. `ledger` (a prefixserve.ledger.Ledger) gets one
    record per finished or aborted generation request; None disables usage recording and /v1/usage.
    `response_store` defaults to the store `server_config` describes (`max_stored_responses`, `responses_path`).
    `keys_source` reads the keys again: on SIGHUP (where the app runs in the main thread) they replace
    `keys` (server/auth.py, `reload_keys`)."""
    keys = keys or KeyStore.from_specs(server_config.api_keys, server_config.admin_key)
    metrics = ServerMetrics(engine)
    chat_prepare = functools.update_wrapper(  # named as prepare_chat in traces
        functools.partial(prepare_chat, think_split=server_config.reasoning_parser != "none"), prepare_chat)
    memo = PromptMemo()  # recently encoded prompts, per namespace (server/prompt_memo.py)
    # finished /v1/responses answers, per tenant, on disk too with a path (server/response_store.py); None: none kept
    stored = (response_store if response_store is not None
              else open_response_store(server_config.max_stored_responses, server_config.responses_path))
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if keys.is_open:
            logger.warning("no API keys configured: the server is OPEN, every caller is one tenant")
        else:
            logger.info("serving %d tenant(s)", keys.num_tenants)
            if not keys.has_admin and not server_config.metrics_open:
                logger.warning("/metrics answers no one: with API keys it takes the admin key (--admin-key), "
                               "or serve with --metrics-open")
        loop = asyncio.get_running_loop()
        try:  # a new or rotated key without a restart, which would lose the RAM cache
            loop.add_signal_handler(signal.SIGHUP, reload_keys, keys, keys_source)
            hup = True
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread (an app under test)
            hup = False
        if keys_source is not None:  # a key changed (or a SIGHUP ignored) while the model loaded applies now
            reload_keys(keys, keys_source, "start")
        try:
            yield
        finally:
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)
            logger.info("draining the engine")
            await engine.shutdown(drain=True)
            if ledger is not None:
                await run_in_threadpool(ledger.close)
            if stored is not None:  # commits the last stored responses to disk
                await run_in_threadpool(stored.close)
            logger.info("shut down")

    app = FastAPI(title="prefixserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.endings = Endings()  # for the bounded shutdown (server/shutdown.py)
    # inside RequestCounter, so the last word the shutdown writes for a request is counted and logged
    app.add_middleware(EndingsMiddleware, endings=app.state.endings)
    if server_config.allowed_origins:  # before any route: a browser's preflight carries no key and is answered here
        app.add_middleware(CORSMiddleware, allow_origins=list(server_config.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE", "HEAD"], allow_headers=["*"],
                           expose_headers=["x-request-id", "retry-after"], max_age=600)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: preflights are counted, logged and named too

    # HEAD too: load balancers probe with it (status only; the server sends no body to a HEAD)
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> JSONResponse:
        h = engine.health()  # on the loop: AsyncEngine.health takes no lock, cheaper than a thread hop
        body = {
            "status": "ok" if h.ok else "unhealthy",
            "ok": h.ok,
            "exact_reuse": h.exact_reuse,
            "decode_kernel": h.decode_kernel,
            "system_fingerprint": h.fingerprint,
            "dtype": h.dtype,
            "tiles": h.tiles,
            "detail": h.detail,
            "model": engine.model_id,
            "max_model_len": engine.max_model_len,
            "default_max_tokens": server_config.default_max_tokens,
        }
        if _reads_load(request):  # every tenant's traffic: /metrics' rule (a probe needs no key for the rest)
            body |= {"running": h.num_running,
                     "waiting": h.num_waiting,  # not started yet; of those, queued: beyond the free room (docs/cache.md)
                     "queued": h.num_queued}
        return JSONResponse(body, status_code=200 if h.ok else 503)

    def _reads_load(request: Request) -> bool:
        """Whether this caller may see every tenant's load (running, waiting, queued): anyone on an open
        server or with --metrics-open, else the admin key only. Never an error: /health answers a
        load balancer's probe without a key."""
        if keys.is_open or server_config.metrics_open:
            return True
        try:
            return keys.identify(authorization(request)).is_admin
        except APIError:
            return False

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        # every tenant's traffic together: where keys are configured, only the admin key reads it
        # (a tenant key is a 403), unless the operator opened it (--metrics-open)
        if not keys.is_open and not server_config.metrics_open and not keys.identify(authorization(request)).is_admin:
            raise APIError(403, "/metrics takes the admin key on a server with API keys (or serve with --metrics-open)",
                           code="admin_key_required")
        # off the event loop: the collectors read the engine and its tiers, and an engine that waited
        # there (a lock held through a prefill step) stalled every request and stream on the server
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        keys.identify(authorization(request))
        return {"object": "list", "data": [_model_card(engine, started, server_config.default_max_tokens)]}

    @app.get("/v1/models/{model_name:path}")
    async def get_model(model_name: str, request: Request) -> dict[str, Any]:
        keys.identify(authorization(request))
        if model_name != engine.model_id:
            raise APIError(
                404, f"The model '{model_name}' does not exist", param="model", code="model_not_found"
            )
        return _model_card(engine, started, server_config.default_max_tokens)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant_id = keys.tenant_for_generation(authorization(request))
        body = parse_body(await read_body(request), CompletionRequest)
        return await _generate(request, await _prepare(prepare_completion, body, tenant_id, inline=not body.echo))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant_id = keys.tenant_for_generation(authorization(request))
        body = parse_body(await read_body(request), ChatCompletionRequest)
        # tools and response_format compile grammars: the thread pool
        inline = body.tools is None and body.response_format is None
        return await _generate(request, await _prepare(chat_prepare, body, tenant_id, inline=inline))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        tenant_id = keys.tenant_for_generation(authorization(request))
        body = parse_body(await read_body(request), ResponsesRequest)
        inline = body.tools is None and body.text is None  # grammars compile in the thread pool
        prepare = functools.partial(prepare_response, store=stored, think_split=server_config.reasoning_parser != "none")
        return await _generate(request, await _prepare(prepare, body, tenant_id, inline=inline))

    def stored_response(response_id: str, request: Request) -> Stored:
        tenant_id = keys.tenant_for_generation(authorization(request))
        found = None if stored is None else stored.get(tenant_id, response_id)
        if found is None:  # another tenant's id is not found either
            raise APIError(404, f"No response with id '{response_id[:64]}' found.", param="response_id")
        return found

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return stored_response(response_id, request).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> dict[str, Any]:
        return listed(stored_response(response_id, request).items, dict(request.query_params))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        tenant_id = keys.tenant_for_generation(authorization(request))
        if stored is None or not stored.delete(tenant_id, response_id):
            raise APIError(404, f"No response with id '{response_id[:64]}' found.", param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request) -> dict[str, Any]:
        keys.tenant_for_generation(authorization(request))
        body = parse_body(await read_body(request), TokenizeRequest)
        return await run_in_threadpool(tokenize, body, engine)  # a long text: off the event loop

    @app.post("/detokenize")
    async def detokenize_ids(request: Request) -> dict[str, Any]:
        keys.tenant_for_generation(authorization(request))
        body = parse_body(await read_body(request), DetokenizeRequest)
        return await run_in_threadpool(detokenize, body, engine)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info(request: Request) -> dict[str, Any]:
        keys.identify(authorization(request))  # any key, as /v1/models
        return await run_in_threadpool(tokenizer_info, engine)

    @app.get("/v1/usage")
    async def usage(request: Request) -> Any:
        principal = keys.identify(authorization(request))
        if ledger is None:
            raise APIError(404, "the usage ledger is disabled on this server", code="ledger_disabled")
        from prefixserve.ledger import UsageQueryError
        from prefixserve.ledger.api import usage_payload

        try:  # Starlette's QueryParams: repeated parameters reach the ledger through getlist
            return await run_in_threadpool(
                usage_payload, ledger, request.query_params, principal.tenant_id or "", principal.is_admin
            )
        except UsageQueryError as e:
            raise bad_request(e.message, e.param) from None

    @app.delete("/v1/cache")
    async def flush_cache(request: Request) -> dict[str, Any]:
        principal = keys.identify(authorization(request))
        scope = flush_scope(principal, await read_body(request), request.query_params)
        report = await engine.flush_cache(scope)
        memo.forget(scope)
        logger.info("cache flush (tenant %s, salt %s): %d entries, %d bytes", scope.tenant_id or "*",
                    "*" if scope.cache_salt is None else "given", report.num_entries, report.num_bytes)
        return flush_payload(scope, report)

    async def _prepare(prepare: Callable[..., Prepared], body: Any, tenant_id: str, inline: bool) -> Prepared:
        """`prepare(body, ...)` on the event loop when its prompts are remembered (server/prompt_memo.py:
        no tokenizer work, and no thread hop, ~0.4 ms on an idle 2-core VM), else in the thread pool:
        encoding a long prompt must not stall every other stream on the event loop. Nothing is prepared
        for a request the usage ledger could not record (ledger/ledger.py, `refusal`): a 503."""
        if ledger is not None and (why := ledger.refusal()) is not None:
            raise APIError(503, why, code="ledger_backlog", headers={"Retry-After": "5"})
        if inline:
            try:
                return prepare(body, engine, tenant_id, server_config.default_max_tokens, memo.recall_only())
            except NotRemembered:
                pass
        return await run_in_threadpool(prepare, body, engine, tenant_id, server_config.default_max_tokens, memo)

    async def _generate(request: Request, prepared: Prepared) -> Response:
        tracker = RequestTracker(
            metrics,
            ledger,
            request_id=prepared.request.request_id,
            tenant_id=prepared.tenant_id,
            model=engine.model_id,
            prompt_len=len(prepared.request.prompt_ids),
            http_id=request.scope.get("state", {}).get("request_id", ""),
        )
        return await respond(engine, prepared, request, tracker)

    app.state.metrics = metrics  # for tests and embedding; nothing in the app reads it back
    return app


async def read_body(request: Request) -> bytes:
    """The raw body, refusing more than MAX_BODY_BYTES (413) without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # the client hung up mid-body: nobody to answer, and not the server's fault (nginx's 499)
        raise APIError(499, "the client closed the connection while sending the request") from None
    return b"".join(chunks)


def authorization(request: Request) -> str | None:
    """The one Authorization header value; two or more are refused rather than guessed between."""
    values = request.headers.getlist("authorization")
    if len(values) > 1:
        raise APIError(400, "send exactly one Authorization header", code="invalid_request")
    return values[0] if values else None


def _model_card(engine: EngineClient, created: int, default_max_tokens: int) -> dict[str, Any]:
    return {
        "id": engine.model_id,
        "object": "model",
        "created": created,
        "owned_by": "prefixserve",
        "max_model_len": engine.max_model_len,
        "default_max_tokens": default_max_tokens,
    }
