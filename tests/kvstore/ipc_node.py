"""A real kvstore node process whose GPU tier is the CPU stand-in: "device memory" on the CPU and
CUDA IPC as shared memory (``ipc_stand_in.ShmOpener``), everything else the node's own code.
``python -m tests.kvstore.ipc_node --config FILE``; with ``tiers.gpu.enabled`` the stand-in tier
comes first (on the GPU named by ``CRESCENT_TEST_FAKE_GPU``, default ``ipc_stand_in.FAKE_GPU``)."""

from __future__ import annotations

import os

from crescent.services.kvstore import server
from crescent.services.kvstore.gpu_tier import GpuTier
from tests.kvstore.ipc_stand_in import FAKE_GPU, ShmOpener

_build_tiers = server.build_tiers


def build_tiers(settings, metrics):  # noqa: ANN001, ANN201 - server.build_tiers with the stand-in GPU tier
    gpu = settings.tiers.gpu
    if not gpu.enabled:
        return _build_tiers(settings, metrics)
    rest = settings.model_copy(update={"tiers": settings.tiers.model_copy(update={"gpu": gpu.model_copy(update={"enabled": False})})})
    opener = ShmOpener(os.environ.get("CRESCENT_TEST_FAKE_GPU", FAKE_GPU))
    return [GpuTier(gpu, device="cpu", opener=opener), *_build_tiers(rest, metrics)]


if __name__ == "__main__":
    server.build_tiers = build_tiers
    server._cli()
