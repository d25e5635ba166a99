"""Pure-ASGI middleware counting requests by endpoint and status class, naming each request, and
writing the access log line. Pure ASGI (not BaseHTTPMiddleware) so that streaming responses and
disconnect detection pass through untouched.

Every response carries `x-request-id` (as OpenAI's do): the client's own `X-Request-Id` where it sent
a usable one (1-128 of A-Z a-z 0-9 and ``-_.:;@/+=``; a gateway's id, so its logs and ours meet), else
a new `req_<32 hex>`. The access line has uvicorn's fields (client, request line, status) and that id,
on the logger `prefixserve.access`, written when the response has ended. uvicorn wrote its own before the
response's first bytes: that cost ~0.3 ms of every request's time to first token (a formatted line
to stderr on the event loop; `py-spy` of the server under back-to-back warm requests, AMX Xeon), so
the server runs uvicorn with its access log off (server/run.py `serve_app`).
"""

from __future__ import annotations

import logging
import re
import uuid
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.server.operator.metrics import ServerMetrics, endpoint_label

access_log = logging.getLogger("prefixserve.access")
_GIVEN_ID = re.compile(rb"[A-Za-z0-9_.:;@/+=-]{1,128}")  # AWS's Root=...;Parent=... ids too


class RequestCounter:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception escaping the app becomes a 500 further out
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id.decode("ascii")  # for the app's log lines

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id)]}
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint_label(scope["path"]), f"{status // 100}xx").inc()
            if access_log.isEnabledFor(logging.INFO):
                phrase = _phrase(status)
                access_log.info('%s - "%s %s HTTP/%s" %d %s%s', *_access_fields(scope), status,
                                phrase + " " if phrase else "", request_id.decode("ascii"))


def request_id_of(scope: Scope) -> bytes:
    """The client's X-Request-Id where usable, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and _GIVEN_ID.fullmatch(value):
            return bytes(value)
    return b"req_" + uuid.uuid4().hex.encode()


def _access_fields(scope: Scope) -> tuple[str, str, str, str]:
    """Client address, method, path with its query string, HTTP version: as uvicorn writes them."""
    client = scope.get("client")
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin1")
    if query := scope.get("query_string"):
        path = f"{path}?{query.decode('ascii', 'replace')}"
    addr = f"{client[0]}:{client[1]}" if client else ""
    return addr, scope["method"], path.replace('"', "%22"), scope.get("http_version", "1.1")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
