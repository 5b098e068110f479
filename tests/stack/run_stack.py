"""The compose stack, run for real: build, up, health, a chat completion, Prometheus, a data-plane
crash and its restart, down -v. Run by deploy/stack/test_stack.sh (`make test-stack`), which sets up
the container engine, the base images and the wheelhouse first.

Environment: COMPOSE (the compose binary), ENGINE (the engine's CLI, for a container's host PID:
podman), DOCKER_HOST, and the compose.yaml variables PAGEDSERVE_BASE_IMAGE, PAGEDSERVE_WHEELHOUSE,
PROMETHEUS_IMAGE. Each check that fails raises with what it saw and the services' logs.
Not named test_*.py: the pytest suite must not collect it (it takes minutes and needs root).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.dashboard import dashboard_queries, grafana_to_promql  # noqa: E402
from tests.servers import free_port  # noqa: E402

PROJECT = "pagedserve-stacktest"        # its own containers, network and volumes
SERVICES = ["curve-keys", "data-plane", "control-plane", "prometheus"]   # Grafana: no image here
LONG_RUNNING = SERVICES[1:]
JOBS = ("pagedserve-control-plane", "pagedserve-data-plane")
STARTUP_TIMEOUT = 600                   # first start: model load plus the C++ kernels' build
STARTED = time.monotonic() - float(os.environ.get("STACK_STARTED_S", "0") or 0)


def log(message: str) -> None:
    print(f"stack: [{time.monotonic() - STARTED:.0f}s] {message}", flush=True)


class Stack:
    def __init__(self):
        self.compose_bin = os.environ["COMPOSE"]
        self.engine = os.environ.get("ENGINE", "podman")
        self.cp_port, self.prom_port = free_port(), free_port()
        self.env = {**os.environ, "PAGEDSERVE_IMAGE": "localhost/pagedserve:stacktest",
                    "PAGEDSERVE_PORT": f"127.0.0.1:{self.cp_port}",
                    "PROMETHEUS_PORT": f"127.0.0.1:{self.prom_port}"}
        self.cp_url = f"http://127.0.0.1:{self.cp_port}"
        self.prom_url = f"http://127.0.0.1:{self.prom_port}"
        self.healthchecks = {}

    # --- compose ---
    def compose(self, *args: str, check: bool = True, capture: bool = True, timeout: float = 900):
        cmd = [self.compose_bin, "--project-name", PROJECT, "--project-directory", ROOT,
               "-f", os.path.join(ROOT, "compose.yaml"), "-f", os.path.join(ROOT, "compose.cpu.yaml"),
               "-f", os.path.join(ROOT, "tests", "stack", "compose.small.yaml"), *args]
        out = subprocess.run(cmd, cwd=ROOT, env=self.env, text=True, timeout=timeout,
                             stdout=subprocess.PIPE if capture else None,
                             stderr=subprocess.STDOUT if capture else None)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd[5:])} failed ({out.returncode}):\n{(out.stdout or '')[-4000:]}")
        return out.stdout or ""

    def config(self) -> dict:
        return json.loads(self.compose("config", "--format", "json"))

    def container(self, service: str) -> str:
        ids = self.compose("ps", "--all", "--quiet", service).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict:
        out = subprocess.run([self.engine, "inspect", self.container(service)], capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout)[0]

    def healthy(self, service: str) -> bool:
        """The service's own compose health check, run in its container: podman does not schedule
        health checks without systemd, so the test runs them."""
        test = self.healthchecks[service]
        assert test[0] == "CMD-SHELL", f"{service}: health check {test} is not CMD-SHELL"
        return subprocess.run([self.engine, "exec", self.container(service), "sh", "-c", test[1]],
                              capture_output=True, timeout=60).returncode == 0

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False)

    # --- HTTP ---
    def get_json(self, url: str, timeout: float = 10) -> dict:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)

    def post_json(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(self.cp_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read().decode()[:500]}

    def query(self, expr: str) -> list[dict]:
        body = self.get_json(self.prom_url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", body
        return body["data"]["result"]


def wait_for(what: str, condition, timeout: float, every: float = 5.0, stack: Stack | None = None):
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    while True:
        try:
            if condition():
                return
        except (OSError, AssertionError, subprocess.SubprocessError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                 + (stack.logs() if stack else ""))
        if time.monotonic() - last_report >= 30:
            log(f"still waiting for {what}")
            last_report = time.monotonic()
        time.sleep(every)


def chat(stack: Stack, content: str, max_tokens: int = 16) -> dict:
    status, body = stack.post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, f"chat completion: HTTP {status}: {body}"
    text = body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] > 0 and text.strip(), f"empty completion: {body}"
    return body


def check_prometheus(stack: Stack) -> tuple[int, int]:
    """Both scrape targets up, pagedserve_* series scraped, every dashboard query answered."""
    def both_up():
        targets = stack.get_json(stack.prom_url + "/api/v1/targets")["data"]["activeTargets"]
        return sorted(t["labels"]["job"] for t in targets if t["health"] == "up") == sorted(JOBS)
    wait_for("Prometheus to scrape both planes", both_up, 120, every=2, stack=stack)
    targets = stack.get_json(stack.prom_url + "/api/v1/targets")["data"]["activeTargets"]
    up = sum(t["health"] == "up" for t in targets)
    series = int(float(stack.query('count({__name__=~"pagedserve_.+"})')[0]["value"][1]))
    assert series > 100, f"only {series} pagedserve_* series"
    for job in JOBS:
        assert stack.query(f'count({{job="{job}", __name__=~"pagedserve_.+"}})'), f"no series from {job}"
    queries = dashboard_queries()
    empty = [f"{title}: {expr}" for title, expr in queries if not stack.query(grafana_to_promql(expr))]
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    log(f"prometheus: {up}/{len(targets)} targets up, {series} pagedserve_* series, "
        f"{len(queries)} dashboard queries answered")
    return up, len(targets)


def crash_and_restart(stack: Stack) -> int:
    """Kills the data plane's main process (a crash, not a `stop`: the restart policy applies) and
    checks that it comes back and serves every request sent after it came back."""
    before = stack.inspect("data-plane")
    pid = before["State"]["Pid"]
    assert pid > 0, before["State"]
    log(f"killing the data plane (host PID {pid}, restarts so far {before.get('RestartCount', 0)})")
    subprocess.run(["kill", "-9", str(pid)], check=True)

    def restarted():
        state = stack.inspect("data-plane")
        return state.get("RestartCount", 0) > before.get("RestartCount", 0) and state["State"]["Running"] \
            and state["State"]["Pid"] != pid
    wait_for("the restart policy to restart the data plane", restarted, 120, every=2, stack=stack)
    log("data plane restarted; waiting for it to serve")
    wait_for("the restarted data plane to be healthy", lambda: stack.healthy("data-plane"), STARTUP_TIMEOUT,
             every=10, stack=stack)
    wait_for("the control plane to be healthy again", lambda: stack.healthy("control-plane"), 300, stack=stack)
    prompts = [f"Count to {n}." for n in (3, 4, 5)]
    with ThreadPoolExecutor(len(prompts)) as pool:   # at once: they share the restarted engine
        answers = list(pool.map(lambda p: chat(stack, p, max_tokens=6), prompts))
    log(f"{len(answers)}/{len(prompts)} requests sent after the restart answered")
    return len(answers)


def main() -> int:
    stack = Stack()
    services = stack.config()["services"]
    stack.healthchecks = {name: services[name]["healthcheck"]["test"] for name in LONG_RUNNING}
    assert services["data-plane"]["restart"] == "unless-stopped"
    log(f"building the engine image {stack.env['PAGEDSERVE_IMAGE']} from the wheelhouse (offline)")
    stack.compose("build", "data-plane", capture=False, timeout=1800)
    try:
        stack.compose("down", "-v", "--remove-orphans", check=False)   # a previous run's leftovers
        log(f"compose up {' '.join(SERVICES)} (REST on {stack.cp_url}, Prometheus on {stack.prom_url})")
        stack.compose("up", "-d", "--no-build", *SERVICES, capture=False)
        for service in LONG_RUNNING:
            wait_for(f"{service} to be healthy", lambda s=service: stack.healthy(s), STARTUP_TIMEOUT,
                     every=10, stack=stack)
            log(f"{service} healthy")
        keys = stack.inspect("curve-keys")["State"]
        assert not keys["Running"] and keys["ExitCode"] == 0, f"curve-keys: {keys}"
        healthy = 1 + len(LONG_RUNNING)

        body = chat(stack, "What is the capital of France?")
        log(f"chat completion: {body['usage']['completion_tokens']} tokens: "
            f"{body['choices'][0]['message']['content'][:60]!r}")
        time.sleep(12)   # two scrape intervals (5 s) after the request: rate() sees it
        up, total = check_prometheus(stack)

        crash_and_restart(stack)
        print("stack: 6 passed, 0 failed", flush=True)
        print(f"stack: {healthy} services healthy, completion ok, prometheus {up}/{total} targets up, "
              f"data plane restarted and served", flush=True)
        return 0
    except Exception:
        print(stack.logs(), file=sys.stderr)
        raise
    finally:
        # every service's whole log, kept for a look after the containers are gone
        with open(os.path.join(ROOT, "build", "stack", "compose.log"), "w") as f:
            f.write(stack.compose("logs", "--no-color", "--timestamps", check=False))
        log("compose down -v (logs in build/stack/compose.log)")
        stack.compose("down", "-v", "--remove-orphans", check=False, capture=False)


if __name__ == "__main__":
    sys.exit(main())
