"""Stopping a service's background tasks."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel ``tasks`` (None is skipped) and wait until each has unwound, so whatever its
    ``finally`` blocks release is released when this returns."""
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task
