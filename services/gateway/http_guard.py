"""The gateway's outermost ASGI layer: request ids, body limits, and 500s that keep the connection.

Every HTTP request gets an id: the client's ``X-Request-Id`` when it is a plain token, else a
new one. It is echoed on the response, set as the log records' request id, and named in a 500's
message, so a client can quote it and an operator finds the detail in the log.

Before a byte of its body is read, a request passes ``preauth`` (the gateway: the API key of
every ``/v1`` request): a refusal is answered at once and the connection closed, so a caller
without a key costs neither a body read nor a parse.

A request body is read here, in full, before the app sees it:

- longer than ``max_body_bytes`` (by its ``Content-Length`` or as it arrives): 413, nothing parsed;
- not complete within ``body_timeout_s`` (a slow client, or a body shorter than its
  ``Content-Length``): 408, and the connection is closed (what is left of it cannot be framed);
- a JSON string with a lone UTF-16 surrogate escape (``"\\ud800"``), which no tokenizer can
  encode: 400 ``invalid_unicode``.

A body nested deeper than the JSON parser's recursion limit (a 200,000-deep ``[[[[...``) is a 400
``body_too_deep``, not a 500. An exception nothing else handled becomes a 500 here, logged with
its traceback, and the response completes normally. (Starlette's own handler re-raises after answering, and uvicorn
then resets the connection, so the client's next request on it fails too.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from crescent.services.common.logs import request_id_var
from crescent.services.gateway.errors import (
    ApiError,
    InternalError,
    InvalidRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# A surrogate can enter JSON text only as a \uD800-\uDFFF escape (raw UTF-8 cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def request_id_of(scope: Scope) -> str:
    """The request id this layer gave the request (``-`` outside it)."""
    return scope.get("state", {}).get("request_id", "-")


def _new_request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.fullmatch(text):
                return text
    return f"req-{uuid.uuid4().hex}"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON document holds a string with an unpaired surrogate (fast when it has no escape at all)."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return False
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return False  # the app reports invalid (or too deep) JSON itself
    return _walk_has_surrogate(document)


def _walk_has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_walk_has_surrogate(k) or _walk_has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_walk_has_surrogate(v) for v in value)
    return False


class _BodyRefused(Exception):
    def __init__(self, error: ApiError, *, close: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.close = close


class HttpGuard:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, body_timeout_s: float,
                 preauth: Callable[[Scope], Awaitable[ApiError | None]] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.preauth = preauth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _new_request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            await send(message)

        try:
            refused = await self.preauth(scope) if self.preauth is not None else None
            if refused is not None:  # the body, if any, is left unread: the connection cannot be reused
                await _send_error(send_with_id, refused, close=scope["method"] in _BODY_METHODS)
                return
            if scope["method"] in _BODY_METHODS:
                try:
                    body = await self._read_body(scope, receive)
                except _BodyRefused as refused:
                    log.info("request body refused: %s", refused.error.message)
                    await _send_error(send_with_id, refused.error, close=refused.close)
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send_with_id)
        except RecursionError:  # the JSON parser's depth limit: the body's shape, not a fault of ours
            if not started:
                await _send_error(send_with_id, InvalidRequestError(
                    "the request body is nested too deeply to parse", code="body_too_deep"))
        except Exception as exc:  # noqa: BLE001  (the last line of defence: log it, answer, keep serving)
            log.exception("unhandled error: %s", exc)
            if not started:
                await _send_error(send_with_id, InternalError(f"internal error (request id {request_id})"))
        finally:
            request_id_var.reset(token)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            raise _BodyRefused(self._too_large(), close=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyRefused(RequestTimeoutError(
                    f"the request body did not arrive within {self.body_timeout_s:g} s"
                    + (f" ({size} of {declared} bytes)" if declared is not None else "")
                ), close=True) from None
            if message["type"] == "http.disconnect":
                raise _BodyRefused(InvalidRequestError("the client disconnected while sending the body"), close=True)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyRefused(self._too_large(), close=True)
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        if has_lone_surrogate(body):
            raise _BodyRefused(InvalidRequestError(
                "the request body holds a string with an unpaired UTF-16 surrogate (e.g. \\ud800), "
                "which is not valid Unicode text", code="invalid_unicode"), close=False)
        return body

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(f"the request body is larger than the gateway's limit of "
                                    f"{self.max_body_bytes} bytes (max_body_bytes)")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the connection's own events."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # only http.disconnect from here on

    return replay


async def _send_error(send: Send, error: ApiError, *, close: bool = False) -> None:
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
