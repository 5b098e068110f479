"""Faults between machines, on the test bed (tests/faults/cluster.py): a control plane on host a
with two replica data planes on hosts b and c over tcp:// with CURVE, under a steady load of
streamed and non-streamed greedy requests, each answer checked against transformers' greedy
output. The tests run in order on one cluster; each leaves every replica up.

What holds after each replica fault: every request gets a 200 with the reference's tokens (a
stream resumed after a move repeats none), the gone replica's requests were moved, /health said
"degraded" while it was gone, and every pool drains to 0 blocks in use. When the control plane
itself dies, requests in flight may fail (a 503 or a cut connection), never with a wrong token.
"""
import signal
import subprocess
import time

import pytest

from tests.faults.cluster import STEP_TIMEOUT, Load, running_cluster, tally

pytestmark = pytest.mark.faults


def start_replicas(cluster):
    cluster.start_data_plane("b")
    cluster.start_data_plane("c")
    cluster.start_proxy()
    cluster.start_control_plane()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("faults"), start_replicas) as c:
        yield c


def run_load(cluster, references, during, workers: int = 4):
    """Runs the load, calls during(load) while it runs, stops it; returns the tally."""
    prompts, refs = references
    with Load(cluster, prompts, workers) as load:
        load.wait(1.0)
        during(load)
        outcomes = load.stop()
    result = tally(outcomes, refs)
    assert not result.wrong, result.wrong[:3]
    return result


def moved(cluster) -> float:
    return cluster.metric("pagedserve_requests_moved_total")


def served_by(cluster) -> list[float]:
    return [cluster.metric("pagedserve_request_success_total", replica=str(r)) for r in (0, 1)]


def test_undisturbed_load_is_served_by_both_replicas(cluster, references):
    before = served_by(cluster)
    result = run_load(cluster, references, lambda load: load.wait(2.0))
    assert result.failed == 0 and result.served > 0
    after = served_by(cluster)
    assert all(a > b for a, b in zip(after, before)), (before, after)
    assert cluster.metric("pagedserve_replicas_up") == 2
    cluster.wait_pools_empty()


def fault_moves_and_heals(cluster, references, replica: int, inflict, undo) -> None:
    """Under load: inflict() the fault on `replica`, until /health says it is down, and a step timeout
    more; then undo() it, until /health says every replica is up. Its requests moved, none failed."""
    before = moved(cluster)

    def during(load):
        inflict()
        try:
            cluster.wait_health("degraded", down=[replica])
            load.wait(STEP_TIMEOUT)
        finally:
            undo()
        cluster.wait_health("ok")
        load.wait(1.0)
    result = run_load(cluster, references, during)
    assert result.failed == 0 and result.served > 0
    assert moved(cluster) > before
    cluster.wait_pools_empty()


def test_a_partitioned_replica_loses_its_requests_to_the_other_and_rejoins_after_heal(cluster, references):
    fault_moves_and_heals(cluster, references, 1, lambda: cluster.bed.partition("c"), lambda: cluster.bed.heal("c"))
    assert "replica 1 is down" in cluster.cp_log() and "replica 1 is up" in cluster.cp_log()


def test_a_stopped_replica_loses_its_requests_and_rejoins_after_sigcont(cluster, references):
    fault_moves_and_heals(cluster, references, 0, lambda: cluster.signal("b", signal.SIGSTOP),
                          lambda: cluster.signal("b", signal.SIGCONT))


def test_a_killed_replica_loses_its_requests_and_the_other_serves_alone(cluster, references):
    before = moved(cluster)

    def kill(load):
        cluster.signal("c", signal.SIGKILL)
        cluster.wait_health("degraded", down=[1])
        load.wait(2 * STEP_TIMEOUT)
    result = run_load(cluster, references, kill)
    assert result.failed == 0 and result.served > 0
    assert moved(cluster) > before
    assert cluster.metric("pagedserve_replicas_up") == 1
    cluster.wait_pools_empty()


def test_a_killed_replica_restarted_on_its_host_rejoins(cluster, references):
    cluster.start_data_plane("c")
    cluster.wait_health("ok")
    before = served_by(cluster)
    result = run_load(cluster, references, lambda load: load.wait(2.0))
    assert result.failed == 0
    after = served_by(cluster)
    assert after[1] > before[1], (before, after)     # the new data plane serves
    cluster.wait_pools_empty()


def test_a_slow_lossy_link_delays_but_loses_nothing(cluster, references):
    def slow(load):
        cluster.slow_link(True, loss=0.05)
        try:
            load.wait(4 * STEP_TIMEOUT)
        finally:
            cluster.slow_link(False)
    result = run_load(cluster, references, slow)
    assert result.failed == 0 and result.served > 0
    cluster.wait_pools_empty()
    assert cluster.metric("pagedserve_replicas_up") == 2


TAKEN_BY_TOKEN = "the owning control plane reconnected (or was restarted with its saved token)"


def test_a_restarted_control_plane_takes_over_the_running_data_planes(cluster, references):
    dp_pids = {h: p.pid for h, p in cluster.dp.items()}
    taken = {h: cluster.read_log(f"data-plane-{h}").count(TAKEN_BY_TOKEN) for h in cluster.dp}

    def restart(load):
        cluster.cp.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        cluster.cp.kill()
        cluster.cp.wait()
        cluster.start_control_plane()
        cluster.wait_health("ok")
        load.wait(1.0)
    # requests in flight when the control plane dies may fail, clearly, never wrongly
    run_load(cluster, references, restart)
    assert {h: p.pid for h, p in cluster.dp.items()} == dp_pids          # the same data planes serve
    # taken over at its first HELLO, with the owner tokens its previous run kept (--state-dir),
    # not after the data planes noticed the old link gone
    assert all(cluster.read_log(f"data-plane-{h}").count(TAKEN_BY_TOKEN) == taken[h] + 1 for h in cluster.dp)
    assert "using the owner token saved for" in cluster.cp_log() and "asking again" not in cluster.cp_log()
    assert all(p.poll() is None for p in cluster.dp.values())
    result = run_load(cluster, references, lambda load: load.wait(2.0))
    assert result.failed == 0 and result.served > 0
    cluster.wait_pools_empty()


def test_a_second_live_control_plane_is_refused(cluster, references):
    second = cluster.bed.spawn("a", cluster.control_plane_cmd(port=8001), cluster.log_path("second-control-plane"))
    try:
        code = second.wait(timeout=180)
    except subprocess.TimeoutExpired:
        second.kill()
        raise AssertionError("a second control plane was not refused:\n" + cluster.read_log("second-control-plane"))
    second_log = cluster.read_log("second-control-plane")
    # the first one holds the owner tokens' locks: the second cannot use them, and the data planes refuse it
    assert code != 0 and "another control plane on this host holds" in second_log
    assert "already serves another control plane" in second_log
    result = run_load(cluster, references, lambda load: load.wait(1.0))   # the first one serves on
    assert result.failed == 0 and result.served > 0


def test_a_control_plane_started_with_a_replica_down_serves_and_takes_it_in_later(cluster, references):
    cluster.cp.kill()
    cluster.cp.wait()
    cluster.signal("c", signal.SIGKILL)
    cluster.start_control_plane()
    cluster.wait_health("degraded", down=[1])
    result = run_load(cluster, references, lambda load: load.wait(2.0))
    assert result.failed == 0 and result.served > 0
    before = served_by(cluster)
    assert before[1] == 0
    cluster.start_data_plane("c")
    cluster.wait_health("ok")
    result = run_load(cluster, references, lambda load: load.wait(2.0))
    assert result.failed == 0
    assert served_by(cluster)[1] > 0
    cluster.wait_pools_empty()
