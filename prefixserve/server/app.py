"""The FastAPI application: the two surfaces' routers, the middleware, the error handlers, the lifespan.

`create_app(engine, server_config, ledger=None)` takes ownership of the engine, the ledger and the
stored responses: at shutdown (after uvicorn has drained in-flight connections) `lifespan` calls
``engine.shutdown(drain=True)``, ``ledger.close()`` and the response store's ``close()``. No
module-level state: everything one app shares is its `ServerState` (server/state.py). The routes:
server/openai/routes.py (the OpenAI API) and server/operator/routes.py (health, metrics, usage, cache
flushes).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from prefixserve.config import ServerConfig
from prefixserve.engine.protocol import EngineClient
from prefixserve.server.errors import install_error_handlers
from prefixserve.server.in_flight import Endings, EndingsMiddleware
from prefixserve.server.middleware import RequestCounter
from prefixserve.server.openai.prompt_memo import PromptMemo
from prefixserve.server.openai.responses.store import ResponseStore, open_response_store
from prefixserve.server.openai.routes import router as openai_router
from prefixserve.server.operator.auth import KeyStore, reload_keys
from prefixserve.server.operator.metrics import ServerMetrics
from prefixserve.server.operator.routes import router as operator_router
from prefixserve.server.state import ServerState

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
    `keys` (server/operator/auth.py, `reload_keys`)."""
    state = ServerState(
        engine=engine,
        config=server_config,
        keys=keys or KeyStore.from_specs(server_config.api_keys, server_config.admin_key),
        metrics=ServerMetrics(engine),
        memo=PromptMemo(),
        stored=(response_store if response_store is not None
                else open_response_store(server_config.max_stored_responses, server_config.responses_path)),
        ledger=ledger,
        keys_source=keys_source,
        started=int(time.time()),
    )
    # the routers' routes themselves, not `include_router`: an included router is matched through a
    # layer of its own on every request (FastAPI 0.165: 16-60 us more per request, measured)
    app = FastAPI(title="prefixserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  routes=[*operator_router.routes, *openai_router.routes])
    app.state.server = state
    install_error_handlers(app)
    app.state.endings = Endings()  # for the bounded shutdown (server/shutdown.py)
    # inside RequestCounter, so the last word the shutdown writes for a request is counted and logged
    app.add_middleware(EndingsMiddleware, endings=app.state.endings)
    if server_config.allowed_origins:  # before any route: a browser's preflight carries no key and is answered here
        app.add_middleware(CORSMiddleware, allow_origins=list(server_config.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE", "HEAD"], allow_headers=["*"],
                           expose_headers=["x-request-id", "retry-after"], max_age=600)
    app.add_middleware(RequestCounter, metrics=state.metrics)  # outermost: preflights are counted, logged and named too
    app.state.metrics = state.metrics  # for tests and embedding; nothing in the app reads it back
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start: log who is served, take SIGHUP (the keys read again) where the app runs in the main
    thread, apply a key change made while the model loaded. End: drain the engine, close the ledger
    and the stored responses (their last ones committed to disk)."""
    state: ServerState = app.state.server
    keys = state.keys
    if keys.is_open:
        logger.warning("no API keys configured: the server is OPEN, every caller is one tenant")
    else:
        logger.info("serving %d tenant(s)", keys.num_tenants)
        keys.warn_admin_tenant()
        if not keys.has_admin and not state.config.metrics_open:
            logger.warning("/metrics answers no one: with API keys it takes the admin key (--admin-key), "
                           "or serve with --metrics-open")
    loop = asyncio.get_running_loop()
    try:  # a new or rotated key without a restart, which would lose the RAM cache
        loop.add_signal_handler(signal.SIGHUP, reload_keys, keys, state.keys_source)
        hup = True
    except (RuntimeError, ValueError, NotImplementedError):  # not the main thread (an app under test)
        hup = False
    if state.keys_source is not None:  # a key changed (or a SIGHUP ignored) while the model loaded applies now
        reload_keys(keys, state.keys_source, "start")
    try:
        yield
    finally:
        if hup:
            loop.remove_signal_handler(signal.SIGHUP)
        logger.info("draining the engine")
        await state.engine.shutdown(drain=True)
        if state.ledger is not None:
            await run_in_threadpool(state.ledger.close)
        if state.stored is not None:  # commits the last stored responses to disk
            await run_in_threadpool(state.stored.close)
        logger.info("shut down")
