"""Cache: prefix-cache hit ratio, what cache hits save per tenant, kvstore tier usage, KV transfers,
evictions and errors."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from panels import NS, RATE, new_dashboard, series, single


def build() -> db.Dashboard:
    return (
        new_dashboard(
            "crescent-cache",
            "Crescent / KV cache",
            "How much prompt KV is reused, where blocks live, and what moves between tiers and nodes.",
        )
        .with_row(db.Row("Prefix cache"))
        .with_panel(
            single(
                "Prefix-cache hit ratio",
                "percentunit",
                f"sum(rate(crescent_gateway_cached_tokens_total{{{NS}}}[{RATE}]))"
                f" / sum(rate(crescent_gateway_prompt_tokens_total{{{NS}}}[{RATE}]))",
                "Share of prompt tokens whose KV was reused instead of computed.",
            )
        )
        .with_panel(
            single("Blocks in the prefix index", "short", f"sum(crescent_scheduler_indexed_blocks{{{NS}}})")
        )
        .with_panel(
            single(
                "kvstore read misses/s",
                "short",
                f"sum(rate(crescent_kvstore_misses_total{{{NS}}}[{RATE}]))",
            )
        )
        .with_panel(
            single(
                "S3 errors/s",
                "short",
                f"sum(rate(crescent_kvstore_s3_errors_total{{{NS}}}[{RATE}])) or vector(0)",
            )
        )
        .with_panel(
            series(
                "Hit ratio over time",
                "percentunit",
                [
                    (f"crescent:prefix_cache_hit:ratio_rate15m{{{NS}}}", "last 15m"),
                    (f"crescent:prefix_cache_hit:ratio_rate6h{{{NS}}}", "last 6h"),
                ],
                "The hit-ratio-drop alert compares these two.",
            )
        )
        .with_panel(
            series(
                "Prompt tokens by source",
                "short",
                [
                    (f"sum by (source) (rate(crescent_engine_cached_tokens_total{{{NS}}}[{RATE}]))", "cached: {{source}}"),
                    (f"sum(rate(crescent_engine_computed_tokens_total{{{NS}}}[{RATE}]))", "computed"),
                ],
            )
        )
        .with_row(db.Row("kvstore tiers"))
        .with_panel(
            series(
                "Tier usage",
                "percentunit",
                [
                    (
                        f"sum by (tier) (crescent_kvstore_bytes{{{NS}}})"
                        f" / sum by (tier) (crescent_kvstore_capacity_bytes{{{NS}}})",
                        "{{tier}}",
                    )
                ],
            )
        )
        .with_panel(
            series(
                "Bytes held by tier",
                "bytes",
                [(f"sum by (tier) (crescent_kvstore_bytes{{{NS}}})", "{{tier}}")],
            )
        )
        .with_panel(
            series(
                "Reads served by tier",
                "short",
                [
                    (f"sum by (tier) (rate(crescent_kvstore_hits_total{{{NS}}}[{RATE}]))", "hit: {{tier}}"),
                    (f"sum(rate(crescent_kvstore_misses_total{{{NS}}}[{RATE}]))", "miss"),
                ],
            )
        )
        .with_panel(
            series(
                "Evictions, promotions and demotions",
                "short",
                [
                    (f"sum by (tier) (rate(crescent_kvstore_evictions_total{{{NS}}}[{RATE}]))", "evicted from {{tier}}"),
                    (f"sum by (tier) (rate(crescent_kvstore_promotions_total{{{NS}}}[{RATE}]))", "promoted from {{tier}}"),
                    (f"sum by (tier) (rate(crescent_kvstore_demotions_total{{{NS}}}[{RATE}]))", "demoted from {{tier}}"),
                ],
            )
        )
        .with_row(db.Row("Transfers"))
        .with_panel(
            series(
                "Engine KV transfers",
                "Bps",
                [(f"sum by (direction) (rate(crescent_engine_kv_transfer_bytes_total{{{NS}}}[{RATE}]))", "{{direction}}")],
            )
        )
        .with_panel(
            series(
                "kvstore traffic",
                "Bps",
                [(f"sum by (direction) (rate(crescent_kvstore_transferred_bytes_total{{{NS}}}[{RATE}]))", "{{direction}}")],
            )
        )
        .with_panel(
            series(
                "Failures",
                "short",
                [
                    (f"sum by (operation) (rate(crescent_kvstore_s3_errors_total{{{NS}}}[{RATE}]))", "S3 {{operation}}"),
                    (f"sum by (tier) (rate(crescent_kvstore_checksum_failures_total{{{NS}}}[{RATE}]))", "checksum {{tier}}"),
                    (f"sum by (tier) (rate(crescent_kvstore_dropped_writes_total{{{NS}}}[{RATE}]))", "dropped writes {{tier}}"),
                ],
                width=24,
            )
        )
        .with_row(db.Row("Spend"))
        .with_panel(
            series(
                "Spend and cache savings per tenant",
                "currencyUSD",
                [
                    (f"sum by (tenant) (rate(crescent_gateway_spend_usd_total{{{NS}}}[{RATE}])) * 3600",
                     "spend/h: {{tenant}}"),
                    (f"sum by (tenant) (rate(crescent_gateway_cache_savings_usd_total{{{NS}}}[{RATE}])) * 3600",
                     "saved/h: {{tenant}}"),
                ],
                "US dollars per hour at the gateway's price table (settings.prices): what requests cost, and "
                "what their cache hits saved against the cache-miss input price. Tenants are ids "
                "(crescent keys tenants names them); the usage ledger (GET /admin/usage) has the exact sums.",
                width=18,
            )
        )
        .with_panel(
            single(
                "Saved by cache hits",
                "percentunit",
                f"sum(rate(crescent_gateway_cache_savings_usd_total{{{NS}}}[{RATE}]))"
                f" / (sum(rate(crescent_gateway_spend_usd_total{{{NS}}}[{RATE}]))"
                f" + sum(rate(crescent_gateway_cache_savings_usd_total{{{NS}}}[{RATE}])))",
                "Share of what requests would have cost had every prompt token been computed.",
            )
        )
    )
