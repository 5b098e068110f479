"""`pagedserve serve --data-parallel-size N` and `--data-plane A --data-plane B ...`: one control
plane, several data-plane replicas, one engine per replica behind control_plane.router.Router.

The single-replica server (cli.run_server) is unchanged; this module is its N-replica twin: each
replica is reached, watched and restarted on its own (a dead replica's requests are re-queued on
that replica once it answers again, while the others keep serving).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import tempfile
import uuid

from shared import config as C

log = logging.getLogger("pagedserve.control_plane")


def spawn_replicas(args, num: int) -> tuple[list[str], list]:
    """Starts `num` data planes on ipc addresses; a metrics port P becomes P, P+1, ..."""
    from control_plane.cli import SpawnedDataPlane
    addresses, children = [], []
    for i in range(num):
        address = f"ipc://{tempfile.gettempdir()}/pagedserve-{uuid.uuid4().hex[:12]}-r{i}.sock"
        config = C.data_plane_config(args, address)
        if config.metrics_port:
            config.metrics_port += i
        addresses.append(address)
        children.append(SpawnedDataPlane(config))
    return addresses, children


async def _connect(cp: C.ControlPlaneConfig, address: str, child, stop: asyncio.Event):
    from control_plane.cli import HANDSHAKE_TIMEOUT
    from control_plane.dp_client import DataPlaneClient
    client = DataPlaneClient(address, cp.curve_keys)
    task = asyncio.ensure_future(client.handshake(HANDSHAKE_TIMEOUT))
    while not task.done():
        await asyncio.wait([task], timeout=1.0)
        if child is not None and not child.alive():
            task.cancel()
            raise SystemExit(f"the data plane at {address} exited with code {child.proc.returncode} "
                             "before the handshake")
        if stop.is_set():
            task.cancel()
            client.close()
            return None, None
    return client, task.result()


async def run_replicated_server(cp: C.ControlPlaneConfig, addresses: list[str], children: list) -> None:
    from control_plane.cli import load_tokenizer, serve_until_stopped
    from control_plane.engine import Engine
    from control_plane.router import Router

    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: (hurry if stop.is_set() else stop).set())
    tokenizer_task = loop.run_in_executor(None, load_tokenizer, cp.model)
    log.info("waiting for %d data planes: %s", len(addresses), ", ".join(addresses))
    children = children or [None] * len(addresses)
    connected = await asyncio.gather(*(_connect(cp, a, c, stop) for a, c in zip(addresses, children)))
    if stop.is_set():
        for client, _ in connected:
            if client is not None:
                await client.shutdown()
                client.close()
        return
    tokenizer = await tokenizer_task
    engines = []
    for i, ((client, hs), child) in enumerate(zip(connected, children)):
        log.info("replica %d ready: %s on %s, %d blocks of %d tokens", i, hs.model_id, hs.device,
                 hs.num_device_blocks, hs.block_size)
        engine = Engine(cp, client, hs, tokenizer)
        if child is not None:
            client.alive_check = child.alive
            engine.on_dead = child.restart
        engines.append(engine)
    await serve_until_stopped(Router(engines), cp, stop, hurry, f" with {len(engines)} replicas")
    for e in engines:
        await e.client.shutdown()
        e.client.close()
