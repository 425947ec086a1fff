"""Settings of the scheduler service (the Conductor): YAML file plus ``CRESCENT_SCHEDULER__*`` env vars."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from crescent.services.common.settings import ListenSettings, StrictModel, load_settings
from crescent.services.common.tls import TlsSettings
from crescent.services.contract.mixed_steps import AGGREGATED_CHUNK_TOKENS
from crescent.services.contract.block_keys import DEFAULT_BLOCK_SIZE
from crescent.services.scheduler.policies import POLICIES

ENV_PREFIX = "CRESCENT_SCHEDULER"


class SloSettings(StrictModel):
    """Service-level objectives; a request predicted to break one is rejected early (HTTP 429)."""

    ttft_s: float = Field(default=60.0, gt=0, description="time to first token")
    tbt_s: float = Field(default=1.0, gt=0, description="time between tokens (mean of the longest 10%)")
    reject_early: bool = Field(default=True, description="false: place every request, however late")
    decode_wait_in_tbt: bool = Field(
        default=False,
        description="a request that must wait at decode (for KV or a batch slot) stalls after its first token: "
                    "true counts that stall in its predicted TBT (Mooncake's mean of the longest 10% of intervals); "
                    "false checks it against the TTFT SLO only",
    )


class PrefillCostSettings(StrictModel):
    """t = fixed_s + per_token_s * u + attention_s * (u*c + u*u/2), u new tokens after c cached ones."""

    # Defaults: the embedded SmolLM2-135M in fp32 on 2 CPU cores (2k tokens ≈ 6 s, 4k ≈ 14 s).
    fixed_s: float = Field(default=0.02, ge=0)
    per_token_s: float = Field(default=0.0028, ge=0)
    attention_s: float = Field(default=2.5e-7, ge=0)


class DecodeCostSettings(StrictModel):
    """Step time = fixed_s + per_sequence_s * batch + per_context_token_s * total context tokens."""

    # Defaults: the embedded model on 2 CPU cores (15 tok/s at batch 1, 65 tok/s at batch 8).
    fixed_s: float = Field(default=0.06, ge=0)
    per_sequence_s: float = Field(default=0.008, ge=0)
    per_context_token_s: float = Field(default=1e-6, ge=0)


class MixedStepCostSettings(StrictModel):
    """An aggregated engine's step: fixed_s + per_prompt_token_s * Σu + attention_s * Σ(u*c + u*u/2)
    + per_sequence_s * batch + per_context_token_s * total context (``crescent profile`` fits it)."""

    fixed_s: float = Field(ge=0)
    per_prompt_token_s: float = Field(ge=0)
    attention_s: float = Field(ge=0)
    per_sequence_s: float = Field(ge=0)
    per_context_token_s: float = Field(ge=0)


class TransferCostSettings(StrictModel):
    """Moving KV between nodes: bytes per token and bandwidth per source tier."""

    kv_bytes_per_token: int = Field(default=46_080, gt=0, description="default model, fp32")
    latency_s: float = Field(default=0.002, ge=0, description="per transfer")
    engine_gbps: float = Field(default=1.0, gt=0, description="GB/s from another engine's cache")
    gpu_gbps: float = Field(default=1.0, gt=0)
    host_gbps: float = Field(default=1.0, gt=0)
    disk_gbps: float = Field(default=0.5, gt=0)
    s3_gbps: float = Field(default=0.1, gt=0)


class CostSettings(StrictModel):
    """Cost models; preset "paper" uses Mooncake's LLaMA3-70B on 8xA800 setting instead."""

    preset: str = Field(default="custom", pattern="^(custom|paper)$")
    prefill: PrefillCostSettings = PrefillCostSettings()
    decode: DecodeCostSettings = DecodeCostSettings()
    transfer: TransferCostSettings = TransferCostSettings()
    prefill_beside_decode: PrefillCostSettings | None = Field(
        default=None,
        description="a prefill engine's prompts while a decode engine steps on the same cores (the simulator reads it)",
    )
    mixed: MixedStepCostSettings | None = Field(
        default=None,
        description="aggregated engines' mixed steps: the Conductor times an aggregated instance's prompts with it "
                    "(beside the sequences it decodes), and the simulator reads it",
    )


class PolicySettings(StrictModel):
    name: str = Field(default="kvcache_centric", description="random, round_robin, least_loaded, cache_aware, kvcache_centric")
    seed: int = Field(default=0, description="for the random policy")
    remote_prefix_threshold_blocks: int = Field(
        default=2, ge=0, description="pull a remote prefix only when it beats the local one by more blocks than this"
    )
    allow_remote_prefix: bool = Field(default=True, description="false: only an instance's own cache counts")

    @field_validator("name")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")
        return name


class IndexSettings(StrictModel):
    max_blocks: int = Field(default=4_000_000, gt=0, description="bounded memory: oldest entries are forgotten first")


class EndpointPickerTlsSettings(StrictModel):
    """How the proxy reaches the picker. TLS by default, as the upstream picker serves it: some
    Gateway API implementations cannot dial a plaintext ext_proc server."""

    plaintext: bool = Field(
        default=False, description="serve the picker without TLS (any address: it hands out routes, not prompts or KV; "
                                   "a warning is logged off loopback)",
    )
    cert: str = Field(default="", description="PEM certificate the picker serves; empty: the scheduler's tls.cert, "
                                              "or a self-signed one made at start-up when the scheduler has none")
    key: str = Field(default="", description="PEM private key of cert; empty: the scheduler's tls.key")
    # No "optional": grpcio's server credentials either require a client certificate or never ask for one.
    client_certificate: Literal["none", "required"] = Field(
        default="none",
        description="none: ask the proxy for no certificate (server-only TLS, what Gateway API proxies expect); "
                    "required: mutual TLS, only a certificate signed by client_ca that names the proxy role",
    )
    client_ca: str = Field(default="", description="PEM CA(s) a proxy's certificate must be signed by; empty: the scheduler's tls.ca")

    @model_validator(mode="after")
    def _consistent(self) -> EndpointPickerTlsSettings:
        if bool(self.cert) != bool(self.key):
            raise ValueError("endpoint_picker.tls.cert and endpoint_picker.tls.key go together; set both or neither")
        if self.plaintext and (self.cert or self.client_certificate != "none"):
            raise ValueError("endpoint_picker.tls.plaintext: true leaves no TLS to carry cert or client_certificate; "
                             "remove them or set plaintext: false")
        return self


class EndpointPickerSettings(StrictModel):
    """The Gateway API Inference Extension endpoint picker (ext_proc gRPC), docs/operators.md."""

    enabled: bool = Field(default=False, description="serve Envoy's ext_proc on port, for an InferencePool")
    port: int = Field(default=9002, ge=0, le=65535, description="the picker's gRPC port (9002: the extension's default)")
    gateways: str = Field(
        default="", description="host:port of the gateway pods the pool routes to (comma-separated for several); "
                                "a host may resolve to many pods (a headless Service), e.g. "
                                "crescent-gateway-pods.serving.svc:8000",
    )
    refresh_s: float = Field(default=2.0, gt=0, description="re-resolve the gateways' name after this long")
    tls: EndpointPickerTlsSettings = EndpointPickerTlsSettings()

    @model_validator(mode="after")
    def _gateways_given(self) -> EndpointPickerSettings:
        if self.enabled and not self.gateways:
            raise ValueError("endpoint_picker.gateways must name the gateway pods (host:port) when the picker is enabled")
        return self


class OutputLengthSettings(StrictModel):
    """How long decode requests are expected to run, learnt from the finished ones (docs/reliability.md,
    "How the decode KV wait is predicted")."""

    window: int = Field(default=256, ge=1, description="finished requests per model the estimate is taken over")
    min_samples: int = Field(default=8, ge=1, description="until this many finished, every request is expected to "
                                                            "run its whole max_tokens")
    quantile: float = Field(default=0.9, gt=0, lt=1, description="the share of requests expected to stop by the "
                                                                   "predicted length (higher: more cautious waits)")


class DiscoverySettings(StrictModel):
    """EndpointSlice discovery; off by default (instances register themselves either way)."""

    enabled: bool = False
    kubeconfig: str = Field(default="", description="kubeconfig file; empty: the pod's service account")
    namespace: str = Field(default="default", description="namespace of the engines' Services")
    prefill_service: str = Field(default="crescent-prefill", description="Service whose endpoints are prefill instances")
    decode_service: str = Field(default="crescent-decode", description="Service whose endpoints are decode instances")
    aggregated_service: str = Field(default="crescent-aggregated",
                                    description="Service whose endpoints are aggregated instances")
    port_name: str = Field(default="grpc", description="name of the gRPC port in the EndpointSlices")
    model_id: str = Field(default="", description="model assumed for a discovered instance until it registers")
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, gt=0, description="assumed until the instance registers")
    watch_timeout_s: float = Field(default=60.0, gt=0, description="re-list after this long without an event")
    retry_delay_s: float = Field(default=2.0, gt=0, description="wait after a failed list or watch")



class SchedulerSettings(StrictModel):
    listen: ListenSettings = ListenSettings()
    tls: TlsSettings = TlsSettings()  # mutual TLS for gRPC, served and dialled (docs/security.md)
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    heartbeat_timeout_s: float = Field(default=3.0, gt=0, description="drop an instance after this long without a heartbeat")
    policy: PolicySettings = PolicySettings()
    slo: SloSettings = SloSettings()
    cost: CostSettings = CostSettings()
    index: IndexSettings = IndexSettings()
    discovery: DiscoverySettings = DiscoverySettings()
    endpoint_picker: EndpointPickerSettings = EndpointPickerSettings()
    assumed_prompt_tokens: int = Field(
        default=512, gt=0, description="prompt size assumed for queued requests when an instance reports no token count"
    )
    no_instance_retry_after_s: float = Field(default=2.0, gt=0, description="Retry-After when a role has no instance")
    aggregated_chunk_tokens: int = Field(
        default=AGGREGATED_CHUNK_TOKENS, gt=0,
        description="prompt tokens an aggregated instance mixes into one step (its chunk_tokens): with cost.mixed, "
                    "how many steps a prompt takes there",
    )
    output_lengths: OutputLengthSettings = OutputLengthSettings()
    reservation_timeout_s: float = Field(
        default=120.0, gt=0,
        description="forget what a placement reserved on an instance if no load report covered it by then (lost reports)",
    )
    block_size: int = Field(
        default=0, ge=0, description="tokens per KV block every engine must use; 0: the first registered instance of a model sets it"
    )
    log_level: str = "INFO"

    @model_validator(mode="after")
    def _picker_client_ca(self) -> SchedulerSettings:
        picker = self.endpoint_picker.tls
        if self.endpoint_picker.enabled and picker.client_certificate != "none" and not (picker.client_ca or self.tls.ca):
            raise ValueError(f"endpoint_picker.tls.client_certificate: {picker.client_certificate} needs a CA to check "
                             "the proxy's certificate against: set endpoint_picker.tls.client_ca or tls.ca")
        return self

    @model_validator(mode="after")
    def _timeout_covers_interval(self) -> SchedulerSettings:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must be longer than heartbeat_interval_s")
        return self


def load_scheduler_settings(path: Path | None = None, **overrides: object) -> SchedulerSettings:
    return load_settings(SchedulerSettings, path, env_prefix=ENV_PREFIX, overrides=overrides or None)
