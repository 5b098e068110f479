"""Data-plane Prometheus metrics, served on their own port (--metrics-port; 0: off).

Everything is measured in the worker around `ModelRunner.execute` and read from the plan and
its result, so the runner itself stays free of metrics code:

  step time          the whole plan: swap and copy orders, forward pass, sampling
  forward time       forward pass and sampling (StepResult.forward_seconds)
  tokens, sequences  per step, as histograms (their _sum over time is a throughput)
  swap               bytes and blocks per direction from the plan's swap pairs; time per direction
                     from StepResult.swap_seconds (the pre-forward phase, which also holds the
                     block copies), shared between directions in proportion to the blocks moved
  copies             blocks copied for copy-on-write
  pool               sizes as an Info metric and bytes as a gauge

Names are ``pagedserve_data_plane_*`` with a ``model_name`` label; every labelled child
exists from the start, so each series is exported (at 0) before anything happens.
"""
from __future__ import annotations

import ipaddress
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics

from shared.config import kv_block_bytes, model_name_of
from shared.protocol import Handshake, StepPlan, StepResult

log = logging.getLogger("pagedserve.data_plane")
disable_created_metrics()

SWAP_DIRECTIONS = ("out", "in")   # out: device to CPU, in: CPU to device

# From a GPU decode step (a millisecond) to a long CPU prefill (tens of seconds).
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0,
                        10.0, 20.0, 40.0)
SWAP_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                        1.0, 2.5, 5.0)
STEP_TOKENS_BUCKETS = tuple(2 ** i for i in range(15))      # 1 .. 16384
STEP_SEQS_BUCKETS = tuple(2 ** i for i in range(11))        # 1 .. 1024


class DataPlaneStats:
    def __init__(self, hs: Handshake, model_name: str | None = None):
        self.registry = CollectorRegistry()
        self.model_name = model_name or model_name_of(hs.model_id)
        self.block_bytes = kv_block_bytes(hs.num_layers, hs.block_size, hs.num_kv_heads, hs.head_dim, hs.dtype)
        r, m, name = self.registry, ["model_name"], self.model_name

        def histogram(metric, doc, buckets):
            return Histogram(metric, doc, m, buckets=buckets, registry=r).labels(name)

        self.step_time = histogram("pagedserve_data_plane_step_duration_seconds",
                                   "Execution of one step plan: swaps, copies, forward pass and sampling",
                                   STEP_SECONDS_BUCKETS)
        self.forward_time = histogram("pagedserve_data_plane_forward_duration_seconds",
                                      "Forward pass and sampling of one step", STEP_SECONDS_BUCKETS)
        self.step_tokens = histogram("pagedserve_data_plane_step_tokens",
                                     "Tokens computed in one forward pass (prefill chunks plus decodes)",
                                     STEP_TOKENS_BUCKETS)
        self.step_seqs = histogram("pagedserve_data_plane_step_sequences", "Sequences in one forward pass",
                                   STEP_SEQS_BUCKETS)
        self.step_errors = Counter("pagedserve_data_plane_step_errors_total",
                                   "Step plans refused or failed (nothing sampled)", m, registry=r).labels(name)
        swap_bytes = Counter("pagedserve_data_plane_swap_bytes_total",
                             "KV bytes moved between the device and the CPU pool, by direction "
                             "(out: device to CPU, in: CPU to device)", m + ["direction"], registry=r)
        swap_blocks = Counter("pagedserve_data_plane_swap_blocks_total",
                              "KV blocks moved between the device and the CPU pool, by direction",
                              m + ["direction"], registry=r)
        swap_time = Histogram("pagedserve_data_plane_swap_duration_seconds",
                              "Time of the swap orders of one step, by direction (includes the step's block "
                              "copies, shared by blocks moved)", m + ["direction"], buckets=SWAP_SECONDS_BUCKETS,
                              registry=r)
        self.swap_bytes = {d: swap_bytes.labels(name, d) for d in SWAP_DIRECTIONS}
        self.swap_blocks = {d: swap_blocks.labels(name, d) for d in SWAP_DIRECTIONS}
        self.swap_time = {d: swap_time.labels(name, d) for d in SWAP_DIRECTIONS}
        self.blocks_copied = Counter("pagedserve_data_plane_blocks_copied_total",
                                     "Device KV blocks copied (copy-on-write)", m, registry=r).labels(name)
        pool_bytes = Gauge("pagedserve_data_plane_kv_pool_bytes", "Bytes allocated for KV blocks, by pool",
                           m + ["pool"], registry=r)
        pool_bytes.labels(name, "device").set(hs.num_device_blocks * self.block_bytes)
        pool_bytes.labels(name, "cpu").set(hs.num_cpu_blocks * self.block_bytes)
        Info("pagedserve_data_plane_kv_pool", "KV pool layout, fixed at start", m, registry=r).labels(name).info({
            "device": hs.device, "dtype": hs.dtype, "block_size": str(hs.block_size),
            "num_device_blocks": str(hs.num_device_blocks), "num_cpu_blocks": str(hs.num_cpu_blocks),
            "num_layers": str(hs.num_layers), "num_kv_heads": str(hs.num_kv_heads), "head_dim": str(hs.head_dim),
            "block_bytes": str(self.block_bytes), "max_model_len": str(hs.max_model_len)})

    def on_step(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        """After one plan was executed (or refused); `seconds`: wall time of the execution."""
        self.step_time.observe(seconds)
        if result.error:
            self.step_errors.inc()
            return
        num_seqs = len(plan.new_seqs) + len(plan.cached_seqs)
        if num_seqs:
            self.forward_time.observe(result.forward_seconds)
            self.step_tokens.observe(result.num_tokens)
            self.step_seqs.observe(num_seqs)
        moved = {"out": len(plan.swap_out), "in": len(plan.swap_in)}
        total_moved = moved["out"] + moved["in"]
        for direction, num_blocks in moved.items():
            if num_blocks:
                self.swap_blocks[direction].inc(num_blocks)
                self.swap_bytes[direction].inc(num_blocks * self.block_bytes)
                self.swap_time[direction].observe(result.swap_seconds * num_blocks / total_moved)
        if plan.copies:
            self.blocks_copied.inc(len(plan.copies))


def metrics_host(listen: str) -> str:
    """The address for the metrics server: the interface the ZeroMQ socket binds, so that a data
    plane listening on loopback exposes metrics on loopback only, and one on all interfaces
    (tcp://0.0.0.0 or tcp://*, as in a container) on all of them."""
    if not listen.startswith("tcp://"):
        return "127.0.0.1"                 # ipc:// or inproc://: a local peer
    host = listen[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in ("*", ""):
        return "0.0.0.0"
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return "0.0.0.0"                   # an interface name (tcp://eth0:5555)


def start_metrics_server(stats: DataPlaneStats, port: int, host: str) -> bool:
    """Serves /metrics from a daemon thread. A port already taken is logged, not fatal: serving
    requests matters more than exporting metrics about them."""
    if not port:
        return False
    from prometheus_client import start_http_server
    try:
        start_http_server(port, addr=host, registry=stats.registry)
    except OSError as exc:
        log.error("metrics server NOT started on %s:%d (%s); pass another --metrics-port, or 0 to turn "
                  "it off", host, port, exc)
        return False
    log.info("metrics on http://%s:%d/metrics", host, port)
    return True
