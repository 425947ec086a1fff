"""Typed gateway errors and their OpenAI-style HTTP form.

Every error leaves the gateway as ``{"error": {"message", "type", "param", "code"}}`` with a
status a client can act on: 4xx means "change the request", 429/503 mean "retry later" (with a
``Retry-After`` header when the scheduler said when), 5xx otherwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# Union members show up in pydantic error locations as type tags; they are not parameter names.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequestError(ApiError):
    status = 400
    type = "invalid_request_error"


class UnsupportedParameterError(InvalidRequestError):
    code = "unsupported_parameter"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class RequestTimeoutError(InvalidRequestError):
    status = 408
    code = "request_timeout"


class PayloadTooLargeError(InvalidRequestError):
    status = 413
    code = "payload_too_large"


class AuthenticationError(ApiError):
    """No API key (``missing_api_key``) or one that is unknown, revoked or expired (``invalid_api_key``)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class PermissionDeniedError(ApiError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class ModelNotFoundError(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFoundError(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class RateLimitedError(ApiError):
    """The scheduler rejected the request early (predicted SLO miss): retry after a while."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        # Retry-After takes whole seconds; round up so a client never retries too early.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class ServiceUnavailableError(RateLimitedError):
    """No backend can take the request now (scheduler down, no instance registered)."""

    status = 503
    type = "service_unavailable_error"
    code = "backend_unavailable"


class GatewayTimeoutError(ApiError):
    status = 504
    type = "timeout_error"
    code = "timeout"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    code = "internal_error"


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def _param_from_loc(loc: Sequence[Any]) -> str | None:
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    path: list[str] = []
    for part in parts:
        if isinstance(part, int):
            path.append(f"[{part}]")
        elif part in _TYPE_TAGS or "[" in str(part) or "-" in str(part):
            break  # the rest describes which union member failed, not where
        else:
            path.append(str(part))
    return ".".join(path).replace(".[", "[") or None


def validation_error(errors: Sequence[dict[str, Any]]) -> ApiError:
    """Turn pydantic/FastAPI validation errors into the one error a client should see first."""
    for err in errors:
        if err.get("type") == "json_invalid":
            return InvalidRequestError("the request body is not valid JSON", code="invalid_json")
    for err in errors:
        if err.get("type") == "extra_forbidden":
            param = _param_from_loc(err.get("loc", ()))
            return UnsupportedParameterError(f"unsupported parameter: {param}", param=param)
    if not errors:
        return InvalidRequestError("invalid request")
    param = _param_from_loc(errors[0].get("loc", ()))
    # A value that fits none of a union's forms fails once per form: say all of them.
    reasons = dict.fromkeys(str(e.get("msg")) for e in errors if _param_from_loc(e.get("loc", ())) == param)
    reason = "; or ".join(reasons)
    if param is None:
        return InvalidRequestError(f"the request body must be a JSON object: {reason}", code="invalid_body")
    return InvalidRequestError(f"invalid value for {param}: {reason}", param=param, code="invalid_value")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error response's body (for the OpenAPI document)."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        400: "invalid request: the message names the field (param) and why",
        401: "no API key (missing_api_key), or an unknown, revoked or expired one (invalid_api_key)",
        404: "unknown model",
        408: "the request body did not arrive in time",
        413: "the request body is larger than the gateway's limit",
        429: "rejected early: the request would miss its SLO (Retry-After says when to retry)",
        500: "internal error: the message carries the request id to quote",
        503: "no instance can serve now, or the gateway is draining (Retry-After)",
        504: "the request did not finish before its deadline",
    }.items()
}


def install_error_handlers(app: FastAPI, on_invalid_body: Callable[[Request], None] | None = None) -> None:
    """Replace FastAPI's 422 and other defaults with OpenAI-style error bodies.

    ``on_invalid_body`` is told of every request refused before its handler ran (for metrics).
    """

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if on_invalid_body is not None:
            on_invalid_body(request)
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = NotFoundError(str(exc.detail)) if exc.status_code == 404 else InvalidRequestError(str(exc.detail))
        error.status = exc.status_code
        return error_response(error)
    # Exceptions nothing here handles become a 500 in ``http_guard.HttpGuard``, which keeps the
    # connection usable (an ``Exception`` handler here would re-raise, and uvicorn would reset it).
