"""A tensor-parallel data plane whose two ranks run on two hosts (b: node 0, rank 0, which the
control plane talks to; c: node 1, rank 1), started as a user starts them (--nnodes 2
--node-rank K --rendezvous b:PORT), behind a control plane on host a, under a steady load of
streamed and non-streamed greedy requests from host d (tests/faults/cluster.py).

The fault: rank 1 killed (SIGKILL) under load. Rank 0 fails its next collective and exits, so
the control plane sees its data plane gone; the test, as each host's supervisor would, starts
both ranks again; the control plane takes the new group in and recomputes the requests it holds.
Every request gets a 200 with the reference's tokens (a stream repeats none), and the pool drains.
"""
import os
import signal
import sys
import time

import pytest

from tests.faults.cluster import DP_PORT, Cluster, Load, running_cluster, tally
from tests.servers import ROOT, TEST_SWAP_SPACE_GIB

pytestmark = pytest.mark.faults
RENDEZVOUS_PORT = 29500
NODES = {"b": 0, "c": 1}        # host -> its --node-rank


class TensorParallelCluster(Cluster):
    """The control plane of Cluster with one data plane: the group of ranks on hosts b and c."""

    def replica_addresses(self) -> list[str]:
        return [f"tcp://{self.bed.address['b']}:{DP_PORT}"]

    def start_rank(self, host: str):
        b = self.bed.address["b"]
        self.dp[host] = self.bed.spawn(host, [
            sys.executable, "-m", "control_plane.cli", "data-plane", "--model", self.model,
            "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(NODES[host]),
            "--rendezvous", f"{b}:{RENDEZVOUS_PORT}", "--listen", f"tcp://{b}:{DP_PORT}", "--curve-keys", self.keys,
            "--metrics-port", "0", "--num-threads", "1", "--kv-cache-blocks", "128", "--max-model-len", "256",
            "--swap-space-gib", str(TEST_SWAP_SPACE_GIB)], self.log_path(f"rank-{host}"), cwd=ROOT)
        return self.dp[host]

    def wait_exit(self, host: str, seconds: float = 60) -> int:
        deadline = time.monotonic() + seconds
        while self.dp[host].poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the rank on host {host} outlived its group:\n{self.read_log('rank-' + host)[-3000:]}")
            time.sleep(0.1)
        return self.dp[host].returncode


def start_group(cluster):
    for host in NODES:
        cluster.start_rank(host)
    cluster.start_control_plane()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("tp-faults"), start_group,
                         TensorParallelCluster) as c:
        yield c


def test_ranks_on_two_hosts_form_one_group(cluster):
    status, body = cluster.get("/version")
    assert status == 200 and "x2 tensor-parallel ranks" in body, body
    rank1 = cluster.read_log("rank-c")
    assert "rank 1 of 2: joining the group at 10.77.0.2" in rank1 and "gloo connects the ranks over eth0" in rank1


def test_a_killed_rank_takes_its_group_down_and_the_restarted_group_recomputes(cluster, references):
    prompts, refs = references
    with Load(cluster, prompts) as load:
        load.wait(1.5)
        os.kill(cluster.dp["c"].pid, signal.SIGKILL)
        assert cluster.wait_exit("c") == -signal.SIGKILL
        assert cluster.wait_exit("b") != 0   # rank 0 lost its group and exited
        assert "lost its group" in cluster.read_log("rank-b")
        for host in NODES:                  # as each host's supervisor does
            cluster.start_rank(host)
        cluster.wait_health("ok")
        load.wait(2.0)
        outcomes = load.stop()
    result = tally(outcomes, refs)
    assert not result.wrong, result.wrong[:3]
    assert result.failed == 0 and result.served > 0, [o.error for o in outcomes if o.error][:3]
    # the group was declared dead, not its step failed: no request is suspected of having caused it
    assert "suspect" not in cluster.cp_log()
    requeued = [line for line in cluster.cp_log().splitlines() if "sequences re-queued for recompute" in line]
    assert requeued and int(requeued[-1].split("; ")[1].split()[0]) > 0, requeued
    cluster.wait_pools_empty()
