"""Tensor-parallel groups on loopback: worker processes for the tiny model, and a leader here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from crescent.services.common.logs import configure_logging
from crescent.services.engine.parallel.group import GroupBrokenError, TpGroup
from crescent.services.engine.parallel.leader import TensorParallelLlama, check_same_model, shard_model
from crescent.services.engine.parallel.settings import ParallelSettings
from crescent.services.engine.parallel.worker import ShardWorker
from tests.engine.tiny_model import TINY, tiny_weights

REPO = Path(__file__).resolve().parents[2]


def _spec(port: int, rank: int, size: int, timeout_s: float):
    return ParallelSettings(group_size=size, rank=rank, port=port, timeout_s=timeout_s,
                            startup_timeout_s=60).resolve({})


def tiny_worker(port: int, rank: int, size: int, timeout_s: float) -> None:
    """A worker process's body: the tiny model's shard, serving the leader until shutdown."""
    configure_logging(f"tiny-worker-{rank}")
    torch.set_num_threads(1)
    group = TpGroup(_spec(port, rank, size, timeout_s))
    group.join()
    weights = tiny_weights(TINY)
    check_same_model(group, TINY, weights)
    ShardWorker(shard_model(TINY, weights, group), group).serve()


def start_tiny_worker(port: int, rank: int, size: int, timeout_s: float, log: Path) -> subprocess.Popen[bytes]:
    code = f"from tests.parallel.support import tiny_worker; tiny_worker({port}, {rank}, {size}, {timeout_s})"
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))


def _keep_running(error: GroupBrokenError) -> None:
    """In a test process, a broken group only raises (``TpGroup`` does) instead of ending the process."""


def tiny_leader(port: int, size: int, timeout_s: float) -> TensorParallelLlama:
    """The tiny model led from this process (rank 0); its workers must be started too."""
    group = TpGroup(_spec(port, 0, size, timeout_s), on_broken=_keep_running)
    group.join()
    weights = tiny_weights(TINY)
    check_same_model(group, TINY, weights)
    model = TensorParallelLlama(shard_model(TINY, weights, group), group)
    group.start_pinging()
    return model
