"""Settings of a decode instance (env prefix ``CRESCENT_DECODE``)."""

from __future__ import annotations

from pydantic import Field

from crescent.services.common.settings import ListenSettings, StrictModel
from crescent.services.common.tls import TlsSettings
from crescent.services.engine.settings import EngineSettings

ENV_PREFIX = "CRESCENT_DECODE"


class DecodeSettings(StrictModel):
    listen: ListenSettings = ListenSettings()
    tls: TlsSettings = TlsSettings()  # mutual TLS for gRPC, served and dialled (docs/security.md)
    instance_id: str = Field(default="", description="unique id; empty: decode-<host>-<port>")
    advertise_address: str = Field(default="", description="host:port others dial; empty: listen host:port")
    scheduler_address: str = Field(description="host:port of the scheduler")
    unclaimed_timeout_s: float = Field(
        default=10.0, gt=0, description="abort a handed-off request nobody streams within this time"
    )
    shm_handoff: bool = Field(
        default=True,
        description="map the shared memory segment a prefill on this host hands a prompt's KV in; off: "
                    "refuse it, and that prefill sends this instance the bytes over gRPC (docs/prefill.md, "
                    "\"Layer-wise handoff\")",
    )
    tcp_handoff: bool = Field(
        default=True,
        description="serve the handoff side channel: a prefill that cannot use shared memory with this instance "
                    "(another pod or host) writes a layer-wise handoff's KV over a TCP socket of its own, opened "
                    "by a one-time token (OpenHandoff, prefill role only), mutual TLS with tls set; off: it sends "
                    "the bytes over gRPC (docs/prefill.md, \"Layer-wise handoff\")",
    )
    handoff_side_channel_port: int = Field(
        default=0, ge=0, le=65535,
        description="port of the handoff side channel (on listen.host); 0: any free one (set one where a "
                    "firewall or a NetworkPolicy must name it)",
    )
    kvstore_address: str = Field(
        default="", description="host:port of this node's kvstore: where a vLLM-backed decode loads a vLLM "
                                "prefill's handoffs from (engine.backend vllm; the native decode takes KV directly)")
    kvstore_lease_ms: int = Field(default=30_000, ge=0, description="how long fetched blocks stay pinned")
    kvstore_shared_memory: bool = Field(
        default=True,
        description="move blocks through shared memory when the kvstore is on this host (gRPC otherwise, found by itself)",
    )
    engine: EngineSettings = EngineSettings()
