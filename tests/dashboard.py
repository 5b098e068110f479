"""The Grafana dashboard (deploy/grafana/dashboards/pagedserve.json) and its queries as Grafana sends
them with the dashboard's defaults. Used by the tests that check the dashboard's JSON
(tests/unit/test_dashboard.py) and those that run every query against a real Prometheus
(tests/e2e/test_observability.py, tests/stack/run_stack.py). Imports nothing outside the standard
library: run_stack.py runs beside the container engine, not under pytest."""
from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "dashboards", "pagedserve.json")
RATE_INTERVAL = "1m"          # what $__rate_interval stands for (>= 4 scrape intervals of 1 s)


def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression with Grafana's variables) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends for the dashboard's defaults: every model, the rate interval."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model_name", ".*")
