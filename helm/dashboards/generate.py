"""Writes Crescent's Grafana dashboards as JSON into the chart (helm/crescent/dashboards/).

    python helm/dashboards/generate.py          # regenerate the committed JSON
    python helm/dashboards/generate.py --check  # exit 1 if the committed JSON is stale

The dashboards are code (grafana-foundation-sdk); the chart ships the generated JSON as
ConfigMaps for the Grafana sidecar.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder

import cache
import overview
import pools

OUT_DIR = Path(__file__).resolve().parent.parent / "crescent" / "dashboards"
DASHBOARDS = {"overview": overview.build, "cache": cache.build, "pools": pools.build}


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    encoder = JSONEncoder(sort_keys=True, indent=2)
    rendered = {}
    for name, build in DASHBOARDS.items():
        dashboard = build().build()
        # Grafana links and edits panels by id; the builders leave rows at 0 and panels unset.
        for panel_id, panel in enumerate(dashboard.panels or [], start=1):
            panel.id_val = panel_id
        rendered[f"{name}.json"] = encoder.encode(dashboard) + "\n"
    return rendered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="directory of the JSON files")
    args = parser.parse_args()
    stale = []
    for name, text in render_all().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale dashboards (run python helm/dashboards/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
