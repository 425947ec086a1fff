"""Prometheus metrics of every Crescent service, in one place.

The names here are a contract: the Helm chart's recording rules, alerts and Grafana dashboards
query them. Each service process registers only the metrics it updates (the ``*_metrics()``
factories), so ``/metrics`` of a service shows what that service owns. Labels stay low in
cardinality: instance ids and tiers, never request ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from prometheus_client import Counter, Gauge, Histogram

# Buckets in seconds, from a cached short prompt (tens of ms) to a cold long one (tens of s).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120)
TOKEN_INTERVAL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GatewayMetrics:
    requests: Counter          # by status: ok, client_error, rejected, error, cancelled
    ttft: Histogram
    inter_token: Histogram     # every interval between streamed tokens
    tbt: Histogram             # Mooncake's TBT per request: mean of its longest 10% intervals
    e2e: Histogram
    prompt_tokens: Counter
    cached_tokens: Counter
    completion_tokens: Counter
    in_flight: Gauge
    header_timeouts: Counter   # connections closed because their request headers were too slow
    auth_throttled: Counter    # requests answered 429 because their source sent too many bad keys


@cache
def gateway_metrics() -> GatewayMetrics:
    return GatewayMetrics(
        requests=Counter("crescent_gateway_requests", "Chat completion requests by outcome", ["status"]),
        ttft=Histogram("crescent_gateway_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS),
        inter_token=Histogram(
            "crescent_gateway_inter_token_seconds", "Interval between streamed tokens", buckets=TOKEN_INTERVAL_BUCKETS
        ),
        tbt=Histogram(
            "crescent_gateway_tbt_seconds",
            "Time between tokens per request (mean of its longest 10% intervals)",
            buckets=TOKEN_INTERVAL_BUCKETS,
        ),
        e2e=Histogram("crescent_gateway_e2e_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS),
        prompt_tokens=Counter("crescent_gateway_prompt_tokens", "Prompt tokens received"),
        cached_tokens=Counter("crescent_gateway_cached_tokens", "Prompt tokens whose KV was reused"),
        completion_tokens=Counter("crescent_gateway_completion_tokens", "Tokens generated"),
        in_flight=Gauge("crescent_gateway_requests_in_flight", "Requests being served"),
        header_timeouts=Counter("crescent_gateway_header_timeouts",
                                "Connections closed with 408 because their request headers took too long"),
        auth_throttled=Counter("crescent_gateway_auth_throttled",
                               "Requests refused with 429 because their source sent too many invalid keys"),
    )


@dataclass(frozen=True)
class EndpointPickerMetrics:
    decisions: Counter         # by outcome: routed, or the refusal's reason
    in_flight: Gauge           # by gateway endpoint (pods, not requests: low cardinality)
    pick_seconds: Histogram    # from the whole body (or bodiless headers) to the answer


@cache
def endpoint_picker_metrics() -> EndpointPickerMetrics:
    return EndpointPickerMetrics(
        decisions=Counter("crescent_endpoint_picker_decisions", "Requests the Inference Extension picker decided, "
                          "by outcome (routed, or the refusal's reason)", ["outcome"]),
        in_flight=Gauge("crescent_endpoint_picker_in_flight", "Requests routed through the picker and still open, "
                        "by gateway endpoint", ["endpoint"]),
        pick_seconds=Histogram("crescent_endpoint_picker_pick_seconds", "Time to decide one request",
                               buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1)),
    )


@dataclass(frozen=True)
class SchedulerMetrics:
    placements: Counter        # by prefill and decode instance
    rejections: Counter        # by reason
    instances: Gauge           # by role
    indexed_blocks: Gauge
    decision_seconds: Histogram
    predicted_ttft: Histogram  # the scheduler's TTFT estimate for each placement
    observed_ttft: Histogram   # the TTFT the gateway measured for placed requests (ReportOutcome)
    ttft_error: Histogram      # |observed - predicted| per reported request
    prefix_pulls: Counter      # placements that load a longer prefix from another source


@cache
def scheduler_metrics() -> SchedulerMetrics:
    return SchedulerMetrics(
        placements=Counter("crescent_scheduler_placements", "Requests placed", ["prefill", "decode"]),
        rejections=Counter("crescent_scheduler_rejections", "Requests rejected early", ["reason"]),
        instances=Gauge("crescent_scheduler_instances", "Registered live instances", ["role"]),
        indexed_blocks=Gauge("crescent_scheduler_indexed_blocks", "Blocks in the global prefix index"),
        decision_seconds=Histogram(
            "crescent_scheduler_decision_seconds", "Time to place one request",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
        ),
        predicted_ttft=Histogram(
            "crescent_scheduler_predicted_ttft_seconds", "Predicted time to first token of placed requests",
            buckets=LATENCY_BUCKETS,
        ),
        observed_ttft=Histogram(
            "crescent_scheduler_observed_ttft_seconds", "Measured time to first token of placed requests",
            buckets=LATENCY_BUCKETS,
        ),
        ttft_error=Histogram(
            "crescent_scheduler_ttft_prediction_error_seconds", "Absolute error of the predicted time to first token",
            buckets=LATENCY_BUCKETS,
        ),
        prefix_pulls=Counter("crescent_scheduler_prefix_pulls", "Placements that pull a prefix from another source"),
    )


@dataclass(frozen=True)
class EngineMetrics:
    """Metrics of a prefill or decode instance; ``role`` is a constant label."""

    queue_depth: Gauge         # requests waiting
    running: Gauge             # requests in the running batch
    batch_size: Histogram      # sequences per forward step
    step_seconds: Histogram    # one forward step
    prompt_tokens: Counter     # prefill: prompt tokens seen
    cached_tokens: Counter     # prefill: of those, reused from a cache (by source: local, kvstore)
    computed_tokens: Counter   # prefill: of those, computed
    generated_tokens: Counter  # decode: tokens sampled
    kv_used_tokens: Gauge      # token slots held in the paged KV cache
    kv_capacity_tokens: Gauge
    transfer_bytes: Counter    # KV bytes moved, by direction: to_kvstore, from_kvstore, handoff_out, handoff_in,
    #                            handoff_hidden (of handoff_out, sent layer-wise before the last layer was computed)
    transfer_seconds: Histogram  # ... and handoff_exposed: last layer computed -> decode replied (prompt waits)
    requests: Counter          # finished requests by outcome: ok, aborted, error
    group_size: Gauge          # processes computing this instance (tensor parallel over a LeaderWorkerSet; 1: one)


def engine_metrics(role: str) -> EngineMetrics:
    """The engine's metrics; every series carries its role as a label (``.labels(role)``), so the
    roles of one process (an aggregated instance's prefill and decode) share them."""
    return _engine_metrics()


@cache
def _engine_metrics() -> EngineMetrics:
    labels = ["role"]

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, labels)

    return EngineMetrics(
        queue_depth=gauge("crescent_engine_queue_depth", "Requests waiting to run"),
        running=gauge("crescent_engine_running_requests", "Requests in the running batch"),
        batch_size=Histogram("crescent_engine_batch_size", "Sequences per forward step", labels, buckets=BATCH_BUCKETS),
        step_seconds=Histogram("crescent_engine_step_seconds", "Duration of one forward step", labels, buckets=LATENCY_BUCKETS),
        prompt_tokens=Counter("crescent_engine_prompt_tokens", "Prompt tokens received", labels),
        cached_tokens=Counter("crescent_engine_cached_tokens", "Prompt tokens reused from a cache", labels + ["source"]),
        computed_tokens=Counter("crescent_engine_computed_tokens", "Prompt tokens computed", labels),
        generated_tokens=Counter("crescent_engine_generated_tokens", "Tokens sampled", labels),
        kv_used_tokens=gauge("crescent_engine_kv_used_tokens", "Token slots in use in the paged KV cache"),
        kv_capacity_tokens=gauge("crescent_engine_kv_capacity_tokens", "Token slots in the paged KV cache"),
        transfer_bytes=Counter("crescent_engine_kv_transfer_bytes", "KV bytes moved", labels + ["direction"]),
        transfer_seconds=Histogram(
            "crescent_engine_kv_transfer_seconds", "Duration of one KV transfer", labels + ["direction"],
            buckets=LATENCY_BUCKETS,
        ),
        requests=Counter("crescent_engine_requests", "Requests finished by outcome", labels + ["outcome"]),
        group_size=gauge("crescent_engine_parallel_group_size",
                         "Processes (pods) computing this instance: its tensor-parallel group, 1 for one process"),
    )


# Hybrid (MoE) models expose expert load through a collector read at scrape time
# (services/engine/kimi_k3/metrics.py): tokens routed per expert, and per MoE layer the busiest
# expert's load over the mean.
MOE_EXPERT_TOKENS = "crescent_engine_moe_expert_tokens"  # counter, label expert
MOE_LOAD_IMBALANCE = "crescent_engine_moe_load_imbalance"  # gauge, label layer


@dataclass(frozen=True)
class KvStoreMetrics:
    blocks: Gauge              # by tier
    bytes: Gauge               # by tier
    capacity_bytes: Gauge      # by tier
    hits: Counter              # by tier
    misses: Counter
    evictions: Counter         # by tier
    promotions: Counter        # by tier (the tier a block moved up from)
    demotions: Counter         # by tier (the tier a block moved down from)
    transferred_bytes: Counter # by direction: in, out
    checksum_failures: Counter # by tier (gpu, host, disk, s3) the bad copy was dropped from; "put": refused on arrival
    s3_errors: Counter         # by operation
    dropped_writes: Counter    # by tier: writes given up (queue full, tier unreachable)
    leased_blocks: Gauge
    side_channel_refused: Counter  # side-channel connections closed for want of a valid token
    side_channel_connections: Counter  # side-channel connections accepted (a kept one carries many transfers)


@cache
def kvstore_metrics() -> KvStoreMetrics:
    tier = ["tier"]
    return KvStoreMetrics(
        blocks=Gauge("crescent_kvstore_blocks", "Blocks held", tier),
        bytes=Gauge("crescent_kvstore_bytes", "Bytes held", tier),
        capacity_bytes=Gauge("crescent_kvstore_capacity_bytes", "Tier capacity", tier),
        hits=Counter("crescent_kvstore_hits", "Block reads served", tier),
        misses=Counter("crescent_kvstore_misses", "Block reads not found in any tier"),
        evictions=Counter("crescent_kvstore_evictions", "Blocks evicted", tier),
        promotions=Counter("crescent_kvstore_promotions", "Blocks promoted to a faster tier", tier),
        demotions=Counter("crescent_kvstore_demotions", "Blocks demoted to a slower tier", tier),
        transferred_bytes=Counter("crescent_kvstore_transferred_bytes", "Payload bytes moved", ["direction"]),
        checksum_failures=Counter("crescent_kvstore_checksum_failures", "Blocks that failed verification", tier),
        s3_errors=Counter("crescent_kvstore_s3_errors", "S3 operations that failed", ["operation"]),
        dropped_writes=Counter("crescent_kvstore_dropped_writes", "Writes given up", tier),
        leased_blocks=Gauge("crescent_kvstore_leased_blocks", "Blocks pinned by a lease"),
        side_channel_refused=Counter("crescent_kvstore_side_channel_refused",
                                     "Side-channel connections refused (no valid one-time token)"),
        side_channel_connections=Counter("crescent_kvstore_side_channel_connections",
                                         "Side-channel connections accepted (clients keep them for later transfers)"),
    )


@dataclass(frozen=True)
class KvMoverMetrics:
    """A kvstore client's byte movers (services/kvstore/movers), per node it talks to (``peer``,
    the node's address: one per kvstore node, so few)."""

    selected: Gauge            # by peer, mover: 1 for the mover that last moved blocks with that node, else 0
    moved_bytes: Counter       # by peer, mover, direction (put, get): payload bytes moved


@cache
def kv_mover_metrics() -> KvMoverMetrics:
    return KvMoverMetrics(
        selected=Gauge("crescent_kv_mover_selected", "1 for the byte mover in use with a kvstore node",
                       ["peer", "mover"]),
        moved_bytes=Counter("crescent_kv_mover_bytes", "Payload bytes moved with a kvstore node, by mover",
                            ["peer", "mover", "direction"]),
    )


@dataclass(frozen=True)
class HandoffMetrics:
    """Prefill -> decode handoffs by byte mover (``shm``: shared memory on one host, ``tcp``:
    decode's handoff side channel, ``grpc``: the bytes on the Handoff stream), per decode instance (``peer``, its address: few)."""

    handoffs: Counter          # by peer, mover: handoffs decode accepted
    moved_bytes: Counter       # by peer, mover: their KV bytes
    shm_refused: Counter       # by peer: shared memory handoffs decode could not map (sent again as bytes)
    tcp_refused: Counter       # by peer: decode side channels found unusable (handoffs sent as bytes for a backoff)
    side_refused: Counter      # decode: side-channel connections refused or cut before a transfer


@cache
def handoff_metrics() -> HandoffMetrics:
    labels = ["peer", "mover"]
    return HandoffMetrics(
        handoffs=Counter("crescent_handoff", "Handoffs to decode by byte mover", labels),
        moved_bytes=Counter("crescent_handoff_bytes", "KV bytes handed to decode by byte mover", labels),
        shm_refused=Counter("crescent_handoff_shm_refused",
                            "Shared memory handoffs a decode instance could not map (then sent over gRPC)", ["peer"]),
        tcp_refused=Counter("crescent_handoff_tcp_refused",
                            "Decode handoff side channels found unusable (handoffs to it then go over gRPC)", ["peer"]),
        side_refused=Counter("crescent_handoff_side_channel_refused",
                             "Connections to this decode's handoff side channel refused or cut before a transfer "
                             "(no valid token within the deadline, or no free slot)"),
    )


@dataclass(frozen=True)
class UsageMetrics:
    """The gateway's usage ledger (docs/usage.md). ``tenant`` is a tenant id (bounded by the
    tenants table), ``model`` the served model name: one per gateway."""

    spend_usd: Counter         # by tenant, model: what requests cost at the price table's prices
    cache_savings_usd: Counter # by tenant, model: what cache hits saved against computing those tokens
    ledger_pending: Gauge      # rows finished but not yet committed to the database
    ledger_commit: Histogram   # time to commit one batch of rows
    ledger_wait: Histogram     # time a response waited for its row's commit (ledger.durable): the latency it adds
    ledger_errors: Counter     # batches that failed to commit (retried)
    refused: Counter           # by tenant, model, status: refused before using anything (no ledger row)


@cache
def usage_metrics() -> UsageMetrics:
    spender = ["tenant", "model"]
    return UsageMetrics(
        spend_usd=Counter("crescent_gateway_spend_usd", "Price of finished requests, US dollars", spender),
        cache_savings_usd=Counter(
            "crescent_gateway_cache_savings_usd", "Saved by prompt cache hits against cache-miss prices, US dollars",
            spender,
        ),
        ledger_pending=Gauge("crescent_gateway_ledger_pending_rows", "Usage rows waiting to be committed"),
        ledger_commit=Histogram(
            "crescent_gateway_ledger_commit_seconds", "Time to commit one batch of usage rows",
            buckets=(1e-4, 3e-4, 1e-3, 2e-3, 5e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3),
        ),
        ledger_wait=Histogram(
            "crescent_gateway_ledger_wait_seconds", "Time a response waited for its usage row to be committed",
            buckets=(1e-4, 3e-4, 1e-3, 2e-3, 5e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3),
        ),
        ledger_errors=Counter("crescent_gateway_ledger_errors", "Usage batches that failed to commit (retried)"),
        refused=Counter("crescent_gateway_refused_requests",
                        "Requests refused before they used a token (429s, 400s): counted here, not written to the "
                        "ledger", [*spender, "status"]),
    )
