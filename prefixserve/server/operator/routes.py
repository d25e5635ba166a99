"""The operator surface's routes: /health, /metrics, the usage API (/v1/usage) and cache flushes
(DELETE /v1/cache).

Every tenant's figures are the admin key's to read (or anyone's with --metrics-open, or on an open
server); a tenant key reads its own usage and flushes its own cache (cache_flush.py). The app's
shared objects come from `server_state(request)` (server/state.py).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from prefixserve.server.errors import APIError, bad_request
from prefixserve.server.operator.cache_flush import flush_payload, flush_scope
from prefixserve.server.operator.metrics import CONTENT_TYPE
from prefixserve.server.request_input import authorization, read_body
from prefixserve.server.state import ServerState, server_state

logger = logging.getLogger("prefixserve.server")

router = APIRouter()


# HEAD too: load balancers probe with it (status only; the server sends no body to a HEAD)
@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    engine = state.engine
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
        "default_max_tokens": state.config.default_max_tokens,
    }
    if reads_load(state, request):  # every tenant's traffic: /metrics' rule (a probe needs no key for the rest)
        body |= {"running": h.num_running,
                 "waiting": h.num_waiting,  # not started yet; of those, queued: beyond the free room (docs/cache.md)
                 "queued": h.num_queued}
    return JSONResponse(body, status_code=200 if h.ok else 503)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    state = server_state(request)
    keys = state.keys
    # every tenant's traffic together: where keys are configured, only the admin key reads it
    # (a tenant key is a 403), unless the operator opened it (--metrics-open)
    if not keys.is_open and not state.config.metrics_open and not keys.identify(authorization(request)).is_admin:
        raise APIError(403, "/metrics takes the admin key on a server with API keys (or serve with --metrics-open)",
                       code="admin_key_required")
    # off the event loop: the collectors read the engine and its tiers, and an engine that waited
    # there (a lock held through a prefill step) stalled every request and stream on the server
    return Response(await run_in_threadpool(state.metrics.render), media_type=CONTENT_TYPE)


@router.get("/v1/usage")
async def usage(request: Request) -> Any:
    state = server_state(request)
    principal = state.keys.identify(authorization(request))
    if state.ledger is None:
        raise APIError(404, "the usage ledger is disabled on this server", code="ledger_disabled")
    from prefixserve.ledger import UsageQueryError
    from prefixserve.ledger.api import usage_payload

    try:  # Starlette's QueryParams: repeated parameters reach the ledger through getlist
        return await run_in_threadpool(
            usage_payload, state.ledger, request.query_params, principal.tenant_id or "", principal.is_admin
        )
    except UsageQueryError as e:
        raise bad_request(e.message, e.param) from None
    except TimeoutError:  # the ledger cannot commit (a full or failing disk): its records wait in memory
        raise APIError(503, "the usage ledger cannot commit its records now (its disk is full or failing); the "
                            "usage is kept and counted once it can: try again later",
                       code="ledger_not_durable", headers={"Retry-After": "5"}) from None


@router.delete("/v1/cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    state = server_state(request)
    principal = state.keys.identify(authorization(request))
    scope = flush_scope(principal, await read_body(request), request.query_params)
    report = await state.engine.flush_cache(scope)
    state.memo.forget(scope)
    logger.info("cache flush (tenant %s, salt %s): %d entries, %d bytes", scope.tenant_id or "*",
                "*" if scope.cache_salt is None else "given", report.num_entries, report.num_bytes)
    return flush_payload(scope, report)


def reads_load(state: ServerState, request: Request) -> bool:
    """Whether this caller may see every tenant's load (running, waiting, queued): anyone on an open
    server or with --metrics-open, else the admin key only. Never an error: /health answers a
    load balancer's probe without a key."""
    if state.keys.is_open or state.config.metrics_open:
        return True
    try:
        return state.keys.identify(authorization(request)).is_admin
    except APIError:
        return False
