"""The gateway process: settings → tokenizer → gRPC backend → uvicorn, until SIGINT/SIGTERM.

``main`` is the entry every service has (``crescent serve gateway --config FILE`` calls it).
``model_loader`` lets tests and tools serve with another tokenizer without a special model
name in production code.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import uvicorn
from crescent.services.common.logs import configure_logging
from crescent.services.gateway.app import build_app
from crescent.services.gateway.config import GatewaySettings, load_gateway_settings
from crescent.services.gateway.grpc_backend import GrpcBackend
from crescent.services.gateway.prompt import ServedModel

log = logging.getLogger(__name__)

ModelLoader = Callable[[GatewaySettings], ServedModel]


def _default_loader(settings: GatewaySettings) -> ServedModel:
    # Imported here so a custom loader does not pay for the engine's tokenizer imports.
    from crescent.services.gateway.model import load_served_model

    return load_served_model(settings)


async def serve(settings: GatewaySettings, model: ServedModel) -> None:
    """Serve until SIGINT or SIGTERM; in-flight requests get ``shutdown_grace_s`` to finish, then are cancelled."""
    backend = GrpcBackend(
        settings.scheduler_address,
        request_timeout_s=settings.request_timeout_s,
        place_timeout_s=settings.place_timeout_s,
        health_timeout_s=settings.health_timeout_s,
        block_size=settings.block_size,
    )
    app = build_app(settings, backend, model)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=settings.listen.host, port=settings.listen.port, log_config=None, access_log=False,
            lifespan="off", timeout_graceful_shutdown=settings.shutdown_grace_s,
        )
    )
    loop = asyncio.get_running_loop()

    def request_exit() -> None:
        server.should_exit = True

    # uvicorn installs its own handlers while it serves and re-raises the signal when it is done;
    # these make that re-raise a no-op instead of killing the process before it cleaned up.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, request_exit)
    try:
        await server.serve()
    finally:
        await backend.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        log.info("gateway stopped")


def main(config_path: Path | None = None, *, model_loader: ModelLoader | None = None) -> None:
    settings = load_gateway_settings(config_path)
    configure_logging("gateway", settings.log_level)
    model = (model_loader or _default_loader)(settings)
    log.info(
        "gateway serving %s on http://%s:%d, scheduler at %s",
        settings.served_model_name or model.model_id, settings.listen.host, settings.listen.port,
        settings.scheduler_address,
    )
    asyncio.run(serve(settings, model))
