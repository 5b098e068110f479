"""Where the ranks of a tensor-parallel data plane run (data_plane/tp_launch.py): all on one host,
spread over hosts by --nnodes/--node-rank/--rendezvous as torchrun has it, or one per process
from the environment; and the settings that cannot work, refused with what to change."""

import pytest

from data_plane import tp_launch
from shared.config import ConfigError, DataPlaneConfig


def config(**kw) -> DataPlaneConfig:
    return DataPlaneConfig(model="unused", **kw)


def test_one_host_runs_every_rank_with_a_local_store():
    where = tp_launch.placement(config(tensor_parallel_size=4), env={})
    assert (where.rank, where.world, where.local_rank, where.children) == (0, 4, 0, [1, 2, 3])
    assert where.master[0] == "127.0.0.1" and 0 < where.master[1] < 65536


@pytest.mark.parametrize("node_rank, first, children", [(0, 0, [1]), (1, 2, [3])])
def test_each_host_runs_its_share_of_the_ranks_and_meets_at_the_rendezvous(node_rank, first, children):
    where = tp_launch.placement(config(tensor_parallel_size=4, nnodes=2, node_rank=node_rank,
                                       rendezvous="10.0.0.1:29500"), env={})
    assert (where.rank, where.world, where.children, where.master) == (first, 4, children, ("10.0.0.1", 29500))


def test_a_rank_from_the_environment_starts_no_others():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1"}
    where = tp_launch.placement(config(tensor_parallel_size=2), env=env)
    assert (where.rank, where.world, where.local_rank, where.children, where.master) == (1, 2, 0, [], None)
    # the children a host starts have the options on their command line and take the environment
    child = tp_launch.placement(config(tensor_parallel_size=4, nnodes=2, node_rank=1, rendezvous="h:1"),
                                env={**env, "RANK": "3", "WORLD_SIZE": "4", tp_launch.CHILD_ENV: "1"})
    assert (child.rank, child.children) == (3, [])


@pytest.mark.parametrize("env, match", [
    ({"RANK": "0", "WORLD_SIZE": "4"}, "WORLD_SIZE=4 in the environment but --tensor-parallel-size 2"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 is not in \[0, 2\)"),
])
def test_an_environment_that_contradicts_the_size_is_refused(env, match):
    with pytest.raises(ConfigError, match=match):
        tp_launch.placement(config(tensor_parallel_size=2), env=env)


def test_options_and_environment_together_are_refused():
    with pytest.raises(ConfigError, match="place the ranks one way, not both"):
        tp_launch.placement(config(tensor_parallel_size=2, nnodes=2, rendezvous="h:1"),
                            env={"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("kw, match", [
    ({"tensor_parallel_size": 3, "nnodes": 2, "rendezvous": "h:1"}, "--nnodes 2 must divide --tensor-parallel-size 3"),
    ({"tensor_parallel_size": 2, "nnodes": 0}, "--nnodes 0 must divide"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "rendezvous": "h:1"}, r"--node-rank 2 is not in \[0, 2\)"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, "--nnodes 2 needs --rendezvous HOST:PORT"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "rendezvous": "10.0.0.1"}, "--rendezvous 10.0.0.1: give HOST:PORT"),
    ({"tensor_parallel_size": 2, "rendezvous": "h:70000"}, "--rendezvous h:70000: give HOST:PORT"),
])
def test_placements_that_cannot_work_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        config(**kw)._check_nodes()


def test_gloo_uses_the_interface_that_routes_to_the_rendezvous_host():
    assert tp_launch.gloo_interface("127.0.0.1", 29500) == "lo"
    assert tp_launch._ipv4_of("no-such-interface") is None
