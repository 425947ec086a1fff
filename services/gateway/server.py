"""The gateway process: settings → tokenizer → gRPC backend → uvicorn, until SIGINT/SIGTERM.

``main`` is the entry every service has (``crescent serve gateway --config FILE`` calls it).
``model_loader`` lets tests and tools serve with another tokenizer without a special model
name in production code.

Shutdown is a drain (``drain``): the first SIGTERM/SIGINT turns ``/health`` to 503 and refuses
new requests, in-flight streams get ``drain_grace_s`` to finish, then the rest end with an error
event; only then is uvicorn told to stop, so its own shutdown never cuts a stream. A second
signal ends the grace at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType

import uvicorn
from crescent.services.common.logs import configure_logging
from crescent.services.common.settings import SettingsError
from crescent.services.common.tls import is_loopback
from crescent.services.gateway.app import build_app
from crescent.services.gateway.auth import Authenticator
from crescent.services.gateway.config import GatewaySettings, load_gateway_settings
from crescent.services.gateway.drain import Drain
from crescent.services.gateway.attempts.grpc_backend import GrpcBackend, gateway_tls
from crescent.services.gateway.header_deadline import HeaderDeadlineProtocol
from crescent.services.gateway.ledger import UsageLedger
from crescent.services.gateway.attempts.migration import MigrationPolicy
from crescent.services.gateway.limits.limiter import RateLimiter
from crescent.services.gateway.prompt import ServedModel
from crescent.services.tenancy.limits import LimitBook
from crescent.services.tenancy.usage import UsageStore
from fastapi import FastAPI

log = logging.getLogger(__name__)

ModelLoader = Callable[[GatewaySettings], ServedModel]

# After the drain every stream has ended; uvicorn only closes idle keep-alive connections.
_UVICORN_GRACE_S = 2.0
# When the grace is over, how long the interrupted streams get to send their error event.
_END_STREAMS_S = 2.0


def _default_loader(settings: GatewaySettings) -> ServedModel:
    # Imported here so a custom loader does not pay for the engine's tokenizer imports.
    from crescent.services.gateway.model import load_served_model

    return load_served_model(settings)


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that a signal starts the drain instead of stopping the server."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int, FrameType | None], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal(sig, frame)


async def _drain_then_stop(drain: Drain, server: uvicorn.Server, grace_s: float) -> None:
    drain.begin()
    log.info("draining: refusing new requests, %d in flight get up to %.0f s", drain.in_flight, grace_s)
    if not await drain.wait_idle(grace_s):
        log.warning("drain grace over: ending %d requests with an error", drain.in_flight)
        drain.end_grace()
        if not await drain.wait_idle(_END_STREAMS_S):
            log.error("%d requests did not end after the grace", drain.in_flight)
    server.should_exit = True


@contextlib.asynccontextmanager
async def gateway_app(settings: GatewaySettings, model: ServedModel) -> AsyncIterator[tuple[FastAPI, Drain]]:
    """The app with what it owns (backend, auth, ledger, limiter), closed on exit. ``serve`` runs it
    under uvicorn; the gateway tests run it in-process too (tests/gateway/in_process.py)."""
    backend = GrpcBackend(
        settings.scheduler_address,
        request_timeout_s=settings.request_timeout_s,
        place_timeout_s=settings.place_timeout_s,
        health_timeout_s=settings.health_timeout_s,
        block_size=settings.block_size,
        model_id=model.model_id,
        migration=MigrationPolicy(max_retries=settings.migration_retries),
        tls=gateway_tls(),
    )
    drain = Drain()
    auth = await asyncio.to_thread(Authenticator.open, settings.auth)
    if auth.enabled:
        log.info("auth on: every /v1 request needs an API key (tenants and keys in %s)",
                 _safe_url(settings.auth.database_url))
    else:
        log.warning("auth is OFF: any caller is served as the one 'default' tenant (local use only; "
                    "set auth.enabled, CRESCENT_GATEWAY__AUTH__ENABLED=true, to require API keys)")
    ledger = UsageLedger(UsageStore(auth.store.engine) if settings.ledger.enabled else None, settings.prices,
                         settings.ledger)
    ledger.start()
    limiter = RateLimiter.open(settings.limits, LimitBook(auth.store), settings.prices,
                               cache_s=settings.auth.key_cache_s,
                               spent=ledger.store.spent_nusd if ledger.store is not None else None)
    limiter.start()
    try:
        yield build_app(settings, backend, model, drain, auth, ledger, limiter), drain
    finally:
        await backend.close()
        await limiter.close()
        await ledger.close()  # every request has ended: commit the last rows
        auth.close()


def uvicorn_config(settings: GatewaySettings, app: FastAPI) -> uvicorn.Config:
    """How the gateway's uvicorn listens (header deadline, proxy headers); no lifespan: ``gateway_app`` owns it."""
    return uvicorn.Config(
        app, host=settings.listen.host, port=settings.listen.port, log_config=None, access_log=False,
        lifespan="off", timeout_graceful_shutdown=_UVICORN_GRACE_S,
        http=HeaderDeadlineProtocol.with_deadline(settings.listen.header_timeout_s),
        proxy_headers=True, forwarded_allow_ips=settings.listen.forwarded_allow_ips,
    )


async def serve(settings: GatewaySettings, model: ServedModel) -> None:
    """Serve until SIGINT or SIGTERM, then drain (see the module docstring)."""
    previous: dict[int, object] = {}
    try:
        async with gateway_app(settings, model) as (app, drain):
            loop = asyncio.get_running_loop()
            stopping: list[asyncio.Task[None]] = []

            def on_signal() -> None:
                if stopping:
                    log.info("second signal: ending the drain grace now")
                    drain.end_grace()
                    return
                stopping.append(loop.create_task(_drain_then_stop(drain, server, settings.drain_grace_s)))

            def on_signal_threadsafe(sig: int = 0, frame: FrameType | None = None) -> None:
                loop.call_soon_threadsafe(on_signal)  # signal handlers run between bytecodes: hand over to the loop

            server = _DrainingServer(uvicorn_config(settings, app), on_signal=on_signal_threadsafe)
            # Plain signal.signal handlers, not loop.add_signal_handler: uvicorn swaps in its own
            # (signal.signal) while serving and restores these after, and a loop handler would see
            # every signal a second time through the loop's wakeup fd (a second signal ends the grace).
            previous = {sig: signal.signal(sig, on_signal_threadsafe) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                await server.serve()
            finally:
                for task in stopping:
                    task.cancel()
                await asyncio.gather(*stopping, return_exceptions=True)
    finally:  # after gateway_app has closed what it owns, as before the split
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        log.info("gateway stopped")


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def check_exposure(settings: GatewaySettings) -> None:
    """Refuse to serve keyless on an address other hosts can reach, unless told so in so many words."""
    if settings.auth.enabled or is_loopback(settings.listen.host):
        return
    if settings.auth.allow_unauthenticated_network:
        log.warning("auth is OFF on %s: anyone who reaches this address is served as the default tenant "
                    "(auth.allow_unauthenticated_network is set)", settings.listen.host)
        return
    raise SettingsError(
        f"refusing to serve without API keys on {settings.listen.host!r} (listen.host), an address other hosts "
        "can reach: anyone there could spend the default tenant's budget and read its stored responses. Turn "
        "auth on (auth.enabled: true, CRESCENT_GATEWAY__AUTH__ENABLED=true), bind 127.0.0.1, or set "
        "auth.allow_unauthenticated_network: true on a network you trust.")


def served_model(settings: GatewaySettings, model_loader: ModelLoader | None = None) -> ServedModel:
    """The tokenizer and card served: ``model_loader``'s (default: the model's own), the settings' card if given."""
    model = (model_loader or _default_loader)(settings)
    if settings.model_policy is not None:  # the settings' card replaces the model family's
        model = dataclasses.replace(model, policy=settings.model_policy)
    return model


def main(config_path: Path | None = None, *, model_loader: ModelLoader | None = None) -> None:
    settings = load_gateway_settings(config_path)
    configure_logging("gateway", settings.log_level)
    check_exposure(settings)
    model = served_model(settings, model_loader)
    log.info(
        "gateway serving %s on http://%s:%d, scheduler at %s",
        settings.served_model_name or model.model_id, settings.listen.host, settings.listen.port,
        settings.scheduler_address,
    )
    asyncio.run(serve(settings, model))
