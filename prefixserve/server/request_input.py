"""What a handler reads of a request itself: its body, bounded, and its one Authorization header."""

from __future__ import annotations

from fastapi import Request
from starlette.requests import ClientDisconnect

from prefixserve.server.errors import APIError
from prefixserve.server.openai.schemas import MAX_BODY_BYTES


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
