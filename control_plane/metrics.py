"""Control-plane Prometheus metrics, served at GET /metrics on the REST port.

Names follow vLLM's set where it applies (``vllm:x`` becomes ``pagedserve_x``); every metric
carries a ``model_name`` label. Every labelled child is created at start, so that each series
is exported with a sample even while it reads 0 (a counter that appears only when first
incremented makes ``rate()`` return nothing, and a dashboard panel stays empty).

What the engine calls, and when:
  on_arrival(num_prompt_tokens)          a request (one sequence) entered the waiting queue
  on_step(seqs, seconds, load)           after each step's result came back (seqs: the sequences it
                                         scheduled; load: a SchedulerLoad, whose cumulative preemption,
                                         copy, window and prefix-cache counts it turns into increments)
  on_token(seq, first)                   per sampled token appended to a sequence
  on_finish(seq, reason)                 a sequence ended: stop | length | abort | error
  on_swap(num_blocks_out, num_blocks_in) blocks the scheduler ordered swapped out / in
  on_prefix_cache(queries, hits)         prompt tokens looked up in the prefix cache / found;
                                         on_step calls it itself with the growth of the block
                                         manager's cumulative `prefix_queries` / `prefix_hits`
                                         counters, so the engine need not (and must not also) call it
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# `_created` samples double the exposition and no dashboard uses them
disable_created_metrics()

FINISH_REASONS = ("stop", "length", "abort", "error")
PREEMPTION_KINDS = ("recompute", "swap")
SWAP_DIRECTIONS = ("out", "in")

# Bounds wide enough for a GPU (milliseconds) and for a 2-core CPU (tens of seconds).
REQUEST_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                           160.0, 320.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0,
                         10.0, 20.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineStats:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, m, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, m, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        # --- scheduler state (gauges, set after every step) ---
        self.running = gauge("pagedserve_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("pagedserve_num_requests_waiting", "Requests waiting to be scheduled")
        self.swapped = gauge("pagedserve_num_requests_swapped", "Requests preempted by swap, KV held in the CPU pool")
        self.kv_usage = gauge("pagedserve_kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1)")
        self.cpu_kv_usage = gauge("pagedserve_cpu_kv_cache_usage_perc",
                                  "Fraction of CPU swap-pool KV blocks in use (0-1; 0 without a swap pool)")
        self.state_slots = gauge("pagedserve_state_slots", "Slots of the state pool, one per running sequence "
                                 "of a model with state layers (LFM2's convolutions); 0: no state layers")
        self.state_slots_used = gauge("pagedserve_state_slots_used", "State-pool slots held by a sequence")
        # --- counters ---
        self.received = counter("pagedserve_requests_received_total",
                                "Requests (sequences) accepted into the waiting queue")
        self.prompt_tokens = counter("pagedserve_prompt_tokens_total", "Prompt tokens of accepted requests")
        self.generation_tokens = counter("pagedserve_generation_tokens_total", "Tokens generated (sampled)")
        self.prefix_queries = counter("pagedserve_prefix_cache_queries_total",
                                      "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("pagedserve_prefix_cache_hits_total",
                                   "Prompt tokens found in the prefix cache (their KV was reused)")
        preemptions = Counter("pagedserve_num_preemptions_total",
                              "Sequences preempted, by kind (recompute: blocks freed, prompt and outputs "
                              "recomputed later; swap: blocks moved to the CPU pool)", m + ["kind"], registry=r)
        self.preemptions = {k: preemptions.labels(model_name, k) for k in PREEMPTION_KINDS}
        swap_blocks = Counter("pagedserve_swap_blocks_total",
                              "KV blocks the scheduler ordered moved between pools, by direction "
                              "(out: device to CPU, in: CPU to device)", m + ["direction"], registry=r)
        self.swap_blocks = {d: swap_blocks.labels(model_name, d) for d in SWAP_DIRECTIONS}
        self.cow_copies = counter("pagedserve_kv_block_copies_total",
                                  "Copy-on-write copies of a shared KV block (a sample or beam wrote into it)")
        self.window_freed = counter("pagedserve_kv_blocks_freed_by_window_total",
                                    "KV blocks given back while their sequence ran, because they lay wholly "
                                    "outside every layer's sliding window (0 unless every layer has a window)")
        self.blocks_shared = gauge("pagedserve_kv_blocks_shared",
                                   "Device KV blocks referenced by more than one sequence")
        finished = Counter("pagedserve_request_success_total", "Finished requests, by finish reason",
                           m + ["finished_reason"], registry=r)
        self._finished_family = finished
        self.finished = {reason: finished.labels(model_name, reason) for reason in FINISH_REASONS}
        # --- histograms ---
        self.queue_time = histogram("pagedserve_request_queue_time_seconds",
                                    "Arrival to first scheduling of a request", REQUEST_LATENCY_BUCKETS)
        self.ttft = histogram("pagedserve_time_to_first_token_seconds", "Arrival to first generated token",
                              REQUEST_LATENCY_BUCKETS)
        self.itl = histogram("pagedserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("pagedserve_e2e_request_latency_seconds", "Arrival to finish of a request",
                             REQUEST_LATENCY_BUCKETS)
        self.prompt_len = histogram("pagedserve_request_prompt_tokens", "Prompt length of finished requests",
                                    TOKEN_COUNT_BUCKETS)
        self.output_len = histogram("pagedserve_request_generation_tokens",
                                    "Generated tokens of finished requests", TOKEN_COUNT_BUCKETS)
        self.step_time = histogram("pagedserve_step_duration_seconds",
                                   "Round trip of one step plan to the data plane and back", TOKEN_LATENCY_BUCKETS)
        self._generated_since_log = 0
        self.num_generated = 0       # tokens generated since start (the page's tokens/s: /debug/kv/blocks)
        self._last_token_time: dict[int, float] = {}
        self._prefix_seen = (0, 0)   # the block manager's cumulative (queries, hits) at the last step
        self._copies_seen = 0        # the block manager's cumulative copy-on-write count at the last step
        self._window_freed_seen = 0  # the block manager's cumulative window-freed count at the last step
        self._preemptions_seen = dict.fromkeys(PREEMPTION_KINDS, 0)   # the scheduler's, at the last step
        # sequences already scheduled once: their queue time is counted; dropped when they end
        self._scheduled: set[int] = set()

    # --- called by the engine -------------------------------------------------------------
    def on_new_block_manager(self) -> None:
        """A data-plane restart replaced the block manager: its cumulative counts start from zero
        again. (Deltas against the old ones would undercount, and a negative hit delta failed the step.)"""
        self._prefix_seen = (0, 0)
        self._copies_seen = 0
        self._window_freed_seen = 0

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self.received.inc()
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_step(self, seqs, seconds: float, load) -> None:
        """`seqs`: the sequences the step scheduled; `seconds`: the round trip that just ended; `load`:
        the scheduler's SchedulerLoad after it."""
        now = time.monotonic()
        self.step_time.observe(seconds)
        step_started = now - seconds
        for seq in seqs:
            if seq.seq_id not in self._scheduled:
                self._scheduled.add(seq.seq_id)
                if seq.num_output_tokens == 0:   # not a sample or beam forked from a running sequence
                    self.queue_time.observe(max(0.0, step_started - seq.arrival_time))
        for kind, total in (("recompute", load.num_preemptions), ("swap", load.num_swap_preemptions)):
            if total > self._preemptions_seen[kind]:
                self.preemptions[kind].inc(total - self._preemptions_seen[kind])
                self._preemptions_seen[kind] = total
        self.refresh_gauges(load)
        copies = load.num_cow_copies
        if copies > self._copies_seen:
            self.cow_copies.inc(copies - self._copies_seen)
            self._copies_seen = copies
        if load.num_window_freed > self._window_freed_seen:
            self.window_freed.inc(load.num_window_freed - self._window_freed_seen)
            self._window_freed_seen = load.num_window_freed
        self.blocks_shared.set(load.num_shared_blocks)
        queries, hits = load.prefix_queries, load.prefix_hits
        if queries > self._prefix_seen[0]:
            self.on_prefix_cache(queries - self._prefix_seen[0], hits - self._prefix_seen[1])
            self._prefix_seen = (queries, hits)

    def refresh_gauges(self, load) -> None:
        """Queue sizes and pool usage now (`load`: a SchedulerLoad): after every step, and at every
        scrape (requests finish and free their blocks between steps)."""
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.swapped.set(load.swapped)
        self.kv_usage.set(load.kv_usage)
        self.cpu_kv_usage.set(load.cpu_kv_usage)
        self.state_slots.set(load.state_slots)
        self.state_slots_used.set(load.state_slots_used)

    def on_token(self, seq, first: bool) -> None:
        now = time.monotonic()
        if first:
            self.ttft.observe(now - seq.arrival_time)
        elif seq.seq_id in self._last_token_time:
            self.itl.observe(now - self._last_token_time[seq.seq_id])
        self._last_token_time[seq.seq_id] = now
        self.generation_tokens.inc()
        self._generated_since_log += 1
        self.num_generated += 1

    def on_seq_end(self, seq) -> None:
        """A sequence left the batch (its request may go on: parallel samples, beams)."""
        self._last_token_time.pop(seq.seq_id, None)
        self._scheduled.discard(seq.seq_id)

    def on_generated(self, num_tokens: int) -> None:
        """Tokens handed out at the end rather than one by one (beam search)."""
        self.generation_tokens.inc(num_tokens)
        self._generated_since_log += num_tokens
        self.num_generated += num_tokens

    def on_finish(self, seq, reason: str, num_output_tokens: int | None = None) -> None:
        """A request ended; `seq` is its first sequence, `num_output_tokens` what it returned."""
        self._last_token_time.pop(seq.seq_id, None)
        self._scheduled.discard(seq.seq_id)
        if reason not in self.finished:  # a reason added later still gets counted
            self.finished[reason] = self._finished_family.labels(self.model_name, reason)
        self.finished[reason].inc()
        self.e2e.observe(time.monotonic() - seq.arrival_time)
        self.prompt_len.observe(seq.num_prompt_tokens)
        self.output_len.observe(seq.num_output_tokens if num_output_tokens is None else num_output_tokens)

    def on_swap(self, num_blocks_out: int, num_blocks_in: int) -> None:
        self.swap_blocks["out"].inc(num_blocks_out)
        self.swap_blocks["in"].inc(num_blocks_in)

    def on_prefix_cache(self, queries: int, hits: int) -> None:
        """`queries` prompt tokens looked up, of which `hits` were served from cached blocks."""
        assert 0 <= hits <= queries, f"{hits} prefix-cache hits for {queries} queried tokens"
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)

    def take_generated(self) -> int:
        n, self._generated_since_log = self._generated_since_log, 0
        return n
