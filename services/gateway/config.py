"""Settings of the gateway: a YAML file plus ``CRESCENT_GATEWAY__*`` environment variables."""

from __future__ import annotations

from pathlib import Path

from crescent.services.common.settings import StrictModel, load_settings
from crescent.services.gateway.limits.settings import LimitSettings
from crescent.services.gateway.model_policy import ModelPolicy
from crescent.services.model.hf_config import DEFAULT_CONTEXT_WINDOW as HF_DEFAULT_CONTEXT_WINDOW
from crescent.services.tenancy.pricing import PriceTable
from pydantic import Field, SecretStr, model_validator

ENV_PREFIX = "CRESCENT_GATEWAY"
DEFAULT_GATEWAY_PORT = 8000
DEFAULT_CONTEXT_WINDOW = HF_DEFAULT_CONTEXT_WINDOW  # when the model does not say: the engine's default too


LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")


class GatewayListenSettings(StrictModel):
    """The gateway serves its API, /health and /metrics on one HTTP port (no separate admin port)."""

    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_GATEWAY_PORT, ge=1, le=65535)
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header names the gateway answers (\"*.example.com\" patterns; anything else gets 400); "
                    "empty: localhost, 127.0.0.1 and [::1] when bound to loopback (a web page cannot reach a "
                    "local gateway by DNS rebinding), any name when bound to another address",
    )
    header_timeout_s: float = Field(
        default=10.0, gt=0,
        description="a request's headers must arrive in full within this time, else 408 and the connection "
                    "closes (a client dribbling header bytes cannot hold a connection)",
    )
    forwarded_allow_ips: list[str] = Field(
        default_factory=lambda: ["127.0.0.1"],
        description="proxies whose X-Forwarded-For names the client (its address is what failed keys are "
                    "throttled by): an ingress controller's pod network, e.g. [\"10.0.0.0/8\"]; \"*\" trusts anyone",
    )


class AuthSettings(StrictModel):
    """API keys and tenants (docs/security.md). Off: every request is the ``default`` tenant's."""

    enabled: bool = Field(
        default=False,
        description="require Authorization: Bearer <key> on every /v1 endpoint; off (crescent up's default) "
                    "serves everyone as the one default tenant and logs that auth is off",
    )
    database_url: str = Field(
        default="sqlite:///~/.cache/crescent/gateway.sqlite3", min_length=1,
        description="tenants, keys and the cache-salt secret: a SQLite file, or postgresql://… shared by "
                    "several gateways (the schema is migrated at start-up)",
    )
    admin_key: SecretStr | None = Field(
        default=None,
        description="the key of the /admin API (tenants, keys); unset: the admin API answers 403",
    )
    cache_salt_secret: SecretStr | None = Field(
        default=None,
        description="secret the per-tenant prefix-cache salt is derived from; unset: one generated at "
                    "random in the database on first start (every gateway on that database uses it)",
    )
    allow_unauthenticated_network: bool = Field(
        default=False,
        description="with auth off, still serve on an address other than loopback (everyone who reaches "
                    "it is the default tenant, keyless): for a network you trust, said in so many words; "
                    "without it such a gateway refuses to start",
    )
    failed_auth_burst: int = Field(
        default=20, ge=0,
        description="invalid keys one source address may send before it is throttled (429 "
                    "too_many_failed_auth for keys not seen to work); 0: no throttle",
    )
    failed_auth_per_minute: float = Field(
        default=20.0, gt=0,
        description="how fast a throttled source earns tries back (invalid keys per minute)",
    )
    key_cache_s: float = Field(
        default=5.0, ge=0, le=60,
        description="how long a checked key's answer is reused in memory; a revoked key stops working "
                    "within this time",
    )


class LedgerSettings(StrictModel):
    """The usage ledger (docs/usage.md): one priced row per request in ``auth.database_url``."""

    enabled: bool = Field(
        default=True,
        description="write a row per request to the database (off: requests are still priced into the "
                    "spend metrics, /v1/usage answers 404)",
    )
    durable: bool = Field(
        default=True,
        description="hold each response's last bytes until its row is committed (group commit, about a "
                    "commit's time), so every response a client received whole is in the ledger even "
                    "after a kill -9; off: rows are written shortly after, and a crash loses the last ones",
    )
    commit_wait_s: float = Field(
        default=5.0, gt=0,
        description="how long a response waits for its row while the database does not answer; then it "
                    "is sent anyway and the row stays queued (retried) in memory",
    )
    batch_rows: int = Field(default=500, ge=1, le=10_000, description="most rows committed in one transaction")
    journal_dir: str | None = Field(
        default=None,
        description="a local directory for the write-ahead journal of a durable ledger: a response waits "
                    "for one file write instead of a commit, and a restarted gateway commits what the "
                    "journal holds (docs/usage.md); unset: responses wait for the commit",
    )


class GatewaySettings(StrictModel):
    listen: GatewayListenSettings = GatewayListenSettings()
    scheduler_address: str = Field(default="127.0.0.1:50051", min_length=1, description="host:port of the scheduler")
    model: str = Field(default="smollm2-135m-instruct", min_length=1, description="model spec: preset, .gguf or HF dir")
    served_model_name: str | None = Field(
        default=None, description="the name /v1/models lists and requests must use; default: the model id"
    )
    block_size: int | None = Field(
        default=None, gt=0,
        description="tokens per KV block; normally unset: the gateway learns it from the scheduler's instances "
                    "(a different value here is logged as an error and overridden)",
    )
    context_window: int | None = Field(
        default=None, gt=1, description="prompt + completion tokens; default: the model's max positions"
    )
    default_max_tokens: int = Field(default=1024, gt=0, description="when a request names no max_tokens")
    request_timeout_s: float = Field(default=600.0, gt=0, description="deadline of a whole request")
    place_timeout_s: float = Field(default=5.0, gt=0, description="deadline of one scheduler call")
    health_timeout_s: float = Field(default=1.0, gt=0, description="deadline of the scheduler check behind /health")
    migration_retries: int = Field(
        default=20, ge=0,
        description="placements tried again in a row after failures before a request fails (backoff 0.1 s "
                    "doubling to 2 s: 20 retries wait ~33 s, long enough for a supervisor to restart a lone instance)",
    )
    drain_grace_s: float = Field(
        default=100.0, ge=0,
        description="on SIGTERM, how long in-flight requests may finish (keep it below the pod's "
                    "terminationGracePeriodSeconds); then they end with an error event",
    )
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, gt=0,
        description="largest request body accepted; a larger one gets 413 before it is parsed",
    )
    max_constraint_bytes: int = Field(
        default=256 * 1024, gt=0,
        description="largest structured-output constraint (JSON schema, regex, grammar, forced tool call) "
                    "accepted; a larger one gets 400 constraint_too_large before it is compiled",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0,
        description="a request body must arrive in full within this time, else 408 and the connection closes",
    )
    cors_allow_origins: list[str] = Field(
        default_factory=list,
        description="origins browsers may call the API from (\"*\" for any); empty: CORS off",
    )
    responses_db: str = Field(
        default="~/.cache/crescent/responses.sqlite3", min_length=1,
        description="SQLite file of stored /v1/responses (store: true, previous_response_id); "
                    "\":memory:\": kept only while the gateway runs",
    )
    model_policy: ModelPolicy | None = Field(
        default=None,
        description="the served model's card: reasoning controls, sampling defaults and locked parameters "
                    "(docs/model-policy.md); default: the model family's (Kimi's for Kimi models, none otherwise)",
    )
    auth: AuthSettings = AuthSettings()
    prices: PriceTable = Field(
        default_factory=PriceTable,
        description="US dollars per million tokens by served model name (\"*\": the rest): cache_hit_input, "
                    "cache_miss_input, output; default: Kimi K3's 0.30, 3.00 and 15.00 for every model",
    )
    ledger: LedgerSettings = LedgerSettings()
    limits: LimitSettings = Field(default_factory=LimitSettings, description="rate limits and spend budgets "
                                  "per key and tenant (docs/limits.md)")
    log_level: str = Field(default="INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")

    @model_validator(mode="after")
    def _max_tokens_fit(self) -> GatewaySettings:
        if self.context_window is not None and self.default_max_tokens >= self.context_window:
            raise ValueError("default_max_tokens must be smaller than context_window")
        return self


def load_gateway_settings(path: str | Path | None = None) -> GatewaySettings:
    return load_settings(GatewaySettings, path, env_prefix=ENV_PREFIX)
