"""Settings of a tensor-parallel engine group: one instance computed by several processes.

Inside a LeaderWorkerSet every pod gets ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX`` (0: the
leader) and ``LWS_LEADER_ADDRESS``; a setting left empty takes its value from them, so the
chart's pods need no per-pod configuration. Without them (and without the settings) the group
is one process: today's engine, unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from pydantic import Field

from crescent.services.common.settings import SettingsError, StrictModel

LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS = "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"


class GroupSettingsError(SettingsError):
    """Group settings that cannot run; the message names the setting (``crescent serve`` prints it)."""


class ParallelSettings(StrictModel):
    group_size: int | None = Field(
        default=None, ge=1,
        description="processes computing this instance (tensor parallel over attention heads and the MLP); "
                    "empty: $LWS_GROUP_SIZE, else 1 (one process, no group)",
    )
    rank: int | None = Field(
        default=None, ge=0,
        description="this process's place in the group, 0 being the leader (the serving process); "
                    "empty: $LWS_WORKER_INDEX, else 0",
    )
    leader_address: str = Field(
        default="", description="host the leader (rank 0) listens on for the group; empty: $LWS_LEADER_ADDRESS, "
                                "else 127.0.0.1",
    )
    port: int = Field(default=29500, ge=1, le=65535, description="port of the group's rendezvous on the leader")
    backend: Literal["gloo", "nccl"] = Field(
        default="gloo",
        description="torch.distributed backend of the group's collectives: gloo (CPU tensors); nccl (GPU tensors) is "
                    "refused until the engine computes on GPUs, since today's engine keeps its tensors on the CPU",
    )
    timeout_s: float = Field(
        default=60.0, gt=0,
        description="longest wait in one collective: past it (or at once when a peer's connection drops) the "
                    "leader exits non-zero, a worker too, and Kubernetes restarts the group together; the "
                    "leader also pings idle workers every timeout_s / 4",
    )
    startup_timeout_s: float = Field(
        default=600.0, gt=0, description="how long the group's processes wait for each other at start (model loads)",
    )

    def resolve(self, environ: Mapping[str, str] | None = None) -> GroupSpec:
        """The group this process belongs to, from the settings and the LWS variables."""
        env = os.environ if environ is None else environ
        size = self.group_size if self.group_size is not None else _env_int(env, LWS_GROUP_SIZE, 1)
        rank = self.rank if self.rank is not None else _env_int(env, LWS_WORKER_INDEX, 0)
        if size < 1:
            raise GroupSettingsError(f"engine.parallel.group_size must be at least 1, got {size}")
        if not 0 <= rank < size:
            raise GroupSettingsError(
                f"engine.parallel.rank {rank} is outside a group of {size} processes (ranks 0..{size - 1})")
        if self.backend == "nccl" and size > 1:
            raise GroupSettingsError("engine.parallel.backend nccl reduces GPU tensors, and the engine computes on "
                                     "the CPU today: use gloo")
        address = self.leader_address or env.get(LWS_LEADER_ADDRESS, "") or "127.0.0.1"
        return GroupSpec(size=size, rank=rank, leader_address=address, port=self.port, backend=self.backend,
                         timeout=timedelta(seconds=self.timeout_s),
                         startup_timeout=timedelta(seconds=self.startup_timeout_s))


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A resolved group: who is in it and where they meet."""

    size: int
    rank: int
    leader_address: str
    port: int
    backend: str
    timeout: timedelta
    startup_timeout: timedelta

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def check_leader(self) -> None:
        """A serving process: GroupSettingsError unless it is rank 0 (or alone)."""
        if self.rank != 0:
            raise GroupSettingsError(
                f"engine.parallel.rank is {self.rank}: the serving process is the group's leader (rank 0); "
                "run the other ranks as workers (`crescent serve <role>-worker`)")

    def check_worker(self) -> None:
        """A worker process: GroupSettingsError unless it has a rank past the leader's."""
        if self.rank == 0:
            raise GroupSettingsError(
                f"engine.parallel.rank is 0 (group of {self.size}): rank 0 is the leader, which runs the role's "
                "server; a worker needs a rank of 1 or more ($LWS_WORKER_INDEX in a LeaderWorkerSet)")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise GroupSettingsError(f"${name} must be an integer, got {raw!r}") from None
