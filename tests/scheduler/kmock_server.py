"""A Kubernetes API emulator (kmock) on a free loopback port, as its own process, for tests.

Prints its URL on the first line of stdout, then serves until terminated.
"""

from __future__ import annotations

import asyncio
import os
import signal

import kmock


async def serve() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        print(server.url, flush=True)
        await stop.wait()
        # A graceful exit would wait for clients' open watch streams to end; there is nothing to flush.
        os._exit(0)


if __name__ == "__main__":
    asyncio.run(serve())
