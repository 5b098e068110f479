"""Control-plane Prometheus metrics (names pagedserve_*, labelled by model) and progress counters."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0)


class EngineStats:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        self.running = Gauge("pagedserve_num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("pagedserve_num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("pagedserve_kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1)",
                              labels, registry=r)
        self.preemptions = Counter("pagedserve_num_preemptions_total", "Preemptions", labels + ["kind"], registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens_total", "Prompt tokens received", labels, registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens_total", "Tokens generated", labels, registry=r)
        self.finished = Counter("pagedserve_request_success_total", "Finished requests by reason",
                                labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagedserve_inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("pagedserve_step_duration_seconds", "Round trip of one step to the data plane",
                                   labels, buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self._generated_since_log = 0
        self._last_token_time: dict[int, float] = {}

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def on_step(self, out, result, seconds: float, scheduler) -> None:
        m = self.model_name
        self.step_time.labels(m).observe(seconds)
        if out.preempted:
            self.preemptions.labels(m, "recompute").inc(len(out.preempted))
        self.running.labels(m).set(len(scheduler.running))
        self.waiting.labels(m).set(len(scheduler.waiting))
        self.kv_usage.labels(m).set(scheduler.bm.usage())

    def on_token(self, seq, first: bool) -> None:
        now = time.monotonic()
        m = self.model_name
        if first:
            self.ttft.labels(m).observe(now - seq.arrival_time)
        elif seq.seq_id in self._last_token_time:
            self.itl.labels(m).observe(now - self._last_token_time[seq.seq_id])
        self._last_token_time[seq.seq_id] = now
        self.generation_tokens.labels(m).inc()
        self._generated_since_log += 1

    def on_finish(self, seq, reason: str) -> None:
        self._last_token_time.pop(seq.seq_id, None)
        self.finished.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(time.monotonic() - seq.arrival_time)

    def take_generated(self) -> int:
        n, self._generated_since_log = self._generated_since_log, 0
        return n
