"""Where a streamed token's time goes when one request is alone on the server: the client's time per token
beside the data plane's own step (from its Prometheus metrics), and each thread's CPU time per token.

    python bench/stream_cost.py                          # float32 and bfloat16, 400 tokens, three streams each
    python bench/stream_cost.py --dtypes float32 --tokens 100 --repeats 1

One server per dtype (`pagedserve serve`, the defaults but the dtype), a streamed greedy completion of
exactly --tokens tokens (EOS ignored), --repeats times. Printed per dtype:
  token      the client's decode time per token, (end - first event) / (tokens - 1), mean of the streams;
  step       the data plane's time in step plans (pagedserve_data_plane_step_duration_seconds), and within
             it the forward pass and sampling (..._forward_duration_seconds), over the same streams, per
             token (each stream's prompt step included, whose time the client's figure leaves out:
             it weighs more the fewer --tokens, and can make `between` negative on short streams);
  between    token - step: what a token waits outside the data plane's step (its reply and the next plan's
             receipt, the ZeroMQ link, the control plane, the HTTP stream);
  per thread CPU milliseconds per token (utime + stime from /proc) and context switches per token, of
             the control plane's and the data plane's threads that ran. On a machine with two cores the
             data plane's two compute threads take both; what another thread runs is taken from them.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the storm that changed her life."
STEP_METRICS = ("pagedserve_data_plane_step_duration_seconds", "pagedserve_data_plane_forward_duration_seconds")


def threads_of(pid: int) -> dict[tuple[int, int], tuple[str, float, int, int]]:
    """(pid, tid) -> (thread name, CPU seconds, voluntary and involuntary context switches) of `pid`'s threads."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # after the name, which may hold spaces
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/status") as f:
                status = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except OSError:   # the thread ended meanwhile
            continue
        cpu = (int(fields[11]) + int(fields[12])) / ticks   # utime, stime: fields 14 and 15 of stat
        out[(pid, int(tid))] = ("main" if int(tid) == pid else name, cpu, int(status["voluntary_ctxt_switches"]),
                                int(status["nonvoluntary_ctxt_switches"]))
    return out


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:   # the spawned data plane
        return [int(child) for child in f.read().split()]


def step_metrics(port: int) -> dict[str, tuple[float, float]]:
    """name -> (sum, count) of the data plane's step histograms."""
    import urllib.request

    from tests.e2e.client import metric_value
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    if not all(f"{name}_count" in text for name in STEP_METRICS):
        raise RuntimeError(f"the data plane's /metrics lacks one of {', '.join(STEP_METRICS)}")
    return {name: (metric_value(text, f"{name}_sum"), metric_value(text, f"{name}_count")) for name in STEP_METRICS}


async def streams(url: str, model: str, tokens: int, repeats: int) -> list[float]:
    """Seconds per token after the first, of each stream."""
    import aiohttp
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with aiohttp.ClientSession() as session:
        per_token = []
        for _ in range(repeats):
            first, end = await C.stream_timing(session, f"{url}/v1/completions", body)
            per_token.append((end - first) / (tokens - 1))
    return per_token


def measure(dtype: str, tokens: int, repeats: int, num_threads: int) -> None:
    metrics_port = C.free_port()
    server = C.start_server(num_threads, ["--dtype", dtype, "--data-plane-metrics-port", str(metrics_port)])
    try:
        server.wait_ready()
        model = C.get_json(f"{server.url}/v1/models")["data"][0]["id"]
        data_planes = children_of(server.proc.pid)
        roles = {server.proc.pid: "control plane", **{pid: "data plane" for pid in data_planes}}

        def snapshot():
            threads = {}
            for pid in roles:
                threads.update(threads_of(pid))
            return threads
        asyncio.run(streams(server.url, model, 4, 1))   # the prompt's first one-time costs, not counted
        before_threads, before_steps = snapshot(), step_metrics(metrics_port)
        per_token = asyncio.run(streams(server.url, model, tokens, repeats))
        after_threads, after_steps = snapshot(), step_metrics(metrics_port)
    finally:
        server.stop()
    counted = tokens * repeats
    (step_sum, steps), (forward_sum, _) = (
        (after_steps[n][0] - before_steps[n][0], after_steps[n][1] - before_steps[n][1]) for n in STEP_METRICS)
    token_ms = 1e3 * C.mean(per_token)
    step_ms, forward_ms = 1e3 * step_sum / counted, 1e3 * forward_sum / counted
    print(f"\n{dtype}: {repeats} stream(s) of {tokens} tokens alone on the server")
    print(f"  token {token_ms:.2f} ms (streams: {', '.join(f'{1e3 * t:.2f}' for t in per_token)}); "
          f"{steps:.0f} steps for {counted} tokens")
    print(f"  steps {step_ms:.2f} ms a token, of which the forward pass and sampling {forward_ms:.2f}; "
          f"between steps {token_ms - step_ms:.2f} ms")
    print(f"  {'thread':<34} {'CPU ms/token':>12} {'voluntary':>10} {'involuntary':>12}  (switches per token)")
    rows = []
    for key, (name, cpu, vol, invol) in after_threads.items():
        _, cpu0, vol0, invol0 = before_threads.get(key, (name, 0.0, 0, 0))
        if cpu - cpu0 > 0 or vol - vol0 > 0:
            rows.append((roles[key[0]], name, 1e3 * (cpu - cpu0) / counted, (vol - vol0) / counted,
                         (invol - invol0) / counted))
    for role, name, cpu, vol, invol in sorted(rows, key=lambda r: -r[2]):
        print(f"  {role + ': ' + name:<34} {cpu:>12.3f} {vol:>10.2f} {invol:>12.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1:
        ap.error("--tokens must be at least 2 and --repeats at least 1")
    print(C.machine_line(args.num_threads))
    started = time.perf_counter()
    for dtype in args.dtypes.split(","):
        measure(dtype, args.tokens, args.repeats, args.num_threads)
    print(f"\nbenchmark wall time: {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
