"""Pools: per-instance queue depth, batch size, KV saturation and throughput of prefill and decode."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from panels import NS, RATE, new_dashboard, quantile, series, single


def build() -> db.Dashboard:
    return (
        new_dashboard(
            "crescent-pools",
            "Crescent / Pools",
            "Load and saturation of every prefill and decode instance; what the autoscalers act on.",
        )
        .with_row(db.Row("Instances"))
        .with_panel(
            single("Prefill instances", "short", f'sum(crescent_scheduler_instances{{{NS},role="prefill"}})')
        )
        .with_panel(
            single("Decode instances", "short", f'sum(crescent_scheduler_instances{{{NS},role="decode"}})')
        )
        .with_panel(  # prefill and decode in one process (aggregated groups, off by default)
            single("Aggregated instances", "short", f'sum(crescent_scheduler_instances{{{NS},role="aggregated"}})')
        )
        .with_panel(
            single(
                "Placement decision p99",
                "s",
                quantile(0.99, "crescent_scheduler_decision_seconds"),
            )
        )
        .with_panel(
            single("Queued requests", "short", f"sum(crescent_engine_queue_depth{{{NS}}})")
        )
        .with_row(db.Row("Load per instance"))
        .with_panel(
            series(
                "Queue depth",
                "short",
                [(f"sum by (role, instance) (crescent_engine_queue_depth{{{NS}}})", "{{role}} {{instance}}")],
                "Requests waiting; the prefill autoscaler keeps its per-pod average at the target.",
            )
        )
        .with_panel(
            series(
                "Running requests",
                "short",
                [(f"sum by (role, instance) (crescent_engine_running_requests{{{NS}}})", "{{role}} {{instance}}")],
                "Requests in the running batch; the decode autoscaler keeps its per-pod average at the target.",
            )
        )
        .with_panel(
            series(
                "KV cache saturation",
                "percentunit",
                [
                    (
                        f"sum by (role, instance) (crescent_engine_kv_used_tokens{{{NS}}})"
                        f" / sum by (role, instance) (crescent_engine_kv_capacity_tokens{{{NS}}})",
                        "{{role}} {{instance}}",
                    )
                ],
            )
        )
        .with_panel(
            series(
                "Placements per instance",
                "reqps",
                [
                    (f"sum by (prefill) (rate(crescent_scheduler_placements_total{{{NS}}}[{RATE}]))", "prefill {{prefill}}"),
                    (f"sum by (decode) (rate(crescent_scheduler_placements_total{{{NS}}}[{RATE}]))", "decode {{decode}}"),
                ],
            )
        )
        .with_row(db.Row("Batches and steps"))
        .with_panel(
            series(
                "Batch size",
                "short",
                [
                    (quantile(0.5, "crescent_engine_batch_size", "role"), "p50 {{role}}"),
                    (quantile(0.99, "crescent_engine_batch_size", "role"), "p99 {{role}}"),
                ],
            )
        )
        .with_panel(
            series(
                "Forward step time",
                "s",
                [
                    (quantile(0.5, "crescent_engine_step_seconds", "role"), "p50 {{role}}"),
                    (quantile(0.99, "crescent_engine_step_seconds", "role"), "p99 {{role}}"),
                ],
            )
        )
        .with_panel(
            series(
                "Throughput per instance",
                "short",
                [
                    (f"sum by (instance) (rate(crescent_engine_prompt_tokens_total{{{NS}}}[{RATE}]))", "prompt {{instance}}"),
                    (f"sum by (instance) (rate(crescent_engine_generated_tokens_total{{{NS}}}[{RATE}]))", "generated {{instance}}"),
                ],
                "Tokens per second each instance prefills or generates.",
            )
        )
        .with_panel(
            series(
                "Finished requests by outcome",
                "reqps",
                [(f"sum by (role, outcome) (rate(crescent_engine_requests_total{{{NS}}}[{RATE}]))", "{{role}} {{outcome}}")],
            )
        )
    )
