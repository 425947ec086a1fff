"""Client of a kvstore node, for prefill/decode and for other kvstore nodes.

The store is only a cache: every failure (unreachable node, deadline, bad reply, corrupt block)
is logged, counted in ``errors`` and answered as a miss or a failed put; nothing here raises
into a request. Every block returned has passed ``KvBlock.verify``.

One client over pluggable byte movers (``movers/``). gRPC is always the control plane; the
payloads travel the first way in ``movers`` that works with this node:

- ``shm``: shared memory, for a node on this host (only headers over gRPC);
- ``tcp``: the node's TCP side channel, received straight into reserved pool room and
  checksummed as it lands (any host; opened by a one-time token from the reserve call);
- ``nixl``: one-sided writes through NIXL where it is installed (RDMA clusters; optional);
- ``grpc``: inside the gRPC streams (``chunk_wire``: protobuf's bytes without its copies);
  always last, works from anywhere.

Blocks an engine holds on a GPU (``put_device``/``get_device``) go first through ``cuda_ipc``
(``movers/cuda_ipc.py``): CUDA IPC regions, device to device into the node's GPU tier, when the
node's ``Stat`` names the same GPU (its UUID); otherwise, or once the node refused, through
host bytes and the movers above.

A prompt's new blocks can also be written a layer at a time while prefill computes them
(``reserve_layers``, mover ``shm-layers``: same host only, through the shared-memory mover's
pool mapping; ``movers/shm_layers.py``); elsewhere prefill puts them whole, a chunk at a time.

A mover that can never work with this node (another host, a feature the node lacks, an engine
absent here) is dropped for good; one whose call failed this time passes that call to the next.
The order and the refusals are a ``MoverLadder`` (``kvwire/movers.py``), the family the layer-wise
handoff to decode climbs too.
The mover in use with each node shows in ``crescent_kv_mover_selected{peer,mover}``.

A block that fails its check is reported back (``Remove`` with ``crescent-reason: corrupt``):
the node does not re-check host memory on reads, so readers' checks are how it learns that a
copy went bad; it re-checks that copy and drops and counts it if it is bad.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from crescent.protos import common_pb2, kvstore_pb2
from crescent.services.common.grpc_service import open_channel
from crescent.services.common.metrics import kv_mover_metrics
from crescent.services.common.tls import PeerTls
from crescent.services.kvstore.cuda_ipc import CUDA_IPC, RegionOpener
from crescent.services.kvstore.movers.base import Mover, NodeLink, PutResult
from crescent.services.kvstore.movers.cuda_ipc import CudaIpcMover
from crescent.services.kvstore.movers.grpc_stream import GrpcStreamMover
from crescent.services.kvstore.movers.nixl import NixlMover
from crescent.services.kvstore.movers.shared_memory import SharedMemoryMover
from crescent.services.kvstore.movers.shm_layers import LayeredPuts, LayeredRoom
from crescent.services.kvstore.movers.tcp import TcpSideChannelMover
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import DEFAULT_MAX_CHUNK_BYTES, BlockIntegrityError, KvBlock, expected_nbytes
from crescent.services.kvwire.movers import MoverLadder

__all__ = ["KvStoreClient", "PutResult", "MOVERS", "wait_ready"]

log = logging.getLogger(__name__)

MOVERS = (CUDA_IPC, "shm", "tcp", "nixl", "grpc")  # every mover, fastest first where each works
# Metadata of a Remove call that reports blocks a reader found corrupt (no proto change needed).
REASON_METADATA = "crescent-reason"
REASON_CORRUPT = "corrupt"


def default_movers(shared_memory: bool) -> tuple[str, ...]:
    return ("shm", "tcp", "grpc") if shared_memory else ("tcp", "grpc")


class KvStoreClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        shared_memory: bool = False,
        movers: Sequence[str] | None = None,
        copy_threads: int | None = None,
        tls: PeerTls | None = None,
        device_opener: RegionOpener | None = None,
    ) -> None:
        """``movers``: the ways to try, in order (names from ``MOVERS``; "grpc" is always added
        last); by default ``shm`` (when ``shared_memory``), ``tcp``, ``grpc``.
        ``copy_threads``: threads that copy shared-memory payloads (default: up to 2);
        ``tls``: this process's key pair (None: plaintext); ``device_opener``: how this process
        shares device memory (``cuda_ipc.CudaIpc``, a test's stand-in): given, ``cuda_ipc`` comes
        first by default (named in ``movers`` without it, ``CudaIpc`` is used)."""
        names = list(movers) if movers is not None else list(default_movers(shared_memory))
        if movers is None and device_opener is not None:
            names.insert(0, CUDA_IPC)
        unknown = [n for n in names if n not in MOVERS]
        if unknown:
            raise ValueError(f"unknown kvstore mover(s) {', '.join(unknown)}; valid: {', '.join(MOVERS)}")
        if "grpc" not in names:
            names.append("grpc")
        self.address = address
        self.timeout_s = timeout_s
        self.max_chunk_bytes = max_chunk_bytes
        names = list(dict.fromkeys(names))
        self._ladder = MoverLadder(names, metrics=_NodeMoverMetrics(), what="kvstore")
        self._link = NodeLink(address, open_channel(address, tls), timeout_s, self._ladder)
        grpc_mover = GrpcStreamMover(self._link, max_chunk_bytes)
        build = {
            "shm": lambda: SharedMemoryMover(self._link, grpc_mover, copy_threads),
            "tcp": lambda: TcpSideChannelMover(self._link, grpc_mover, tls),
            "nixl": lambda: NixlMover(self._link, grpc_mover),
            "grpc": lambda: grpc_mover,
            CUDA_IPC: lambda: CudaIpcMover(self._link, device_opener),
        }
        self.movers: list[Mover] = [build[name]() for name in names]
        self._by_name = {m.name: m for m in self.movers}
        shm = self.shared_memory
        self._layered = LayeredPuts(shm) if shm is not None else None
        self._metrics = kv_mover_metrics()
        self.mover = ""  # the one that moved the last blocks

    # -- what tests and operators look at --------------------------------------------------------

    @property
    def errors(self):  # noqa: ANN201 - a Counter: by operation and "integrity"
        return self._link.errors

    @property
    def _stub(self):  # noqa: ANN202 - the generated stub (control calls; tests wrap its methods)
        return self._link.stub

    @property
    def shared_memory(self) -> SharedMemoryMover | None:
        return next((m for m in self.movers if isinstance(m, SharedMemoryMover)), None)

    @property
    def uses_shared_memory(self) -> bool:
        shm = self.shared_memory
        return shm is not None and shm.usable

    def _usable(self) -> list[Mover]:
        """The movers to try now, fastest first (the ladder's: what this node has not refused)."""
        return [self._by_name[name] for name in self._ladder.open(self.address)]

    def _moved(self, mover: Mover, direction: str, nbytes: int) -> None:
        self.mover = mover.name
        self._ladder.moved(self.address, mover.name, direction, nbytes)

    # -- put ------------------------------------------------------------------------------------

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult:
        if not blocks:
            return PutResult(0, 0)
        for mover in self._usable():
            result = await mover.put(blocks)
            if result is not None:
                if not result.failed:
                    self._moved(mover, "put", sum(b.nbytes for b in blocks))
                return result
        raise AssertionError("the gRPC mover always answers")

    # -- put a layer at a time ------------------------------------------------------------------

    @property
    def takes_layers(self) -> bool:
        """Whether new blocks may be written to this node a layer at a time (as far as we know:
        the first reservation finds out whether the node and its pool allow it)."""
        return self._layered is not None and self._layered.usable and self.uses_shared_memory

    async def reserve_layers(self, metas: Sequence[common_pb2.BlockMeta]) -> LayeredRoom | None:
        """Pool room for blocks of these headers (checksums still 0), to be written a layer at a
        time and committed whole; None: put them whole instead (another host, a node without it)."""
        if not self.takes_layers:
            return None
        assert self._layered is not None
        return await self._layered.reserve(metas)

    def layers_moved(self, nbytes: int) -> None:
        """Bytes a layer-wise put committed (``crescent_kv_mover_bytes{mover="shm-layers"}``)."""
        self._metrics.moved_bytes.labels(self.address, LayeredPuts.name, "put").inc(nbytes)

    # -- get ------------------------------------------------------------------------------------

    async def get_prefix(self, keys: Sequence[BlockKey], model_id: str, lease_ms: int = 0) -> list[KvBlock]:
        """The longest run of blocks from the start of ``keys`` that the store holds, verified."""
        found = await self._get(keys, model_id, lease_ms, stop_at_first_miss=True)
        prefix = []
        for key in keys:
            block = found.get(key)
            if block is None:
                break
            prefix.append(block)
        return prefix

    async def get(
        self, keys: Sequence[BlockKey], model_id: str | None = None, lease_ms: int = 0, *,
        local_only: bool = False,
    ) -> dict[BlockKey, KvBlock]:
        """Whichever of ``keys`` the store holds, verified (``model_id`` None: any model)."""
        return await self._get(keys, model_id, lease_ms, stop_at_first_miss=False, local_only=local_only)

    async def _get(self, keys: Sequence[BlockKey], model_id: str | None, lease_ms: int, *,
                   stop_at_first_miss: bool, local_only: bool = False) -> dict[BlockKey, KvBlock]:
        if not keys:
            return {}
        request = kvstore_pb2.GetRequest(
            keys=keys, model_id=model_id or "", lease_ms=lease_ms,
            stop_at_first_miss=stop_at_first_miss, local_only=local_only,
        )
        corrupt: list[BlockKey] = []
        found: dict[BlockKey, KvBlock] = {}
        for mover in self._usable():
            got = await mover.get(request, model_id, corrupt)
            if got is not None:
                found = got
                self._moved(mover, "get", sum(b.nbytes for b in got.values()))
                break
        await self._report_corrupt(corrupt)
        return found

    async def _report_corrupt(self, keys: list[BlockKey]) -> None:
        """Tell the node which blocks failed our check, so it drops its bad copies."""
        if not keys:
            return
        try:
            reply = await self._link.stub.Remove(
                kvstore_pb2.KeysRequest(keys=keys), timeout=self.timeout_s,
                metadata=((REASON_METADATA, REASON_CORRUPT),),
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._link.failed("report_corrupt", exc)
            return
        log.info("kvstore %s dropped %d of %d blocks reported corrupt", self.address, reply.removed,
                 len(keys))

    # -- device blocks (same GPU: cuda_ipc) ---------------------------------------------------

    @property
    def _device_mover(self) -> CudaIpcMover | None:
        mover = self._by_name.get(CUDA_IPC)
        return mover if isinstance(mover, CudaIpcMover) and mover.usable else None

    @property
    def device_path_open(self) -> bool:
        """Whether ``put_device``/``get_device`` would try this node device to device now: this
        client has ``cuda_ipc`` and the node has not refused it (before its first answer: yes).
        An engine without a device opener, or once the node refused, uses host blocks instead."""
        return self._device_mover is not None

    async def put_device(self, headers: Sequence[KvBlock], tensors: Sequence) -> PutResult:  # noqa: ANN001
        """Store blocks whose payloads are ``tensors`` (contiguous, on a GPU; ``headers``' payloads
        are ignored, a checksum of 0 is computed by the node): device to device when the node's GPU
        tier is on the same GPU, else their bytes copied to the host and put like ``put``'s."""
        if not headers:
            return PutResult(0, 0)
        mover = self._device_mover
        if mover is not None:
            result = await mover.put_device(headers, tensors)
            if result is not None:
                self._moved(mover, "put", sum(t.numel() * t.element_size() for t in tensors))
                return result
        return await self.put([_on_host(h, t) for h, t in zip(headers, tensors)])

    async def get_device(self, keys: Sequence[BlockKey], rooms: Sequence, model_id: str | None = None,  # noqa: ANN001
                         lease_ms: int = 0, *, stop_at_first_miss: bool = False) -> dict[BlockKey, KvBlock]:
        """Whichever of ``keys`` the node holds, each payload written into its room (``rooms``: one
        contiguous device tensor per key): device to device when the node's GPU tier is on the same
        GPU, else fetched as host bytes (verified) and copied in. The headers (their payloads may
        be empty). A block is in its room only when the room is its size (``room_holds``): a room
        too small is left alone and the block's header still returned, so a caller that cannot
        know a block's size before (a kimi_k3 block carries a state or not) asks again with a
        room of the size its shape gives."""
        if not keys:
            return {}
        mover = self._device_mover
        if mover is not None:
            request = kvstore_pb2.GetRequest(keys=keys, model_id=model_id or "", lease_ms=lease_ms,
                                             stop_at_first_miss=stop_at_first_miss, local_only=True)
            got = await mover.get_device(request, rooms)
            if got is not None:
                self._moved(mover, "get", sum(_nbytes(r) for k, r in zip(keys, rooms)
                                              if k in got and room_holds(got[k], r)))
                return got
        found = await self._get(keys, model_id, lease_ms, stop_at_first_miss=stop_at_first_miss)
        import torch

        for key, room in zip(keys, rooms):
            block = found.get(key)
            # a block of another size is left out of its room (too small: asked again; else refused by the caller's shape check)
            if block is not None and block.nbytes and block.nbytes == _nbytes(room):
                room.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(block.payload), dtype=torch.uint8))
        return found

    # -- small calls ----------------------------------------------------------------------------

    async def exists(self, keys: Sequence[BlockKey], model_id: str = "") -> list[bool]:
        try:
            reply = await self._stub.Exists(kvstore_pb2.KeysRequest(keys=keys, model_id=model_id),
                                            timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._link.failed("exists", exc)
            return [False] * len(keys)
        return list(reply.present)

    async def remove(self, keys: Sequence[BlockKey]) -> int:
        try:
            reply = await self._stub.Remove(kvstore_pb2.KeysRequest(keys=keys), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._link.failed("remove", exc)
            return 0
        return reply.removed

    async def stat(self) -> kvstore_pb2.StatReply | None:
        try:
            return await self._stub.Stat(kvstore_pb2.StatRequest(), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._link.failed("stat", exc)
            return None

    async def replicate(self, keys: Sequence[BlockKey], target: str) -> int:
        """Ask this node to copy ``keys`` to ``target`` (a peer's node id or host:port)."""
        try:
            reply = await self._stub.Replicate(kvstore_pb2.ReplicateRequest(keys=keys, target=target),
                                               timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._link.failed("replicate", exc)
            return 0
        return reply.replicated

    async def list_blocks(self, tier: int = 0, limit: int = 0,
                          start_after: bytes = b"") -> kvstore_pb2.ListReply | None:
        try:
            return await self._stub.List(
                kvstore_pb2.ListRequest(tier=tier, limit=limit, start_after=start_after),
                timeout=self.timeout_s,
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._link.failed("list", exc)
            return None

    async def close(self) -> None:
        for mover in self.movers:
            await mover.close()
        await self._link.channel.close()


def room_holds(header: KvBlock, room) -> bool:  # noqa: ANN001 - a device tensor
    """Whether ``get_device`` wrote ``header``'s block into ``room``: the room is its size (the
    header's dtype and shape give it; a device get's header has no payload)."""
    try:
        return expected_nbytes(header.dtype, tuple(header.shape)) == _nbytes(room)
    except BlockIntegrityError:
        return False


def _nbytes(tensor) -> int:  # noqa: ANN001
    return tensor.numel() * tensor.element_size()


def _on_host(header: KvBlock, tensor) -> KvBlock:  # noqa: ANN001
    """``header``'s block with the bytes of ``tensor`` copied to the host, checksummed."""
    payload = tensor.detach().reshape(-1).cpu().contiguous().view(-1)
    import torch

    data = payload.view(torch.uint8).numpy().tobytes()
    return KvBlock.build(header.key, header.parent_key, header.model_id, header.dtype, header.shape,
                         header.token_ids, data)


class _NodeMoverMetrics:
    """The ladder's reports as ``crescent_kv_mover_*`` (refusals show in the logs only)."""

    def __init__(self) -> None:
        self._metrics = kv_mover_metrics()

    def moved(self, peer: str, mover: str, direction: str, nbytes: int) -> None:
        self._metrics.moved_bytes.labels(peer, mover, direction).inc(nbytes)

    def selected(self, peer: str, mover: str, names: Sequence[str]) -> None:
        for name in names:
            self._metrics.selected.labels(peer, name).set(name == mover)

    def refused(self, peer: str, mover: str) -> None:
        pass


async def wait_ready(client: KvStoreClient, timeout_s: float = 10.0) -> bool:
    """Poll ``stat`` until the node answers (tests and start-up ordering)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            await client._stub.Stat(kvstore_pb2.StatRequest(), timeout=1.0)
            return True
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)
    return False
