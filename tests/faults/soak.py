"""A fault soak (not part of CI): the cluster of tests/faults/cluster.py under steady greedy load,
with a fault every 30-60 s drawn from the list below by a seeded generator, each logged. At the
end: requests served (identical to the greedy reference), failed with a clear error, and wrong
(must be 0), and the RSS of every process that lived through the run, first against last.

    nice -n 19 python -m tests.faults.soak --seconds 600 --seed 1      # as root

Faults: a partition of one replica (then heal), SIGSTOP of one (then SIGCONT), SIGKILL of one
(restarted on its host after a while), 100 ms ± 20 ms and 5% loss on replica 0's link, and the
control plane killed (SIGTERM, then SIGKILL) and started again with the data planes running.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time

from shared import curve
from shared.config import default_model_path
from tests.faults.cluster import STEP_TIMEOUT, Cluster, Load, greedy_references, tally
from tests.faults.netbed import NetBed
from tests.helpers import save_tiny_model

FAULTS = ("partition", "sigstop", "sigkill", "slow_link", "control_plane_restart")
REPLICA_HOSTS = {0: "b", 1: "c"}


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        return None
    return None


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


class ControlPlaneLives:
    """What each control plane that ran reported before it was replaced: requests moved, and its RSS
    once warm against its RSS at its end."""

    def __init__(self):
        self.moved = 0.0
        self.rss: list[tuple[int, int | None, int | None]] = []   # (pid, first, last) in KiB
        self._first: tuple[int, int | None] | None = None

    def started(self, cluster: Cluster) -> None:
        self._first = (cluster.cp.pid, rss_kib(cluster.cp.pid))

    def ending(self, cluster: Cluster) -> None:
        self.moved += cluster.metric("pagedserve_requests_moved_total")
        pid, first = self._first
        self.rss.append((pid, first, rss_kib(pid)))


def inject(cluster: Cluster, fault: str, rng: random.Random, load: Load, lives: ControlPlaneLives) -> None:
    """One fault, held for a few step timeouts, then undone; returns once every replica is up."""
    hold = rng.uniform(2, 5) * STEP_TIMEOUT
    replica = rng.choice([0, 1])
    host = REPLICA_HOSTS[replica]
    if fault == "partition":
        say(f"fault: partition of replica {replica} (host {host}) for {hold:.0f}s")
        cluster.bed.partition(host)
        load.wait(hold)
        cluster.bed.heal(host)
    elif fault == "sigstop":
        say(f"fault: SIGSTOP of replica {replica} for {hold:.0f}s")
        cluster.signal(host, signal.SIGSTOP)
        load.wait(hold)
        cluster.signal(host, signal.SIGCONT)
    elif fault == "sigkill":
        say(f"fault: SIGKILL of replica {replica}, restarted on its host after {hold:.0f}s")
        cluster.signal(host, signal.SIGKILL)
        load.wait(hold)
        cluster.start_data_plane(host)
    elif fault == "slow_link":
        say(f"fault: 100 ms ± 20 ms and 5% loss on replica 0's link for {hold:.0f}s")
        cluster.slow_link(True, loss=0.05)
        load.wait(hold)
        cluster.slow_link(False)
    else:
        say("fault: control plane SIGTERM, SIGKILL 0.5 s later, started again")
        lives.ending(cluster)
        cluster.cp.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        cluster.cp.kill()
        cluster.cp.wait()
        cluster.start_control_plane()
    health = cluster.wait_health("ok")
    say(f"  healed: {health}")
    if fault == "control_plane_restart":
        load.wait(5.0)    # warm, as the first one was
        lives.started(cluster)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="pagedserve-soak-")
    say(f"soak: {args.seconds:.0f}s, seed {args.seed}, {args.workers} clients, step timeout {STEP_TIMEOUT:.0f}s; "
        f"logs in {tmp}")
    model = save_tiny_model(os.path.join(tmp, "model"), default_model_path())
    prompts, refs = greedy_references(model, 8, seed=args.seed)
    keys = os.path.join(tmp, "keys")
    curve.keygen(keys)
    with NetBed(["a", "b", "c", "d"]) as bed:
        cluster = Cluster(bed, model, keys, tmp)
        try:
            cluster.start_data_plane("b")
            cluster.start_data_plane("c")
            cluster.start_proxy()
            cluster.start_control_plane()
            cluster.wait_health("ok")
            with Load(cluster, prompts, args.workers) as load:
                load.wait(5.0)    # warm: the first RSS figures are taken once every process has served
                first = {name: (proc.pid, rss_kib(proc.pid)) for name, proc in
                         [("data plane b", cluster.dp["b"]), ("data plane c", cluster.dp["c"])]}
                lives = ControlPlaneLives()
                lives.started(cluster)
                ends = time.monotonic() + args.seconds
                faults = []
                while True:
                    wait = rng.uniform(30, 60)
                    if time.monotonic() + wait >= ends:
                        break
                    load.wait(wait)
                    fault = rng.choice(FAULTS)
                    faults.append(fault)
                    inject(cluster, fault, rng, load, lives)
                load.wait(max(0.0, ends - time.monotonic()))
                outcomes = load.stop()
            report = cluster.wait_pools_empty()
            last = {name: rss_kib(pid) for name, (pid, _) in first.items()}
            lives.ending(cluster)
            result = tally(outcomes, refs)
            say(f"faults injected: {len(faults)} ({', '.join(faults)})")
            say(f"requests: {len(outcomes)} sent, {result.served} served identical to the greedy reference, "
                f"{result.failed} failed with a clear error, {len(result.wrong)} wrong")
            reasons: dict[str, int] = {}
            for o in outcomes:
                if not (o.complete and o.error is None):
                    why = f"status {o.status} {(o.error or '')[:110]}" if o.status not in (None, 200) else \
                        (o.error or "?")[:60]
                    reasons[why] = reasons.get(why, 0) + 1
            for why, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
                say(f"  failed: {count} x {why}")
            say(f"moved requests: {lives.moved:.0f} (pagedserve_requests_moved_total, summed over the control "
                "planes that ran)")
            say(f"pools after the run: {report['device_blocks_used']} device and {report['cpu_blocks_used']} CPU "
                "blocks in use")
            for i, (pid, before, after) in enumerate(lives.rss, start=1):
                first[f"control plane {i}"] = (pid, before)
                last[f"control plane {i}"] = after
            for name, (pid, before) in first.items():
                after = last[name]
                if before is None or after is None:
                    say(f"RSS {name} (pid {pid}): replaced during the run (a fault restarted it)")
                else:
                    say(f"RSS {name} (pid {pid}): {before / 1024:.0f} MiB -> {after / 1024:.0f} MiB "
                        f"({100 * (after - before) / before:+.1f}%)")
            return 1 if result.wrong else 0
        finally:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
