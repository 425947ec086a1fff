"""Settings of a kvstore node: YAML file plus ``CRESCENT_KVSTORE__...`` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from crescent.services.common.settings import ListenSettings, StrictModel, load_settings
from crescent.services.common.tls import TlsSettings

ENV_PREFIX = "CRESCENT_KVSTORE"
GIB = 1024**3


class TierSettings(StrictModel):
    """One tier's size. Eviction starts above ``high_watermark`` x capacity and frees down to
    ``low_watermark`` x capacity, so a burst of puts does not evict one block per put."""

    enabled: bool = True
    capacity_bytes: int = Field(default=GIB, ge=0)
    high_watermark: float = Field(default=0.95, gt=0, le=1)
    low_watermark: float = Field(default=0.85, gt=0, le=1)

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> TierSettings:
        if self.low_watermark > self.high_watermark:
            raise ValueError("low_watermark must not exceed high_watermark")
        return self


class HostTierSettings(TierSettings):
    """Host DRAM, preallocated (and touched) at start so copies never wait on page faults."""

    page_bytes: int = Field(
        default=256 * 1024, ge=1024,
        description="allocation unit; a 2.9 MB block wastes under 9% at 256 KiB",
    )
    prefault: bool = Field(
        default=False,
        description="touch the whole arena at start (slower start, full RSS at once); else pages fault on first use",
    )
    huge_pages: Literal["off", "2Mi", "1Gi"] = Field(
        default="off",
        description="back the arena with the kernel's preallocated huge pages of this size (the chart sets it with "
                    "kvstore.hugepages); too few free is an error at start. Not with the GPU tier (its pool is pinned)",
    )


    @model_validator(mode="after")
    def _room_for_a_page(self) -> HostTierSettings:
        if self.enabled and self.capacity_bytes < self.page_bytes:
            raise ValueError("tiers.host.capacity_bytes is smaller than one page (tiers.host.page_bytes)")
        return self


class DiskTierSettings(TierSettings):
    enabled: bool = False
    path: Path | None = Field(default=None, description="directory of the SSD tier; required when enabled")
    capacity_bytes: int = Field(default=16 * GIB, ge=0)

    @model_validator(mode="after")
    def _path_when_enabled(self) -> DiskTierSettings:
        if self.enabled and self.path is None:
            raise ValueError("tiers.disk.path is required when the disk tier is enabled")
        return self


class S3TierSettings(TierSettings):
    """S3-compatible object storage. Unset credentials/region fall back to the usual AWS
    environment variables and config files (botocore's chain)."""

    enabled: bool = False
    capacity_bytes: int = Field(default=1024 * GIB, ge=0)
    endpoint_url: str | None = None
    bucket: str = "crescent-kv"
    prefix: str = "kv/"
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    create_bucket: bool = Field(default=False, description="create the bucket at start if it is missing")
    timeout_s: float = Field(default=5.0, gt=0, description="connect and read timeout of one S3 call")
    write_queue_blocks: int = Field(default=256, ge=1, description="pending uploads kept before dropping")
    write_concurrency: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _bucket_when_enabled(self) -> S3TierSettings:
        if self.enabled and not self.bucket:
            raise ValueError("tiers.s3.bucket is required when the S3 tier is enabled")
        return self


class GpuTierSettings(TierSettings):
    """Device memory; used only when CUDA is present (``enabled`` and no CUDA: skipped, logged)."""

    enabled: bool = False
    device: int = Field(default=0, ge=0)


class TiersSettings(StrictModel):
    gpu: GpuTierSettings = GpuTierSettings()
    host: HostTierSettings = HostTierSettings()
    disk: DiskTierSettings = DiskTierSettings()
    s3: S3TierSettings = S3TierSettings()


class EventSettings(StrictModel):
    flush_interval_s: float = Field(default=0.05, gt=0, description="how long events wait to be batched")
    max_batch: int = Field(default=1024, ge=1, description="send at once when this many events wait")
    max_pending: int = Field(default=65536, ge=1, description="beyond this, events are dropped and a snapshot follows")


class SideChannelSettings(StrictModel):
    """The TCP side channel: block payloads over a socket of their own, under gRPC control calls
    (services/kvwire/side_channel.py). Opened only by one-time tokens the reserve/get calls issue."""

    enabled: bool = Field(default=True, description="serve the tcp mover")
    host: str = Field(default="", description="address to listen on; empty: listen.host")
    port: int = Field(default=0, ge=0, le=65535, description="port; 0: any free one (set one where a firewall "
                                                              "or a Kubernetes Service must name it)")
    advertise_host: str = Field(default="", description="host clients dial; empty: the host of advertise_address, "
                                                        "else host (clients replace an unspecified one with the "
                                                        "host they dial for gRPC)")
    tls: bool = Field(default=True, description="with tls configured, run mutual TLS on the side channel too "
                                                "(the node's certificate); false: the token alone authenticates "
                                                "and payloads cross the network in the clear (trusted networks)")
    timeout_s: float = Field(default=30.0, gt=0, description="a transfer idle this long is abandoned")


class KvStoreSettings(StrictModel):
    listen: ListenSettings = ListenSettings()
    tls: TlsSettings = TlsSettings()  # mutual TLS for gRPC, served and dialled (docs/security.md)
    node_id: str = Field(default="kvstore-0", min_length=1)
    tiers: TiersSettings = TiersSettings()
    eviction_policy: str = Field(default="lru", description="lru or s3fifo")
    write_policy: Literal["write_back", "write_through"] = Field(
        default="write_back",
        description="write_back: a block reaches a lower tier when evicted; write_through: on every put",
    )
    spill_on_stop_s: float = Field(
        default=20.0, ge=0,
        description="at SIGTERM, copy blocks only the host tier holds down to the SSD tier for up to this long, "
                    "those kept longest first, so a restarted or replaced node (a rollout) starts with them; "
                    "0: no spill. Keep it under the pod's termination grace period",
    )
    scheduler_address: str | None = Field(
        default=None, description="host:port of the scheduler: the node registers, heartbeats and publishes block events; none: it does not"
    )
    advertise_address: str = Field(default="", description="host:port others dial; empty: listen host:port")
    events: EventSettings = EventSettings()
    peers: dict[str, str] = Field(
        default_factory=dict, description="other kvstore nodes, node_id -> host:port, asked on a local miss"
    )
    peer_timeout_s: float = Field(default=2.0, gt=0)
    default_lease_ms: int = Field(default=0, ge=0, description="lease of a get that does not ask for one")
    max_lease_ms: int = Field(default=600_000, ge=0)
    max_block_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    max_chunk_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    shared_memory: bool = Field(
        default=True, description="serve the same-host shared-memory RPCs and let local clients map the host pool"
    )
    transfer_lease_ms: int = Field(
        default=2000, ge=1, description="how long a block read from the host pool by a local client stays put"
    )
    side_channel: SideChannelSettings = SideChannelSettings()
    nixl: bool = Field(
        default=False, description="serve the nixl mover (one-sided writes into the host pool through NIXL; needs "
                                   "the nixl extra). Without NIXL here the node logs why and serves the other movers",
    )
    shm_reservation_ms: int = Field(
        default=30_000, ge=1, description="how long a local client has to fill reserved pool room and commit it"
    )
    layer_reservation_ms: int = Field(
        default=120_000, ge=1,
        description="how long room reserved for a layer-wise put (mover shm-layers) is held before it is given "
                    "back uncommitted: it is filled while prefill computes a chunk, which takes seconds on a CPU",
    )

    @model_validator(mode="after")
    def _known_policy(self) -> KvStoreSettings:
        from crescent.services.kvstore.eviction import policy_names

        if self.eviction_policy not in policy_names():
            raise ValueError(f"unknown eviction_policy {self.eviction_policy!r}; valid: {', '.join(policy_names())}")
        return self


def load_kvstore_settings(path: str | Path | None = None, **kwargs: object) -> KvStoreSettings:
    return load_settings(KvStoreSettings, path, env_prefix=ENV_PREFIX, **kwargs)  # type: ignore[arg-type]
