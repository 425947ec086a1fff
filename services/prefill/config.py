"""Settings of a prefill instance (env prefix ``CRESCENT_PREFILL``); ``PrefillBaseSettings`` is what
an aggregated instance shares with it (it batches prompts its own way: ``chunk_tokens``)."""

from __future__ import annotations

from pydantic import Field

from crescent.services.common.settings import ListenSettings, StrictModel
from crescent.services.common.tls import TlsSettings
from crescent.services.engine.settings import EngineSettings

ENV_PREFIX = "CRESCENT_PREFILL"


class PrefillBaseSettings(StrictModel):
    listen: ListenSettings = ListenSettings()
    tls: TlsSettings = TlsSettings()  # mutual TLS for gRPC, served and dialled (docs/security.md)
    instance_id: str = Field(default="", description="unique id; empty: <role>-<host>-<port>")
    advertise_address: str = Field(default="", description="host:port others dial; empty: listen host:port")
    scheduler_address: str = Field(description="host:port of the scheduler")
    kvstore_address: str = Field(default="", description="host:port of this node's kvstore; empty: no kvstore")
    kvstore_lease_ms: int = Field(default=30_000, ge=0, description="how long fetched blocks stay pinned")
    kvstore_shared_memory: bool = Field(
        default=True,
        description="move blocks through shared memory when the kvstore is on this host (gRPC otherwise, found by itself)",
    )
    engine: EngineSettings = EngineSettings()


class PrefillSettings(PrefillBaseSettings):
    max_batch_tokens: int = Field(
        default=2048, ge=0,
        description="prefill batching: prompt tokens per forward pass, shared by the chunks of several queued "
                    "prompts (each cut into engine.prefill_chunk_tokens chunks, as alone; the oldest prompt's chunk "
                    "always runs); 0: one prompt at a time. The default is the default chunk, so no forward is "
                    "larger than one long prompt's; on one quiet CPU thread 512 does better (docs/prefill.md)",
    )
    layerwise_handoff: bool = Field(
        default=True,
        description="send the prompt's KV to decode a layer at a time while the prompt is computed (Mooncake's "
                    "layer-wise transfer), so most of the handoff hides behind the forward passes; off: the whole "
                    "KV after the prompt is computed. Both model families: kimi_k3 sends its MLA layers' latents "
                    "so and its KDA state once final; a tensor-parallel prefill always sends it whole "
                    "(docs/prefill.md, \"Layer-wise handoff\")",
    )
    shm_handoff: bool = Field(
        default=True,
        description="layer-wise handoffs to a decode instance on this host: its KV through a shared memory "
                    "segment (/dev/shm), the Handoff stream carrying only the header, a CRC-checked note per "
                    "slice and the tail; a decode that cannot map it (another host or pod) refuses once and "
                    "gets the bytes over gRPC from then on. Off: always gRPC (docs/prefill.md, \"Layer-wise "
                    "handoff\")",
    )
    tcp_handoff: bool = Field(
        default=True,
        description="layer-wise handoffs to a decode instance shared memory does not reach (another pod or host): "
                    "its KV over that decode's handoff side channel (TCP, opened by OpenHandoff's one-time token; "
                    "mutual TLS when decode has tls), the Handoff stream carrying only the notes; a decode without "
                    "one, or whose side channel cannot be reached or breaks, gets the bytes over gRPC from then on "
                    "(docs/prefill.md, \"Layer-wise handoff\")",
    )
    layerwise_kvstore: bool = Field(
        default=True,
        description="write the prompt's new full blocks into the node's kvstore a layer at a time while the "
                    "prompt is computed, each block committed once all its layers landed (CRC-checked by the "
                    "node), so the export hides behind the forward passes; off: whole blocks after the prompt. "
                    "Layer by layer with a kvstore on this host (shared memory); with another mover each chunk's "
                    "blocks go whole once the chunk is computed. Layer-major caches only (not kimi_k3, whose "
                    "blocks go whole after the prompt) (docs/prefill.md, \"Layer-wise kvstore export\")",
    )
