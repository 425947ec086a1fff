"""Overview: traffic, TTFT and TBT percentiles against the SLO, effective capacity, rejections."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from panels import NS, RATE, new_dashboard, quantile, series, single


def build() -> db.Dashboard:
    return (
        new_dashboard(
            "crescent-overview",
            "Crescent / Overview",
            "Requests, latency against the SLO and effective request capacity. SLO lines and the "
            "capacity estimate come from the chart's recording rules.",
        )
        .with_row(db.Row("Traffic"))
        .with_panel(
            single("Requests/s", "reqps", f"sum(rate(crescent_gateway_requests_total{{{NS}}}[{RATE}]))")
        )
        .with_panel(
            single("In flight", "short", f"sum(crescent_gateway_requests_in_flight{{{NS}}})")
        )
        .with_panel(
            single(
                "Effective request capacity",
                "percentunit",
                f"crescent:effective_requests:ratio_rate5m{{{NS}}}",
                "Share of requests served within both the TTFT and the TBT SLO (a lower bound: "
                "1 - TTFT misses - TBT misses, times the share not rejected or failed).",
            )
        )
        .with_panel(
            single(
                "Rejected",
                "percentunit",
                f"crescent:gateway_rejected:ratio_rate5m{{{NS}}}",
                "Share of requests the scheduler rejected early (HTTP 429) because an SLO would break.",
            )
        )
        .with_panel(
            series(
                "Requests by outcome",
                "reqps",
                [(f"sum by (status) (rate(crescent_gateway_requests_total{{{NS}}}[{RATE}]))", "{{status}}")],
            )
        )
        .with_panel(
            series(
                "Rejections by reason",
                "reqps",
                [(f"sum by (reason) (rate(crescent_scheduler_rejections_total{{{NS}}}[{RATE}]))", "{{reason}}")],
            )
        )
        .with_row(db.Row("Latency against the SLO"))
        .with_panel(
            series(
                "Time to first token",
                "s",
                [
                    (quantile(0.5, "crescent_gateway_ttft_seconds"), "p50"),
                    (quantile(0.9, "crescent_gateway_ttft_seconds"), "p90"),
                    (quantile(0.99, "crescent_gateway_ttft_seconds"), "p99"),
                    (f"crescent:slo:ttft_seconds{{{NS}}}", "SLO"),
                ],
            )
        )
        .with_panel(
            series(
                "Time between tokens (per request: mean of its longest 10% intervals)",
                "s",
                [
                    (quantile(0.5, "crescent_gateway_tbt_seconds"), "p50"),
                    (quantile(0.9, "crescent_gateway_tbt_seconds"), "p90"),
                    (quantile(0.99, "crescent_gateway_tbt_seconds"), "p99"),
                    (f"crescent:slo:tbt_seconds{{{NS}}}", "SLO"),
                ],
            )
        )
        .with_panel(
            series(
                "SLO misses",
                "percentunit",
                [
                    (f"crescent:ttft_slo_errors:ratio_rate5m{{{NS}}}", "TTFT over SLO"),
                    (f"crescent:tbt_slo_errors:ratio_rate5m{{{NS}}}", "TBT over SLO"),
                ],
                "Share of requests over each SLO; the burn-rate alerts fire on these ratios.",
            )
        )
        .with_panel(
            series(
                "End-to-end latency",
                "s",
                [
                    (quantile(0.5, "crescent_gateway_e2e_seconds"), "p50"),
                    (quantile(0.99, "crescent_gateway_e2e_seconds"), "p99"),
                ],
            )
        )
        .with_row(db.Row("Tokens"))
        .with_panel(
            series(
                "Tokens/s",
                "short",
                [
                    (f"sum(rate(crescent_gateway_prompt_tokens_total{{{NS}}}[{RATE}]))", "prompt"),
                    (f"sum(rate(crescent_gateway_cached_tokens_total{{{NS}}}[{RATE}]))", "prompt, cached"),
                    (f"sum(rate(crescent_gateway_completion_tokens_total{{{NS}}}[{RATE}]))", "completion"),
                ],
                width=24,
            )
        )
    )
