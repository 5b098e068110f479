"""A real Prometheus scrapes both planes while real requests run; then every query of the
Grafana dashboard returns data, and the scraped values agree with what the requests did.

The planes run as compose.yaml runs them, as two processes (`python -m data_plane --listen ...
--metrics-port ...` and `python -m control_plane.cli control-plane --data-plane ...`), with a KV
pool of 12 blocks so that 8 concurrent requests force preemptions. Prometheus uses
deploy/prometheus.yml with the targets moved to loopback and a 1 s scrape interval.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.dashboard import RATE_INTERVAL, dashboard_queries, grafana_to_promql
from tests.e2e.client import post_many
from tests.helpers import TEXT_PROMPTS
from tests.servers import ROOT, STARTUP_TIMEOUT, free_port, stop_process, wait_until_healthy

pytestmark = pytest.mark.slow

PROMETHEUS_CONFIG = os.path.join(ROOT, "deploy", "prometheus.yml")
NUM_REQUESTS = 8
MAX_TOKENS = 30


# --- processes ---------------------------------------------------------------------------------
class Proc:
    def __init__(self, name: str, cmd: list[str], tmp_dir: str):
        self.name = name
        self.log_path = os.path.join(tmp_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def wait_http(self, url: str, deadline: float) -> None:
        wait_until_healthy(self.proc, url, max(0.0, deadline - time.monotonic()), self.log, f"{self.name} at {url}")

    def stop(self) -> None:
        stop_process(self.proc, timeout=20)
        self._log.close()


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        message = "the prometheus binary is missing (apt-get install -y prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message + ": CI must install it (.ci/run)")
        pytest.skip(message)
    return path


def loopback_config(cp_port: int, dp_metrics_port: int) -> dict:
    """deploy/prometheus.yml, scraping every second, with the compose targets moved to loopback."""
    with open(PROMETHEUS_CONFIG) as f:
        config = yaml.safe_load(f)
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    moved = {"control-plane:8000": f"127.0.0.1:{cp_port}", "data-plane:8001": f"127.0.0.1:{dp_metrics_port}"}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [moved[t] for t in static["targets"]]
    return config


class Stack:
    def __init__(self, tmp_dir: str, model: str, prometheus: str):
        zmq_port, dp_metrics, cp_port, prom_port = (free_port() for _ in range(4))
        self.cp_url = f"http://127.0.0.1:{cp_port}"
        self.dp_metrics_url = f"http://127.0.0.1:{dp_metrics}/metrics"
        self.prom_url = f"http://127.0.0.1:{prom_port}"
        config_path = os.path.join(tmp_dir, "prometheus.yml")
        with open(config_path, "w") as f:
            yaml.safe_dump(loopback_config(cp_port, dp_metrics), f)
        address = f"tcp://127.0.0.1:{zmq_port}"
        self.procs = [
            Proc("data-plane", [sys.executable, "-m", "data_plane", "--listen", address, "--metrics-port",
                                str(dp_metrics), "--model", model, "--num-threads", "1",
                                "--kv-cache-blocks", "12", "--swap-space-gib", "0"], tmp_dir),
            Proc("control-plane", [sys.executable, "-m", "control_plane.cli", "control-plane", "--data-plane",
                                   address, "--port", str(cp_port), "--model", model,
                                   "--max-num-batched-tokens", "128", "--log-interval", "2"], tmp_dir),
            Proc("prometheus", [prometheus, f"--config.file={config_path}",
                                f"--storage.tsdb.path={os.path.join(tmp_dir, 'tsdb')}",
                                f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"], tmp_dir),
        ]

    def wait_ready(self) -> "Stack":
        deadline = time.monotonic() + STARTUP_TIMEOUT
        dp, cp, prom = self.procs
        prom.wait_http(self.prom_url + "/-/ready", deadline)
        cp.wait_http(self.cp_url + "/health", deadline)
        dp.wait_http(self.dp_metrics_url, deadline)
        # a first scrape of both planes before any request: rate() then sees the counters rise from 0
        while len(self.query("up == 1")) < 2:
            assert time.monotonic() < deadline, f"Prometheus does not scrape both planes: {self.query('up')}"
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs)

    # --- Prometheus HTTP API ---
    def query(self, expr: str) -> list[dict]:
        url = self.prom_url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:   # 400 for a query that does not parse
            raise AssertionError(f"{expr}: HTTP {exc.code}: {exc.read().decode()[:500]}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_path):
    prometheus = prometheus_binary()
    started = Stack(str(tmp_path_factory.mktemp("observability")), smollm_path, prometheus)
    try:
        yield started.wait_ready()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def workload(stack):
    """8 concurrent greedy requests of 30 tokens over a 12-block pool; returns their responses once
    Prometheus has scraped the final counts."""
    bodies = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True} for p in TEXT_PROMPTS]
    assert len(bodies) == NUM_REQUESTS
    results = post_many(stack.cp_url, "/v1/completions", bodies)
    for status, data in results:
        assert status == 200, data
    completion = sum(d["usage"]["completion_tokens"] for _, d in results)
    deadline = time.monotonic() + 30
    while True:   # the scrape after the last request finished
        done = stack.query("sum(pagedserve_generation_tokens_total)")
        if done and float(done[0]["value"][1]) == completion:
            break
        assert time.monotonic() < deadline, f"Prometheus never saw {completion} generated tokens: {done}"
        time.sleep(0.5)
    time.sleep(2)  # a few more scrapes: every rate() window holds the burst and the idle state after it
    return [d for _, d in results]


# --- tests ----------------------------------------------------------------------------------------
def test_both_planes_are_scraped(stack, workload):
    for job in ("pagedserve-control-plane", "pagedserve-data-plane"):
        assert stack.value(f'up{{job="{job}"}}') == 1.0, stack.logs()


def test_every_dashboard_query_returns_data(stack, workload):
    queries = dashboard_queries()
    assert len(queries) >= 20
    empty = [f"{title}: {expr}" for title, expr in queries if not stack.query(grafana_to_promql(expr))]
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_counts_agree_with_the_requests(stack, workload):
    completion = sum(d["usage"]["completion_tokens"] for d in workload)
    prompt = sum(d["usage"]["prompt_tokens"] for d in workload)
    assert completion == NUM_REQUESTS * MAX_TOKENS   # ignore_eos: every request runs to max_tokens
    v = stack.value
    assert v("sum(pagedserve_generation_tokens_total)") == completion
    assert v("sum(pagedserve_prompt_tokens_total)") == prompt
    assert v("sum(pagedserve_requests_received_total)") == NUM_REQUESTS
    assert v(f"sum(rate(pagedserve_requests_received_total[{RATE_INTERVAL}]))") > 0   # rose from 0 in view
    assert v('sum(pagedserve_request_success_total{finished_reason="length"})') == NUM_REQUESTS
    assert v("sum(pagedserve_request_success_total)") == NUM_REQUESTS
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens"):
        assert v(f"sum(pagedserve_{histogram}_count)") == NUM_REQUESTS, histogram
    assert v("sum(pagedserve_inter_token_latency_seconds_count)") == completion - NUM_REQUESTS
    assert v("sum(pagedserve_request_generation_tokens_sum)") == completion
    assert v("sum(pagedserve_request_prompt_tokens_sum)") == prompt
    # 8 requests of ~40 tokens need 24 blocks of 16 and the pool has 12
    assert v('sum(pagedserve_num_preemptions_total{kind="recompute"})') > 0
    assert v('sum(pagedserve_num_preemptions_total{kind="swap"})') == 0     # no swap pool
    assert v("sum(pagedserve_kv_cache_usage_perc)") == 0                    # every block came back
    assert v("sum(pagedserve_num_requests_running) + sum(pagedserve_num_requests_waiting)") == 0


def test_data_plane_counts(stack, workload):
    completion = sum(d["usage"]["completion_tokens"] for d in workload)
    prompt = sum(d["usage"]["prompt_tokens"] for d in workload)
    v = stack.value
    # every prompt token and every output but the last is computed at least once; preemption
    # by recompute computes some again
    computed = v("sum(pagedserve_data_plane_step_tokens_sum)")
    assert computed >= prompt + completion - NUM_REQUESTS
    steps = v("sum(pagedserve_data_plane_step_duration_seconds_count)")
    assert steps >= MAX_TOKENS
    assert v("sum(pagedserve_data_plane_step_duration_seconds_count)") == \
        v("sum(pagedserve_step_duration_seconds_count)")    # one plan, one round trip
    assert v("sum(pagedserve_data_plane_step_errors_total)") == 0
    assert v("sum(pagedserve_data_plane_swap_bytes_total)") == 0
    info = stack.query("pagedserve_data_plane_kv_pool_info")
    assert len(info) == 1
    labels = info[0]["metric"]
    assert (labels["num_device_blocks"], labels["block_size"], labels["dtype"], labels["device"]) == \
        ("12", "16", "float32", "cpu")
    block_bytes = int(labels["block_bytes"])
    assert v('sum(pagedserve_data_plane_kv_pool_bytes{pool="device"})') == 12 * block_bytes


def test_both_planes_label_the_same_model(stack, workload):
    cp = {r["metric"]["model_name"] for r in stack.query("pagedserve_num_requests_running")}
    dp = {r["metric"]["model_name"] for r in stack.query("pagedserve_data_plane_kv_pool_info")}
    assert cp == dp and len(cp) == 1
