"""The other kvstore nodes: asked on a local miss, targets of ``Replicate``.

A node talks to its peers like any client (``KvStoreClient``), so blocks move between nodes by
the same movers: the TCP side channel where the peer serves one, gRPC otherwise.
"""

from __future__ import annotations

from crescent.services.common.tls import PeerTls
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock


class PeerSet:
    def __init__(self, peers: dict[str, str], timeout_s: float, tls: PeerTls | None = None) -> None:
        self.addresses = dict(peers)
        self._tls = tls
        self._timeout_s = timeout_s
        self._clients: dict[str, KvStoreClient] = {}

    def client(self, target: str) -> KvStoreClient:
        address = self.addresses.get(target, target)
        if address not in self._clients:
            self._clients[address] = KvStoreClient(address, timeout_s=self._timeout_s, tls=self._tls)
        return self._clients[address]

    async def fetch(self, keys: list[BlockKey], model_id: str) -> dict[BlockKey, KvBlock]:
        """Whatever of ``keys`` any peer holds (verified by the client)."""
        found: dict[BlockKey, KvBlock] = {}
        for node_id in self.addresses:
            missing = [k for k in keys if k not in found]
            if not missing:
                break
            found.update(await self.client(node_id).get(missing, model_id or None, local_only=True))
        return found

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
