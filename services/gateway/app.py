"""The gateway's HTTP API: OpenAI-compatible chat and text completions, responses, models, health and metrics."""

from __future__ import annotations

import logging
import time

from crescent.services.common.admin_http import metrics_response
from crescent.services.common.metrics import gateway_metrics
from crescent.services.common.tls import is_loopback
from crescent.services.gateway.admin_api import admin_router
from crescent.services.gateway.api_models import ChatCompletionRequest, ModelCard, ModelList
from crescent.services.gateway.auth import Authenticator, client_address, principal_of
from crescent.services.gateway.backend import Backend
from crescent.services.gateway.chat import ChatCompletions
from crescent.services.gateway.completions.endpoint import Completions
from crescent.services.gateway.completions.api import CompletionRequest
from crescent.services.gateway.config import LOOPBACK_HOST_NAMES, GatewayListenSettings, GatewaySettings
from crescent.services.gateway.drain import Drain, DrainGuard
from crescent.services.gateway.errors import ERROR_RESPONSES, ApiError, ModelNotFoundError, install_error_handlers
from crescent.services.gateway.http_guard import HttpGuard
from crescent.services.gateway.limits.http import RateLimitHeaders
from crescent.services.gateway.limits.admin import limits_router
from crescent.services.gateway.ledger import UsageLedger
from crescent.services.gateway.prompt import ServedModel
from crescent.services.gateway.limits.limiter import RateLimiter
from crescent.services.gateway.responses.store import ResponseStore
from crescent.services.gateway.responses.endpoint import Responses
from crescent.services.gateway.responses.api import ResponseRequest
from crescent.services.gateway.usage_api import DOCUMENTED_RESPONSES, UsageApi, usage_admin_router
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import Scope
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)


def _is_admin(auth: Authenticator, request: Request) -> bool:
    try:
        auth.check_admin(request.headers.get("authorization"), client_address(request.scope))
    except ApiError:
        return False
    return True


def allowed_hosts(listen: GatewayListenSettings) -> list[str] | None:
    """The Host names the gateway answers; None: any (bound off loopback, no list given)."""
    if listen.allowed_hosts:
        return list(listen.allowed_hosts)
    return list(LOOPBACK_HOST_NAMES) if is_loopback(listen.host) else None


def build_app(settings: GatewaySettings, backend: Backend, model: ServedModel, drain: Drain,
              auth: Authenticator, ledger: UsageLedger | None = None, limiter: RateLimiter | None = None) -> FastAPI:
    """The FastAPI app; ``backend``, ``model``, ``drain``, ``auth`` and ``ledger`` (the usage
    ledger; None: requests are not priced) are owned by the caller (``server``)."""
    metrics = gateway_metrics()
    chat = ChatCompletions(settings, backend, model, metrics, drain, ledger)
    completions = Completions(backend, model, metrics, drain, chat.served_name, ledger)
    usage = UsageApi(ledger.store if ledger is not None else None, auth)
    responses = Responses(chat, backend, model, metrics, drain, ResponseStore(settings.responses_db))
    created = int(time.time())
    card = ModelCard(id=chat.served_name, created=created, max_model_len=model.context_window,
                     policy=model.policy.card())
    app = FastAPI(title="Crescent gateway", docs_url=None, redoc_url=None)

    def count_invalid_body(request: Request) -> None:
        if request.url.path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            metrics.requests.labels(status="client_error").inc()

    install_error_handlers(app, on_invalid_body=count_invalid_body)
    # Added last = outermost: HttpGuard sees every request first (ids, body limits, 500s).
    if limiter is not None:  # innermost: headers on every /v1 answer, errors included (docs/limits.md)
        app.add_middleware(RateLimitHeaders, limiter=limiter)
    app.add_middleware(DrainGuard, drain=drain)
    if settings.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_allow_origins, allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"], expose_headers=["X-Request-Id", "Retry-After"],
        )

    async def key_before_body(scope: Scope) -> ApiError | None:
        """A /v1 request's tenant (``auth.principal_of``), from its API key checked before its body
        is read (auth off: the default tenant)."""
        if not scope["path"].startswith("/v1/"):
            return None
        try:
            scope["state"]["principal"] = await auth.principal(Headers(scope=scope).get("authorization"),
                                                               client_address(scope))
        except ApiError as refused:
            return refused
        return None

    app.add_middleware(HttpGuard, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s,
                       preauth=key_before_body)
    hosts = allowed_hosts(settings.listen)
    if hosts is not None:  # outermost: a request for another Host name (DNS rebinding) gets 400 before anything
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)

    v1 = APIRouter(prefix="/v1", responses={401: ERROR_RESPONSES[401]})  # the key: HttpGuard's preauth

    @v1.post("/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.handle(body, request)

    @v1.post("/completions", responses=ERROR_RESPONSES)
    async def text_completions(body: CompletionRequest, request: Request) -> Response:
        return await completions.handle(body, request)

    @v1.post("/responses", responses=ERROR_RESPONSES)
    async def create_response(body: ResponseRequest, request: Request) -> Response:
        return await responses.create(body, request)

    @v1.get("/responses/{response_id}", responses={404: ERROR_RESPONSES[404]})
    async def get_response(response_id: str, request: Request) -> Response:
        return await responses.retrieve(principal_of(request).tenant_id, response_id)

    @v1.delete("/responses/{response_id}", responses={404: ERROR_RESPONSES[404]})
    async def delete_response(response_id: str, request: Request) -> Response:
        return await responses.delete(principal_of(request).tenant_id, response_id)

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card])

    @v1.get("/models/{model_id:path}", responses={404: ERROR_RESPONSES[404]})
    async def get_model(model_id: str) -> ModelCard:
        if model_id != card.id:
            raise ModelNotFoundError(f"the model {model_id!r} does not exist", param="model")
        return card

    @v1.get("/usage", responses=DOCUMENTED_RESPONSES | {s: ERROR_RESPONSES[s] for s in (400, 404)})
    async def get_usage(request: Request, start: str | None = None, end: str | None = None,
                        group_by: str | None = None, format: str | None = None) -> Response:  # noqa: A002
        """The caller's tenant's usage: totals by group (JSON) or rows (CSV); docs/usage.md."""
        return await usage.answer(request, principal_of(request).tenant_id, admin=False)

    app.include_router(v1)
    app.include_router(admin_router(auth))
    if limiter is not None:
        app.include_router(limits_router(auth, limiter, settings.limits))
    app.include_router(usage_admin_router(usage, auth))

    @app.get("/health")
    async def health() -> JSONResponse:
        """503 while draining, or while the database (keys, the ledger) or a rate-limit store that
        ``on_store_error: closed`` requires does not answer: such a gateway can serve nobody, so it
        leaves the Service. A gateway whose backend is away still
        answers (503 + Retry-After per request), which is better for clients; the body says why."""
        body: dict[str, object] = {"model": chat.served_name}
        if drain.draining:
            return JSONResponse(body | {"status": "draining", "in_flight": drain.in_flight}, status_code=503)
        if auth.enabled or (ledger is not None and ledger.store is not None):
            problem = await auth.database_ok()
            if problem is not None:
                return JSONResponse(body | {"status": "unavailable", "reason": problem}, status_code=503)
        if limiter is not None:  # a store that limits.on_store_error: closed makes required
            problem = await limiter.required_store_problem()
            if problem is not None:
                return JSONResponse(body | {"status": "unavailable", "reason": problem}, status_code=503)
        try:
            state = await backend.health()
        except ApiError as exc:
            body |= {"status": "unavailable", "reason": exc.message}
        else:
            body |= {
                "status": "ok" if state.ready else "starting",
                "prefill_instances": state.prefill_instances,
                "decode_instances": state.decode_instances,
            }
        return JSONResponse(body, status_code=200)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def metrics_endpoint(request: Request) -> Response:
        # Per-tenant spend and savings are tenant data: with auth on, only the admin key sees them here.
        if auth.enabled and not _is_admin(auth, request):
            return metrics_response(without_label="tenant")
        return metrics_response()

    return app
