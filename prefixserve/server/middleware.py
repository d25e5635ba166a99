"""Pure-ASGI middleware counting requests by endpoint and status class. Pure ASGI (not
BaseHTTPMiddleware) so that streaming responses and disconnect detection pass through untouched."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.server.metrics import ServerMetrics, endpoint_label


class RequestCounter:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception escaping the app becomes a 500 further out

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint_label(scope["path"]), f"{status // 100}xx").inc()
