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
    engine: EngineSettings = EngineSettings()
