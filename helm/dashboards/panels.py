"""Small builders shared by Crescent's dashboards (grafana-foundation-sdk).

Every query filters on the ``$namespace`` variable and uses ``$__rate_interval``; the metric
names are the contract in services/common/metrics.py (counters gain ``_total``, histograms
``_bucket``/``_sum``/``_count`` once scraped).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.models import dashboard as dm

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
NS = 'namespace="$namespace"'
RATE = "$__rate_interval"


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).datasource(DATASOURCE)


def quantile(q: float, metric: str, by: str = "") -> str:
    """The q-quantile of a histogram over the rate interval, optionally split by labels."""
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{NS}}}[{RATE}])))"


def series(title: str, unit: str, targets: list[tuple[str, str]], description: str = "", width: int = 12) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(8)
        .line_width(1)
        .fill_opacity(10)
    )
    for i, (expr, legend) in enumerate(targets):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + i)))
    return panel


def single(title: str, unit: str, expr: str, description: str = "", width: int = 6) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(4)
        .with_target(query(expr))
    )


def new_dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    """A dashboard with the datasource and namespace variables every Crescent panel uses."""
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["crescent", "generated"])
        .editable()
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            db.QueryVariable("namespace")
            .label("Namespace")
            .datasource(DATASOURCE)
            # A gauge every gateway exports from its start, so the list is filled before any traffic.
            .query("label_values(crescent_gateway_requests_in_flight, namespace)")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
        )
    )
