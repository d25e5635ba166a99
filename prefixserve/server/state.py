"""What every route of one app shares: `ServerState`, on `app.state.server`.

`create_app` (server/app.py) builds one per app and the handlers of both surfaces (server/openai/routes.py,
server/operator/routes.py) read it through `server_state(request)`: no module-level state, so two apps
in one process (tests, embedding) never share an engine, keys, a ledger or stored responses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from prefixserve.config import ServerConfig
from prefixserve.engine.protocol import EngineClient
from prefixserve.server.openai.prompt_memo import PromptMemo
from prefixserve.server.openai.responses.store import ResponseStore
from prefixserve.server.operator.auth import KeyStore
from prefixserve.server.operator.metrics import ServerMetrics


@dataclass(frozen=True, slots=True)
class ServerState:
    """One app's engine, settings and the objects its requests share. The app owns the engine, the
    ledger and the stored responses: its lifespan closes them (server/app.py)."""

    engine: EngineClient
    config: ServerConfig
    keys: KeyStore  # replaced in place on SIGHUP (server/operator/auth.py, `reload_keys`)
    metrics: ServerMetrics
    memo: PromptMemo  # recently encoded prompts, per namespace (server/openai/prompt_memo.py)
    # finished /v1/responses answers, per tenant, on disk too with a path (server/openai/responses/store.py);
    # None: none kept
    stored: ResponseStore | None
    ledger: Any | None  # a prefixserve.ledger.Ledger; None: no usage recorded, no /v1/usage
    keys_source: Callable[[], KeyStore] | None  # reads the keys again (SIGHUP)
    started: int  # the app's creation time, the model card's `created`


def server_state(request: Request) -> ServerState:
    """The state of the app serving `request`."""
    state: ServerState = request.app.state.server
    return state
