"""NIXL (NVIDIA Inference Xfer Library), imported lazily: an RDMA-capable transfer engine for
the kvstore's byte movers, where the cluster has RDMA or NVLink.

Installed with the ``nixl`` extra (``pip install 'crescent[nixl]'``, which brings
``nixl-cu12``; its UCX backend also runs over TCP without a GPU). Nothing imports it unless a
node or client is configured for the "nixl" mover, and every failure — the package absent, its
native libraries missing, an agent that cannot start — becomes ``NixlUnavailable``, upon which
the caller uses the portable movers instead.

A transfer is one-sided: the kvstore node registers its host pool once and hands its agent
metadata and the pool's base address to clients in the reserve reply; a client registers its
payloads and WRITEs them to ``base + offset`` of each reserved slot, then commits over gRPC.
"""

from __future__ import annotations

import importlib
import logging
import secrets
import time
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

BACKENDS = ["UCX"]
POLL_S = 0.0005


class NixlUnavailable(RuntimeError):
    """NIXL cannot be used in this process (absent or broken); use another mover."""


# The meta package ``nixl`` names the API ``nixl``; a wheel of one CUDA variant alone names it
# after the variant.
API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _import_api():  # noqa: ANN202 - the NIXL API module
    missing: list[str] = []
    for name in API_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise  # the package is there but something it needs is not: broken, say so
            missing.append(name.split(".")[0])
    raise ModuleNotFoundError(f"no NIXL package installed (looked for {', '.join(missing)}); "
                              "pip install 'crescent[nixl]'")


def address_of(view: bytes | memoryview) -> int:
    """The address of a buffer's first byte (for registering it with the engine)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class NixlEngine:
    """One NIXL agent of this process."""

    def __init__(self, role: str, *, progress_thread: bool = False) -> None:
        """``progress_thread``: the target of one-sided writes needs one (over UCX's TCP transport
        nothing lands without it; it polls, ~half a core on this VM while idle); an initiator
        progresses its transfers itself while it waits for them."""
        try:
            api = _import_api()
            self._agent = api.nixl_agent(f"crescent-{role}-{secrets.token_hex(4)}",
                                         api.nixl_agent_config(backends=BACKENDS, enable_prog_thread=progress_thread))
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError from native code, its own errors alike
            raise NixlUnavailable(f"NIXL cannot start here: {exc!r}") from exc
        self._remotes: dict[bytes, str] = {}

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def register(self, regions: Sequence[tuple[int, int]]):  # noqa: ANN201 - the engine's handle
        """Register (address, length) regions of host memory; returns what ``deregister`` takes."""
        descs = self._agent.get_reg_descs([(addr, n, 0, "") for addr, n in regions], "DRAM")
        if self._agent.register_memory(descs) is None:
            raise NixlUnavailable("NIXL refused to register memory")
        return descs

    def deregister(self, descs) -> None:  # noqa: ANN001
        self._agent.deregister_memory(descs)

    def write(self, remote_metadata: bytes, local: Sequence[tuple[int, int]], remote: Sequence[int],
              timeout_s: float) -> None:
        """WRITE each local (address, length) region to the remote address at the same index
        (blocking; run it in a thread). Raises ``NixlUnavailable`` on an engine error."""
        agent = self._agent
        name = self._remotes.get(remote_metadata)
        if name is None:
            name = self._remotes[remote_metadata] = agent.add_remote_agent(remote_metadata)
        local_descs = agent.get_xfer_descs([(addr, n, 0) for addr, n in local], "DRAM")
        remote_descs = agent.get_xfer_descs([(addr, n, 0) for addr, (_, n) in zip(remote, local)], "DRAM")
        handle = agent.initialize_xfer("WRITE", local_descs, remote_descs, name, b"crescent-kv")
        if not handle:
            raise NixlUnavailable("NIXL could not set up the transfer")
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise NixlUnavailable(f"NIXL transfer still {state} after {timeout_s}s")
                time.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise NixlUnavailable("NIXL transfer failed")
        finally:
            agent.release_xfer_handle(handle)
