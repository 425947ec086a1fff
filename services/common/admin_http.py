"""The small HTTP side of every gRPC service: ``GET /health`` and ``GET /metrics``.

Runs uvicorn on the service's own asyncio loop, so there is no extra thread or process.
``/health`` answers 200 with ``{"status": "ok"}`` once the service is ready, 503 before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


def metrics_response(without_label: str | None = None) -> Response:
    """The process's metrics; ``without_label``: leave out every family that has that label
    (the gateway's per-tenant spend, on a port anyone reaches)."""
    if without_label is None:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(_Without(REGISTRY, without_label)), media_type=CONTENT_TYPE_LATEST)


class _Without:
    """A view of a registry without the metric families that carry ``label`` on any sample."""

    def __init__(self, registry: CollectorRegistry, label: str) -> None:
        self._registry = registry
        self._label = label

    def collect(self):  # noqa: ANN201 - prometheus_client's Metric iterator
        for family in self._registry.collect():
            if not any(self._label in sample.labels for sample in family.samples):
                yield family


def build_admin_app(service: str, ready: Callable[[], bool], details: Callable[[], dict[str, Any]] | None = None) -> FastAPI:
    app = FastAPI(title=f"crescent {service} admin", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    def health() -> JSONResponse:
        body: dict[str, Any] = {"service": service, "status": "ok" if ready() else "starting"}
        if details is not None:
            body.update(details())
        return JSONResponse(body, status_code=200 if ready() else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return metrics_response()

    return app


class AdminServer:
    """uvicorn serving the admin app as a task of the running loop."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self._server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Start serving; return the bound port (useful when the configured port is 0)."""
        self._task = asyncio.create_task(self._server.serve(), name="admin-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raises the start-up error (e.g. port in use)
            await asyncio.sleep(0.02)
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._task = None
