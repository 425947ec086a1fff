"""The gateway and the fake backend served from the test process (issue 28: a fast inner loop).

Both listen on 127.0.0.1 as the processes of ``support.py`` do, but from one asyncio loop on a
daemon thread of pytest: the tests talk HTTP (and the gateway gRPC) over loopback exactly as
before, without starting a Python interpreter per gateway. Why a server thread, not httpx's
``ASGITransport``: the tests use the sync OpenAI and httpx clients (ASGITransport is async only),
ASGITransport collects the whole body before it returns (no streams, no disconnects), and it
skips what uvicorn adds (the header deadline, proxy headers, Host). Here the app is the one
``server.gateway_app`` builds, under the uvicorn settings of ``server.uvicorn_config``, so only
the process around it differs: signals and the drain on SIGTERM, the logging set-up, and a
process's own metrics registry (in-process gateways share this process's counters: read deltas).
Tests of those keep the real processes of ``support.py``.

``InProcessBackend`` and ``InProcessGateway`` take the arguments of ``FakeBackend`` and
``Gateway`` and answer the same calls, so a module moves by changing which class it builds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import uvicorn

from crescent.services.gateway.config import load_gateway_settings
from crescent.services.gateway.server import ModelLoader, check_exposure, gateway_app, served_model, uvicorn_config

from . import fake_backend
from .fake_tokenizer import fake_served_model
from .fake_tool_model import fake_tool_served_model
from .support import BLOCK_SIZE, FAKE_TOKENIZER_ENTRY, PRODUCTION_ENTRY, FakeBackend, Gateway, answers

T = TypeVar("T")
log = logging.getLogger(__name__)

# Each process entry of the tests, as the model loader it passes to ``server.main`` (None: the model's own).
LOADERS: dict[tuple[str, ...], ModelLoader | None] = {
    FAKE_TOKENIZER_ENTRY: fake_served_model,
    ("-m", "tests.gateway.fake_tool_model"): fake_tool_served_model,
    PRODUCTION_ENTRY: None,
}


class _Loop:
    """One event loop on a daemon thread for every in-process server (grpc.aio objects stay on their loop)."""

    _shared: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="in-process-servers", daemon=True)
        self.thread.start()

    @classmethod
    def shared(cls) -> _Loop:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[return-value]


class InProcessBackend(FakeBackend):
    """``fake_backend``'s services on the shared loop: same ports, control API and calls as
    ``FakeBackend``. ``vocab``: the vocabulary it reads prompts and writes replies in (the fake
    tokenizer's by default; ``real_echo_backend.vocab()``, ``k3_echo_backend.vocab()``), its own
    beside any other backend's."""

    def __init__(self, block_size: int = BLOCK_SIZE, vocab: fake_backend.Vocab = fake_backend.FAKE_VOCAB) -> None:
        super().__init__()
        self.block_size, self.vocab = block_size, vocab
        self._stop: Callable[[], Awaitable[None]] | None = None

    def start_backend(self) -> None:
        self._stop = _Loop.shared().run(fake_backend.start(self.port, self.control_port, self.block_size, self.vocab))

    def alive(self) -> bool:
        return self._stop is not None

    def stop(self) -> int | None:
        if self._stop is None:
            return None
        stop, self._stop = self._stop, None
        _Loop.shared().run(stop())
        return 0


class InProcessGateway(Gateway):
    """The gateway app under uvicorn on the shared loop; the settings file is written as ``Gateway`` writes it.

    ``start_gateway`` raises what the process would have exited with (a settings error, a refused
    exposure); ``stop`` returns 0 once the server and what ``gateway_app`` owns have closed cleanly.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config_path = self.argv[-1]
        entry = kwargs.get("entry", FAKE_TOKENIZER_ENTRY)
        if entry not in LOADERS:
            raise ValueError(f"no in-process form of the entry {entry!r}")
        self._loader = LOADERS[entry]
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Future[None] | None = None

    def spawn(self) -> None:
        settings = load_gateway_settings(self.config_path)
        check_exposure(settings)
        model = served_model(settings, self._loader)
        self._task = _Loop.shared().spawn(self._serve(settings, model))

    async def _serve(self, settings: Any, model: Any) -> None:
        async with gateway_app(settings, model) as (app, _drain):
            self._server = uvicorn.Server(uvicorn_config(settings, app))
            await self._server.serve()

    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def wait_ready(self, ready_url: str, *, expect_status: int | None = 200, timeout_s: float = 20.0) -> None:
        assert self._task is not None, "spawn first"
        task = self._task

        def still_running() -> None:
            if task.done():
                task.result()  # re-raises why it stopped
                raise RuntimeError("the in-process gateway stopped")

        if not answers(ready_url, expect_status, timeout_s, still_running, interval_s=0.02):
            self.stop()
            raise TimeoutError(f"{self.name} did not become ready at {ready_url}")

    def stop(self) -> int | None:
        """Stop serving (uvicorn's shutdown, then ``gateway_app``'s); 0 when it ended without an error."""
        if self._task is None:
            return None
        task, self._task = self._task, None
        server = self._server
        if server is not None:
            _Loop.shared().loop.call_soon_threadsafe(setattr, server, "should_exit", True)
        else:  # stopped before it served
            _Loop.shared().loop.call_soon_threadsafe(task.cancel)
        try:
            task.result(timeout=15)
        except Exception:  # noqa: BLE001 - the caller's check fails on the code, as with a process
            log.exception("the in-process gateway did not stop cleanly")  # shown in the failed test's report
            return 1
        return 0
