"""The process group of one tensor-parallel instance, and the leader's commands to its workers.

The leader (rank 0) drives: each operation starts with a broadcast command header (what to do,
a few integers), then the collectives of that operation run on every rank in the same order.
A lock around each whole command keeps that order when two of the leader's threads (the engine
thread, the idle pinger) issue commands. Workers wait in the header broadcast; the leader pings
them while idle, so that wait never runs past the collective timeout unless the leader is gone.

Failure: a collective that fails (a peer's connection dropped) or runs past ``timeout`` breaks
the group for good. ``on_broken`` then runs; by default it logs and ends the process at once
with ``EXIT_GROUP_BROKEN``, so Kubernetes recreates the whole group (LeaderWorkerSet
RecreateGroupOnPodRestart) and a decode leader's streams break, which the gateway migrates.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from crescent.services.engine.parallel.settings import GroupSpec

log = logging.getLogger(__name__)

EXIT_GROUP_BROKEN = 3
_HEADER = 4  # int64s in a command header: the command and up to three arguments


class Command(enum.IntEnum):
    PING = 0        # nothing: keeps idle workers' header wait inside the timeout
    FORWARD = 1     # (payload length): a forward batch follows (batch_wire)
    READ = 2        # (page, tokens): gather each rank's KV heads of a page to the leader
    WRITE = 3       # (page, tokens): scatter a payload's KV heads to the ranks
    SHUTDOWN = 4    # workers exit 0
    CACHE = 5       # (pages, block_size): allocate the KV cache's shards


class GroupBrokenError(RuntimeError):
    """A collective failed or timed out: a process of the group is gone or stuck."""


def _exit_now(error: GroupBrokenError) -> None:
    log.critical("%s; exiting (code %d) so the group restarts together", error, EXIT_GROUP_BROKEN)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_GROUP_BROKEN)


class TpGroup:
    """This process's membership of the group (``torch.distributed``'s default process group)."""

    def __init__(self, spec: GroupSpec, on_broken: Callable[[GroupBrokenError], None] = _exit_now) -> None:
        self.spec = spec
        self.rank, self.size = spec.rank, spec.size
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._last_command = time.monotonic()
        self._closed = threading.Event()
        self._pinger: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def join(self) -> None:
        """Meet the other processes (waiting up to ``startup_timeout`` for them)."""
        spec = self.spec
        log.info("tensor-parallel group: rank %d of %d, rendezvous %s:%d (%s)", spec.rank, spec.size,
                 spec.leader_address, spec.port, spec.backend)
        try:
            store = dist.TCPStore(spec.leader_address, spec.port, spec.size, spec.is_leader,
                                  timeout=spec.startup_timeout, wait_for_workers=False)
            dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.size,
                                    timeout=spec.timeout)
            self._collective("start", lambda: dist.barrier())
        except GroupBrokenError:
            raise
        except Exception as exc:  # noqa: BLE001 - any rendezvous failure reads the same to an operator
            raise GroupBrokenError(
                f"tensor-parallel rank {spec.rank} could not join the group at {spec.leader_address}:{spec.port} "
                f"within {spec.startup_timeout.total_seconds():g} s: {exc}") from exc

    def start_pinging(self) -> None:
        """Leader, once set up: ping idle workers from now on. Not earlier: a ping among the
        start-up collectives (which run outside commands) would meet another collective."""
        assert self.spec.is_leader and self._pinger is None
        self._last_command = time.monotonic()
        self._pinger = threading.Thread(target=self._ping_while_idle, name="tp-ping", daemon=True)
        self._pinger.start()

    def close(self) -> None:
        """Leader: tell the workers to exit; every rank: leave the group."""
        with self._lock:  # no ping may follow the shutdown
            if self._closed.is_set() or not dist.is_initialized():
                return
            self._closed.set()
            if self.spec.is_leader:
                header = torch.tensor([int(Command.SHUTDOWN), *[0] * (_HEADER - 1)], dtype=torch.int64)
                try:
                    dist.broadcast(header, 0)
                except Exception as exc:  # noqa: BLE001 - leaving anyway; the workers exit on their own
                    log.warning("could not tell the tensor-parallel workers to exit: %s", exc)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    # ---- commands ------------------------------------------------------------------------

    @contextlib.contextmanager
    def command(self, command: Command, *args: int) -> Iterator[None]:
        """Leader: send a command header, then run that command's collectives in the block."""
        assert self.spec.is_leader, "only the leader sends commands"
        header = torch.tensor([int(command), *args, *[0] * (_HEADER - 1 - len(args))], dtype=torch.int64)
        with self._lock:
            if self._closed.is_set():
                raise GroupBrokenError("the tensor-parallel group is closed")
            self._collective(command.name, lambda: dist.broadcast(header, 0))
            try:
                yield
            finally:
                self._last_command = time.monotonic()

    def next_command(self) -> tuple[Command, list[int]]:
        """Worker: wait for the leader's next command header."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._collective("the wait for the leader's next command", lambda: dist.broadcast(header, 0))
        values = header.tolist()
        return Command(values[0]), values[1:]

    # ---- collectives ---------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._collective("broadcast", lambda: dist.broadcast(tensor, 0))

    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self._collective("all_gather", lambda: dist.all_gather(out, tensor))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (every rank ends with the same bits)."""
        self._collective("all_reduce", lambda: dist.all_reduce(tensor))
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape), on the leader; None elsewhere."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.spec.is_leader else None
        self._collective("gather", lambda: dist.gather(tensor, parts, dst=0))
        return parts

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None) -> None:
        """The leader's ``parts[r]`` into rank r's ``out``."""
        self._collective("scatter", lambda: dist.scatter(out, parts, src=0))

    def _collective(self, what: str, run: Callable[[], object]) -> None:
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - gloo and nccl raise several types; all mean a lost peer
            error = GroupBrokenError(
                f"tensor-parallel group of {self.size}: rank {self.rank} lost the group during {what} "
                f"(a process died or stalled past {self.spec.timeout.total_seconds():g} s): {exc}")
            self._closed.set()
            self._on_broken(error)
            raise error from exc

    def _ping_while_idle(self) -> None:
        interval = self.spec.timeout.total_seconds() / 4
        while not self._closed.wait(interval / 2):
            if time.monotonic() - self._last_command >= interval:
                with contextlib.suppress(GroupBrokenError), self.command(Command.PING):
                    pass
