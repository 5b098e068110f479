"""Where a trace's time goes, step by step: the real scheduler and the data plane's runner in one
process (no HTTP, no ZeroMQ), on the throughput bench's traces, with the server's defaults.

    python bench/step_mix.py                       # exp64, 64 requests
    python bench/step_mix.py --workload sharegpt --num-requests 64
    python bench/step_mix.py --model DIR --dtype bfloat16   # another model (bench/random_model.py writes one)

Prints the time of the steps grouped by kind (steps that prefill, decode-only steps by batch size):
which part of the trace a change to the forward pass can win back.

    python bench/step_mix.py --dtype bfloat16 --contend 1,10   # beside a process busy 1 ms in every 10

--contend runs a second process that takes the CPU in short bursts, as the served case's control plane and
HTTP client do beside the data plane's threads: what such bursts cost the steps (a thread held up at a
parallel call's join holds up the other too).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402
from throughput import VOCAB_SIZE, exp64_trace  # noqa: E402

BUCKETS = [(1, 1), (2, 4), (5, 16), (17, 32), (33, 64), (65, 1 << 30)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="exp64", choices=["exp64", *sorted(C.WORKLOADS)])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", metavar="DIR", help="a model folder (or GGUF file) instead of the default model")
    ap.add_argument("--contend", metavar="BUSY,PERIOD", help="a process busy BUSY ms in every PERIOD ms beside the run")
    args = ap.parse_args(argv)
    contend = parse_contend(args.contend) if args.contend else None   # (a bad one stops the run before the load)

    from control_plane.block_manager import BlockManager
    from control_plane.sampling_params import SamplingParams
    from control_plane.scheduler import Finish, Scheduler
    from control_plane.sequence import Sequence
    from shared.config import ControlPlaneConfig
    trace = exp64_trace(args.num_requests, args.seed) if args.workload == "exp64" else \
        C.make_trace(args.num_requests, args.seed, VOCAB_SIZE, args.workload, (C.PROMPT_RANGE[0], 256),
                     (C.OUTPUT_RANGE[0], 512))
    print(C.machine_line(args.num_threads))
    print(f"trace: {args.workload}, {C.describe_trace(trace)}, {args.dtype}")
    runner = C.default_runner(args.num_threads, "inproc://mix", args.dtype, path=args.model and os.path.abspath(args.model))
    cp = ControlPlaneConfig   # the class attributes are the defaults
    sched = Scheduler(BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=True),
                      cp.max_num_seqs, cp.max_num_batched_tokens)
    seqs = []
    for i, req in enumerate(trace):
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        seqs.append(Sequence(f"r{i}", list(req.prompt_ids), len(req.prompt_ids), params, params.spec([]),
                             arrival_time=float(i)))
        sched.add(seqs[-1])
    by_id = {s.seq_id: s for s in seqs}
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])   # steps, seconds, tokens
    rival = start_rival(*contend) if contend else None
    print(f"running {len(seqs)} requests", flush=True)   # (a profiler attached from here sees the steps alone)
    step, started = 0, time.perf_counter()
    try:
        while sched.has_work():
            t0 = time.perf_counter()
            plan = sched.schedule()
            step += 1
            result = runner.execute(plan)
            sched.update(plan, result)
            ended = []
            for tok in result.sampled:
                seq = by_id[tok.seq_id]
                seq.token_ids.append(tok.token_id)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    ended.append(Finish(seq, "length"))
            sched.apply(ended)
            took = time.perf_counter() - t0
            rows = len(plan.new_seqs) + len(plan.cached_seqs)
            if rows == 0:
                key = "steps with nothing to run"
            elif result.num_tokens > rows:
                key = "steps with prefill tokens"
            else:
                lo, hi = next(b for b in BUCKETS if b[0] <= rows <= b[1])
                key = f"decode-only, {lo}-{hi} seqs" if lo != hi else f"decode-only, {lo} seq"
            g = groups[key]
            g[0] += 1
            g[1] += took
            g[2] += len(result.sampled)
    finally:   # (the rival never outlives the run)
        if rival is not None:
            rival.kill()
    wall = time.perf_counter() - started
    if contend:
        print(f"beside a process busy {contend[0] * 1e3:g} ms in every {contend[1] * 1e3:g} ms")
    produced = sum(r.output_len for r in trace)
    print(f"\n{step} steps, {wall:.1f} s, {produced / wall:.1f} output tok/s (in-process, no HTTP)")
    print(f"{'steps':<30} {'count':>6} {'seconds':>8} {'share':>6} {'ms/step':>8} {'tokens out':>10}")
    for key in sorted(groups, key=lambda k: -groups[k][1]):
        n, secs, toks = groups[key]
        print(f"{key:<30} {n:>6} {secs:>8.2f} {100 * secs / wall:>5.1f}% {1e3 * secs / n:>8.1f} {toks:>10}")
    return 0


def parse_contend(spec: str) -> tuple[float, float]:
    """--contend's BUSY,PERIOD (milliseconds) as seconds."""
    try:
        busy, period = (float(v) / 1e3 for v in spec.split(","))
    except ValueError:
        raise SystemExit(f"--contend {spec!r}: BUSY,PERIOD in milliseconds, such as 1,10") from None
    if not 0 < busy < period:
        raise SystemExit(f"--contend {spec!r}: 0 < BUSY < PERIOD (milliseconds)")
    return busy, period


def start_rival(busy: float, period: float) -> subprocess.Popen:
    """A process that spins for `busy` seconds, then sleeps out the rest of each `period`."""
    code = ("import time\n"
            "while True:\n"
            f"    t = time.perf_counter()\n    while time.perf_counter() - t < {busy}: pass\n"
            f"    time.sleep({period - busy})\n")
    return subprocess.Popen([sys.executable, "-c", code])


if __name__ == "__main__":
    sys.exit(main())
