"""Starting a tensor-parallel data plane (`--tensor-parallel-size N`, N > 1).

Rendezvous is torch.distributed's own, through the usual environment variables, so that ranks can
sit on several machines:

    MASTER_ADDR, MASTER_PORT   where rank 0's store listens
    RANK, WORLD_SIZE           this process's rank; WORLD_SIZE must equal N
    LOCAL_RANK                 which GPU of this machine (cuda:LOCAL_RANK); default RANK

With RANK and WORLD_SIZE set, this process is that one rank (start one per rank, on any machine;
rank 0 binds --listen and answers the control plane). Without them it is rank 0 and starts ranks
1..N-1 on this machine itself, as children that die with it; if one of them exits, rank 0 exits
too, and the control plane restarts the whole data plane as it would a single process.

The size is checked against the model's heads before anything starts.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

from shared.config import ConfigError, DataPlaneConfig, split_model_path

log = logging.getLogger("pagedserve.data_plane")
# the first collective waits for the slowest rank to load its model; later ones never wait this long
# (rank 0 sends a heartbeat every few seconds)
GROUP_TIMEOUT_SECONDS = 600
PR_SET_PDEATHSIG = 1


def rank_from_env(tp_size: int) -> tuple[int, int, int, bool]:
    """(rank, world size, local rank, whether this process must start the other ranks)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if world != tp_size:
            raise ConfigError(f"WORLD_SIZE={world} in the environment but --tensor-parallel-size {tp_size}")
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is not in [0, {world})")
        return rank, world, int(env.get("LOCAL_RANK", rank)), False
    return 0, tp_size, 0, True


def read_model_config(model: str):
    from transformers import AutoConfig
    folder, gguf_file = split_model_path(model)
    return AutoConfig.from_pretrained(folder, gguf_file=gguf_file)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child, before exec: SIGKILL when the parent dies (however it dies, even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_local_ranks(argv: list[str], world: int) -> list[subprocess.Popen]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE=str(world))
    children = []
    for rank in range(1, world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        children.append(subprocess.Popen([sys.executable, "-m", "data_plane", *argv], env=env,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None))
    log.info("started tensor-parallel ranks 1..%d (pids %s)", world - 1, ", ".join(str(c.pid) for c in children))
    return children


def watch_ranks(children: list[subprocess.Popen], stopping: threading.Event) -> None:
    """A rank that exits while the group serves takes rank 0 (and so the others) down with it."""
    def watch():
        while not stopping.is_set():
            for rank, child in enumerate(children, start=1):
                code = child.poll()
                if code is not None and not stopping.is_set():
                    log.critical("tensor-parallel rank %d exited with code %s; stopping the data plane", rank, code)
                    logging.shutdown()
                    os._exit(3)
            time.sleep(0.2)
    threading.Thread(target=watch, name="rank-watch", daemon=True).start()


def main(config: DataPlaneConfig, argv: list[str]) -> int:
    from data_plane import tensor_parallel as TP
    tp_size = config.tensor_parallel_size
    try:
        rank, world, local_rank, spawn = rank_from_env(tp_size)
        TP.check_size(read_model_config(config.model), world)
    except (ConfigError, TP.TensorParallelError) as exc:
        print(f"pagedserve data-plane: {exc}", file=sys.stderr)
        return 2
    stopping = threading.Event()
    children = start_local_ranks(argv, world) if spawn else []
    watch_ranks(children, stopping)
    try:
        return _serve(config, rank, world, local_rank)
    finally:
        stopping.set()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def _serve(config: DataPlaneConfig, rank: int, world: int, local_rank: int) -> int:
    import torch
    import torch.distributed as dist

    from data_plane import tensor_parallel as TP
    from data_plane import tp_worker
    from data_plane.model_runner import ModelRunner, load_model, resolve_device
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    log.info("rank %d of %d: joining the group at %s:%s (%s)", rank, world, os.environ.get("MASTER_ADDR"),
             os.environ.get("MASTER_PORT"), backend)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_SECONDS),
                            device_id=device if device.type == "cuda" else None)
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    comm = TP.Comm(rank, world, dist.group.WORLD, cpu_group)
    model = load_model(config, torch.device("cpu"))
    num_split = TP.shard_model(model, comm)
    model = model.to(device)
    log.info("rank %d: split %d linear layers; loading done", rank, num_split)
    # rank 0 samples and the others follow its tokens
    runner = ModelRunner(model, config, device, sample=TP.follow_sampling(comm))
    _agree_on_pool_sizes(runner, comm)
    if rank != 0:
        return tp_worker.follow(runner, comm)
    from data_plane import metrics
    stats = metrics.DataPlaneStats(runner.handshake())
    metrics.start_metrics_server(stats, config.metrics_port, metrics.metrics_host(config.listen))
    extra = {"curve_keys": config.curve_keys} if getattr(config, "curve_keys", None) else {}
    tp_worker.LeaderWorker(runner, comm, config.listen, stats, **extra).serve_forever()
    return 0


def _agree_on_pool_sizes(runner, comm) -> None:
    """Block ids must mean the same on every rank: every rank uses the smallest pool any rank could
    allocate (sizes differ only when they come from each device's free memory)."""
    import torch
    import torch.distributed as dist
    sizes = torch.tensor([runner.num_blocks, runner.swap.num_blocks], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MIN, group=comm.cpu_group)
    runner.num_blocks, runner.swap.num_blocks = int(sizes[0]), int(sizes[1])
