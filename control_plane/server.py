"""The control plane's life as a server: wait for its data planes, build one engine per data
plane (behind a Router when there are several), serve the REST API, drain and stop."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time

from control_plane import launch
from shared import config as C

log = logging.getLogger("pagedserve.control_plane")
SHUTDOWN_WRITE_SECONDS = 5.0  # after aborting, what handlers get to write their last answer


async def run_server(cp: C.ControlPlaneConfig, addresses: list[str], children: list) -> None:
    """`children`: the spawned data-plane processes, one per address, or empty when they run elsewhere."""
    from control_plane.dp_client import DataPlaneClient
    from control_plane.engine import Engine
    from control_plane.owner_tokens import OwnerTokens
    from control_plane.router import Router

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()     # set by the first SIGTERM/SIGINT: drain; `hurry` by a second: abort now
    hurry = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: (hurry if stop.is_set() else stop).set())
    tokenizer_task = loop.run_in_executor(None, launch.load_tokenizer, cp.model)
    log.info("waiting for the data plane%s at %s%s", "s" if len(addresses) > 1 else "", ", ".join(addresses),
             " (CURVE)" if cp.curve_keys else "")
    # data planes started elsewhere outlive us: their owner tokens are kept for our next run
    tokens = None if children else OwnerTokens(cp.state_dir)
    children = children or [None] * len(addresses)
    connected = await launch.connect_replicas(cp, addresses, children, stop, tokens)
    if stop.is_set():
        log.info("stopped before the data planes answered")
        for client, _ in connected:
            if client is not None:
                await client.shutdown()
                client.close()
        return
    tokenizer = await tokenizer_task
    engines = []
    first_hs = next(hs for _, hs in connected if hs is not None)
    for i, ((client, hs), child) in enumerate(zip(connected, children)):
        if hs is None:   # a replica down at start: its engine connects first (engine.run), then serves
            engine = Engine(cp, DataPlaneClient(addresses[i], cp.curve_keys, tokens), first_hs, tokenizer)
            engine.start_unconnected()
            engines.append(engine)
            continue
        log.info("data plane %d ready: %s on %s, %s, %d blocks of %d tokens, max length %d", i, hs.model_id,
                 hs.device, hs.dtype, hs.num_device_blocks, hs.block_size, hs.max_model_len)
        engine = Engine(cp, client, hs, tokenizer)
        if child is not None:
            engine.on_dead = child.restart
        engines.append(engine)
    if len(engines) == 1:
        await serve_until_stopped(engines[0], cp, stop, hurry)
    else:
        await serve_until_stopped(Router(engines), cp, stop, hurry, f" with {len(engines)} replicas")
    for e, child in zip(engines, children):
        # a data plane started elsewhere is left running: it belongs to whoever started it, and a
        # control plane started again takes it over; one we spawned is told to stop
        if child is not None:
            await e.client.shutdown()
        e.client.close()
    if tokens is not None:
        tokens.close()


async def serve_until_stopped(engine, cp: C.ControlPlaneConfig, stop: asyncio.Event, hurry: asyncio.Event,
                              what: str = "") -> None:
    """Serves the REST API over `engine` (an Engine, or a Router of several) until `stop` is set or
    the engine fails; then drains, stops the engine and closes the HTTP server."""
    from aiohttp import web

    from control_plane.api import make_app
    from control_plane.http_guard import GuardedAppRunner
    # header, body and keep-alive read timeouts: slow clients cannot hold connections
    runner = GuardedAppRunner(make_app(engine), handler_cancellation=True, access_log=None,
                              shutdown_timeout=SHUTDOWN_WRITE_SECONDS)
    await runner.setup()
    await web.TCPSite(runner, cp.host, cp.port).start()
    from control_plane import generation_defaults
    names = " or ".join(f"'{n}'" for n in cp.model_names)
    log.info("serving on http://%s:%d%s; clients name the model %s (--served-model-name sets it)", cp.host,
             cp.port, what, names)
    log.info("%s", generation_defaults.describe(cp))

    # the tokenizer, the app and the modules loaded so far live as long as the process: frozen, they are
    # not walked again by every full collection while requests are served
    gc.freeze()
    engine_task = asyncio.create_task(engine.run())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([engine_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
    if engine_task in done and engine_task.exception():
        log.error("engine stopped: %s", engine_task.exception())
    else:
        await drain(engine, cp.shutdown_grace, hurry)
    log.info("shutting down")
    await engine.stop()
    engine_task.cancel()
    await runner.cleanup()


async def drain(engine, grace: float, hurry: asyncio.Event) -> None:
    """Graceful shutdown: new requests get 503 while the ones in flight get `grace` seconds to end."""
    engine.draining = True
    num = engine.num_unfinished()
    log.info("shutdown requested: %d requests in flight get up to %.0fs to finish (signal again to abort them)",
             num, grace)
    deadline = time.monotonic() + grace
    while engine.num_unfinished() and time.monotonic() < deadline and not hurry.is_set():
        try:
            await asyncio.wait_for(hurry.wait(), 0.1)
        except asyncio.TimeoutError:
            pass
    left = engine.num_unfinished()
    if left:
        log.warning("aborting %d requests that did not finish in time", left)
    else:
        log.info("every request in flight finished")
