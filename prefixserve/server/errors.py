"""OpenAI-shaped errors. Every 4xx and 5xx the server sends has the body

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

`APIError` is what handlers raise for a client's mistake; `install_error_handlers` maps it, FastAPI's
validation and HTTP exceptions, the engine's `PromptTooLong` / `TemplateError` and anything unexpected
(500, logged, never the client's fault) onto that shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixserve.engine.protocol import InvalidRequest, Overloaded, PromptTooLong, TemplateError, Unavailable

logger = logging.getLogger("prefixserve.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    499: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A request the server refuses, with everything the OpenAI error body needs."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status_code)
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """The common case: a 400 naming the offending parameter."""
    return APIError(400, message, param=param, code=code)


SHUTTING_DOWN = "the server is shutting down"  # what a request the shutdown ended says (server/shutdown.py)


def unavailable(message: str) -> APIError:
    """A 503 the client may retry (here shortly, or on another replica): the server is shutting down
    or its engine stopped."""
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": "5"})


def error_type(status_code: int) -> str:
    if status_code >= 500:
        return _TYPE_BY_STATUS.get(status_code, "server_error")
    return _TYPE_BY_STATUS.get(status_code, "invalid_request_error")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.message, err.type, err.param, err.code),
        status_code=err.status_code,
        headers=err.headers,
    )


def format_loc(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; drops FastAPI's leading 'body'."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def validation_error(errors: list[Any]) -> APIError:
    """The first pydantic error as a 400: 'param: message'."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    param = format_loc(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


# the field a prompt came from, per endpoint: the engine's errors about "the prompt" name it so
PROMPT_FIELD = {"/v1/chat/completions": "messages", "/v1/responses": "input"}


def prompt_param(request: Request, param: str | None) -> str | None:
    """`param` as the client knows it: the engine's "prompt" is chat's `messages`, Responses' `input`."""
    return PROMPT_FIELD.get(request.url.path, param) if param == "prompt" else param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error response OpenAI-shaped. A client mistake is never a 500."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(list(exc.errors())))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
        else:
            message = str(exc.detail)
        headers = dict(exc.headers) if exc.headers else None
        return error_response(APIError(exc.status_code, message, headers=headers))

    async def on_prompt_too_long(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            bad_request(str(exc) or "the prompt is too long", prompt_param(request, "prompt"), "context_length_exceeded")
        )

    async def on_template_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(bad_request(f"chat template error: {exc}", "messages", "template_error"))

    async def on_invalid_request(request: Request, exc: Exception) -> JSONResponse:
        return error_response(bad_request(str(exc) or "invalid request",
                                          prompt_param(request, getattr(exc, "param", "prompt"))))

    async def on_overloaded(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Overloaded)
        return error_response(APIError(429, str(exc), code="rate_limit_exceeded", type="requests",  # as OpenAI's
                                       headers={"Retry-After": str(exc.retry_after_s)}))

    async def on_unavailable(request: Request, exc: Exception) -> JSONResponse:
        return error_response(unavailable(str(exc) or "the engine is unavailable"))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(PromptTooLong, on_prompt_too_long)
    app.add_exception_handler(TemplateError, on_template_error)
    app.add_exception_handler(InvalidRequest, on_invalid_request)
    app.add_exception_handler(Overloaded, on_overloaded)
    app.add_exception_handler(Unavailable, on_unavailable)
    app.add_exception_handler(Exception, on_unexpected)
