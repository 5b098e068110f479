"""Starting a tensor-parallel data plane (`--tensor-parallel-size N`, N > 1).

Rendezvous is torch.distributed's own (env://): rank 0 runs the group's store at MASTER_ADDR:
MASTER_PORT and every rank meets there. Where each rank runs is said in one of two ways:

- options, as torchrun has them: `--nnodes M --node-rank K --rendezvous HOST:PORT`. The process
  started on host K is rank K*N/M and starts ranks K*N/M+1 .. (K+1)*N/M-1 on its host as
  children (LOCAL_RANK 0 .. N/M-1, cuda:LOCAL_RANK). Without them (M = 1) the group is all
  local: rank 0 starts ranks 1..N-1, with a store on 127.0.0.1 and a free port;
- the environment, one process per rank started by someone else: RANK, WORLD_SIZE (must equal
  N), MASTER_ADDR, MASTER_PORT, LOCAL_RANK (default RANK).

Rank 0 binds --listen and answers the control plane. Children die with the process that started
them; if one exits, that process exits too, and on other hosts a failed collective does the same,
so the whole group goes down together and its supervisor (the control plane for a spawned data
plane, systemd or the like on other hosts) starts it again.

Across hosts gloo connects the ranks over the interface that routes to the rendezvous host
(GLOO_SOCKET_IFNAME, unless set already: by default gloo binds whatever the host name resolves
to, which may be an address the other hosts cannot reach).

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
from dataclasses import dataclass
from datetime import timedelta

from shared.config import ConfigError, DataPlaneConfig, rendezvous_address, split_model_path
from shared.curve import is_loopback

log = logging.getLogger("pagedserve.data_plane")
# the first collective waits for the slowest rank to load its model; later ones never wait this long
# (rank 0 sends a heartbeat every few seconds)
GROUP_TIMEOUT_SECONDS = 600
PR_SET_PDEATHSIG = 1
SIOCGIFADDR = 0x8915


CHILD_ENV = "PAGEDSERVE_TP_CHILD"   # set in the ranks a process starts: they take their rank from the environment


@dataclass
class Placement:
    rank: int                 # this process's rank
    world: int
    local_rank: int
    children: list[int]       # the ranks this process starts on its host
    master: tuple[str, int] | None = None   # the store's address, when this process sets it


def placement(config: DataPlaneConfig, env=os.environ) -> Placement:
    tp_size = config.tensor_parallel_size
    if "RANK" in env and "WORLD_SIZE" in env:
        if config.nnodes > 1 and CHILD_ENV not in env:
            raise ConfigError("RANK and WORLD_SIZE are set in the environment and --nnodes is given: place the "
                              "ranks one way, not both")
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if world != tp_size:
            raise ConfigError(f"WORLD_SIZE={world} in the environment but --tensor-parallel-size {tp_size}")
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is not in [0, {world})")
        return Placement(rank, world, int(env.get("LOCAL_RANK", rank)), [])
    per_host = tp_size // config.nnodes
    first = config.node_rank * per_host
    if config.rendezvous is not None:
        master = rendezvous_address(config.rendezvous)
    else:
        master = ("127.0.0.1", _free_port())
    return Placement(first, tp_size, 0, list(range(first + 1, first + per_host)), master)


def gloo_interface(host: str, port: int) -> str | None:
    """The name of this host's interface whose IPv4 address routes to `host` (None: not found)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))    # a UDP connect sends nothing: it only picks the route
            local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            if _ipv4_of(name) == local:
                return name
    except OSError:
        pass
    return None


def _ipv4_of(interface: str) -> str | None:
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            data = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(data[20:24])


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


def start_local_ranks(argv: list[str], where: Placement) -> dict[int, subprocess.Popen]:
    """Sets this process's rendezvous environment and starts the ranks `where` names on this host."""
    host, port = where.master
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(where.rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(where.world))
    if not is_loopback(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}") and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = gloo_interface(host, port)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
            log.info("gloo connects the ranks over %s (the interface towards %s)", interface, host)
    children = {}
    for rank in where.children:
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank - where.rank), CHILD_ENV: "1"}
        children[rank] = subprocess.Popen([sys.executable, "-m", "data_plane", *argv], env=env,
                                          preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    if children:
        log.info("started tensor-parallel ranks %s (pids %s)", ", ".join(map(str, children)),
                 ", ".join(str(c.pid) for c in children.values()))
    return children


def watch_ranks(children: dict[int, subprocess.Popen], stopping: threading.Event) -> None:
    """A rank that exits while the group serves takes this process (and so the others) down with it."""
    def watch():
        while not stopping.is_set():
            for rank, child in children.items():
                code = child.poll()
                if code is not None and not stopping.is_set():
                    log.critical("tensor-parallel rank %d exited with code %s; stopping the data plane", rank, code)
                    logging.shutdown()
                    os._exit(3)
            time.sleep(0.2)
    threading.Thread(target=watch, name="rank-watch", daemon=True).start()


def main(config: DataPlaneConfig, argv: list[str]) -> int:
    from data_plane import tensor_parallel as TP
    try:
        where = placement(config)
        TP.check_size(read_model_config(config.model), where.world)
    except (ConfigError, TP.TensorParallelError) as exc:
        print(f"pagedserve data-plane: {exc}", file=sys.stderr)
        return 2
    stopping = threading.Event()
    children = start_local_ranks(argv, where) if where.master is not None else {}
    watch_ranks(children, stopping)
    try:
        return _serve(config, where.rank, where.world, where.local_rank)
    finally:
        stopping.set()
        for child in children.values():
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def _serve(config: DataPlaneConfig, rank: int, world: int, local_rank: int) -> int:
    import torch
    import torch.distributed as dist

    from data_plane import collector
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
    collector.hold()
    model = load_model(config, torch.device("cpu"))
    num_split = TP.shard_model(model, comm)
    model = model.to(device)
    log.info("rank %d: split %d linear layers; loading done", rank, num_split)
    # rank 0 samples and the others follow its tokens
    runner = ModelRunner(model, config, device, sample=TP.follow_sampling(comm))
    _agree_on_pool_sizes(runner, comm)
    if rank != 0:
        with collector.serving():
            return tp_worker.follow(runner, comm)
    from data_plane import metrics
    stats = metrics.DataPlaneStats(runner.handshake())
    metrics.start_metrics_server(stats, config.metrics_port, metrics.metrics_host(config.listen))
    extra = {"curve_keys": config.curve_keys} if getattr(config, "curve_keys", None) else {}
    with collector.serving():
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
