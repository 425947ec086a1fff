"""Rate limits on the HTTP path: admission from the handlers, OpenAI's headers on every /v1 response.

``RateLimitHeaders`` (ASGI middleware) gives each ``/v1`` request a ``RequestLimits`` in its
scope state. A model endpoint calls ``admit`` once its prompts are tokenized; every ``/v1``
response, streamed or not, a 429 or a 400, then carries ``x-ratelimit-limit/remaining/reset``
for requests and tokens: the admission's figures, or the current ones for a response that took
nothing (listing models, a refused body). The request is settled (tokens corrected, slot freed,
cost charged) before its response's last bytes, so a client that has read a whole answer can
send the next request into the slot it freed; a response that never finishes (client gone, an
error) is settled as it ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from crescent.services.gateway.accounting import RequestRecord, UsageCounts, total_usage
from crescent.services.gateway.auth import Principal, principal_of
from crescent.services.gateway.backend import GenerationRequest
from crescent.services.gateway.limits.limiter import RateLimiter, RateLimitExceeded, Ticket

_STATE_KEY = "rate_limits"


class RequestLimits:
    """One /v1 request's dealings with the limiter."""

    __slots__ = ("_limiter", "_records", "ticket", "headers")

    def __init__(self, limiter: RateLimiter) -> None:
        self._limiter = limiter
        self._records: Sequence[RequestRecord] = ()
        self.ticket: Ticket | None = None
        self.headers: dict[str, str] | None = None  # None: not admitted (nor refused)

    async def admit(self, principal: Principal, model: str, prompt_tokens: int, max_completion_tokens: int,
                    records: Sequence[RequestRecord]) -> None:
        try:
            self.ticket = await self._limiter.admit(principal, model, prompt_tokens, max_completion_tokens)
        except RateLimitExceeded as exc:
            self.headers = exc.limit_headers
            raise
        self._records = records
        self.headers = self.ticket.headers if self.ticket is not None else {}

    def usage(self) -> UsageCounts:
        return total_usage([u for r in self._records if (u := r.usage) is not None])


async def admit(request: Request, model: str, generations: Sequence[GenerationRequest], n: int,
                records: Sequence[RequestRecord]) -> None:
    """Hold the request to its key's and tenant's limits (raises their 429); ``generations`` are its
    backend requests, each with ``n`` choices, ``records`` where its usage will be."""
    limits: RequestLimits | None = request.scope.get("state", {}).get(_STATE_KEY)
    if limits is None:
        return
    prompt_tokens = sum(len(g.prompt_token_ids) for g in generations)
    max_completion = n * sum(g.sampling.max_tokens for g in generations)
    await limits.admit(principal_of(request), model, prompt_tokens, max_completion, records)


class RateLimitHeaders:
    """The ASGI middleware around the API: see the module docstring."""

    def __init__(self, app: ASGIApp, limiter: RateLimiter) -> None:
        self.app = app
        self._limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        limits = state[_STATE_KEY] = RequestLimits(self._limiter)

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = limits.headers
                principal = state.get("principal")
                if headers is None and principal is not None:
                    headers = await self._limiter.headers_for(principal)
                if headers:
                    present = {name.lower() for name, _ in message.get("headers", ())}
                    extra = [(k.encode(), v.encode()) for k, v in headers.items() if k.lower().encode() not in present]
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                await self._settle(limits)
            await send(message)

        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            if limits.ticket is not None and not limits.ticket.settled:
                # Ended without its last bytes (client gone, an error, cancelled): settled by a task
                # of the limiter's, which survives this request's cancellation.
                self._limiter.settle_later(limits.ticket, limits.usage())

    async def _settle(self, limits: RequestLimits) -> None:
        if limits.ticket is not None and not limits.ticket.settled:
            await self._limiter.settle(limits.ticket, limits.usage())
