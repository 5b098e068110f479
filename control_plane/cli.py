"""`pagedserve serve | control-plane | data-plane`: the console script."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import uuid

from shared import config as C

log = logging.getLogger("pagedserve.control_plane")
HANDSHAKE_TIMEOUT = 600.0  # the data plane loads the model before it answers


def _control_plane_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--step-timeout", type=float, default=30.0,
                        help="seconds without an answer from the data plane before it is declared hung")
    parser.add_argument("--log-interval", type=float, default=5.0)
    parser.add_argument("--preemption-mode", default="auto", choices=C.PREEMPTION_MODES,
                        help="how a preempted request gives its blocks back: swap them to CPU memory, drop "
                             "and recompute them later, or choose per victim by cost (auto)")
    parser.add_argument("--max-waiting", type=int, default=1024,
                        help="requests allowed to wait; beyond, new ones get 503 with Retry-After")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
                             "(default: $PAGEDSERVE_API_KEY)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="do not reuse the KV blocks of common prompt prefixes")


def load_tokenizer(model: str):
    from transformers import AutoTokenizer
    folder, gguf_file = C.split_model_path(model)
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


class SpawnedDataPlane:
    """The data-plane process `pagedserve serve` owns: started, watched, restarted, stopped."""

    def __init__(self, config: C.DataPlaneConfig):
        self.cmd = [sys.executable, "-m", "data_plane", *C.data_plane_argv(config)]
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        log.info("starting the data plane: %s", " ".join(self.cmd))
        return subprocess.Popen(self.cmd)

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def restart(self) -> None:
        """Kills it if it still runs (hung, or stopped: SIGKILL ends both) and starts a new one."""
        if self.alive():
            self.proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, self.proc.wait)
        log.warning("the data plane exited with code %s; restarting it", self.proc.returncode)
        self.proc = self._start()

    def stop(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def run_server(cp: C.ControlPlaneConfig, child: SpawnedDataPlane | None) -> None:
    from aiohttp import web

    from control_plane.api import make_app
    from control_plane.dp_client import DataPlaneClient
    from control_plane.engine import Engine

    loop = asyncio.get_running_loop()
    tokenizer_task = loop.run_in_executor(None, load_tokenizer, cp.model)
    client = DataPlaneClient(cp.data_plane)
    log.info("waiting for the data plane at %s", cp.data_plane)
    handshake_task = asyncio.ensure_future(client.handshake(HANDSHAKE_TIMEOUT))
    while not handshake_task.done():
        await asyncio.wait([handshake_task], timeout=1.0)
        if child is not None and not child.alive():
            handshake_task.cancel()
            raise SystemExit(f"the data plane exited with code {child.proc.returncode} before the handshake")
    hs = handshake_task.result()
    log.info("data plane ready: %s on %s, %s, %d blocks of %d tokens, max length %d", hs.model_id, hs.device,
             hs.dtype, hs.num_device_blocks, hs.block_size, hs.max_model_len)
    engine = Engine(cp, client, hs, await tokenizer_task)
    if child is not None:
        client.alive_check = child.alive
        engine.on_dead = child.restart
    runner = web.AppRunner(make_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cp.host, cp.port).start()
    log.info("serving %s on http://%s:%d", cp.model_name, cp.host, cp.port)

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine_task = asyncio.create_task(engine.run())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([engine_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
    if engine_task in done and engine_task.exception():
        log.error("engine stopped: %s", engine_task.exception())
    log.info("shutting down")
    await engine.stop()
    engine_task.cancel()
    await runner.cleanup()
    await client.shutdown()
    client.close()


def _serve(args: argparse.Namespace, spawn: bool) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s control-plane: %(message)s")
    try:
        model = args.model or C.default_model_path()
        cp = C.ControlPlaneConfig(model=model, host=args.host, port=args.port, data_plane=args.data_plane,
                                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  served_model_name=args.served_model_name, step_timeout=args.step_timeout,
                                  log_interval=args.log_interval,
                                  enable_prefix_caching=args.prefix_caching,
                                  preemption_mode=args.preemption_mode, max_waiting=args.max_waiting,
                                  api_key=args.api_key).validate()
        child = None
        if spawn and cp.data_plane is None:
            cp.data_plane = f"ipc://{tempfile.gettempdir()}/pagedserve-{uuid.uuid4().hex[:12]}.sock"
            child = SpawnedDataPlane(C.data_plane_config(args, cp.data_plane))
        elif cp.data_plane is None:
            raise C.ConfigError("control-plane needs --data-plane ADDRESS (or use 'pagedserve serve')")
    except C.ConfigError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_server(cp, child))
    except KeyboardInterrupt:
        pass
    finally:
        if child is not None:
            child.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "data-plane":
        from data_plane.__main__ import main as data_plane_main
        return data_plane_main(argv[1:])
    parser = argparse.ArgumentParser(prog="pagedserve", description="PagedAttention LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="control plane plus a local data plane (or --data-plane ADDRESS)")
    cpl = sub.add_parser("control-plane", help="control plane only, connecting to --data-plane ADDRESS")
    sub.add_parser("data-plane", help="data plane only (see pagedserve data-plane --help)")
    for p in (serve, cpl):
        C.add_model_args(p)
        _control_plane_args(p)
        p.add_argument("--data-plane", default=None, help="ZeroMQ address of a running data plane")
    C.add_data_plane_args(serve, metrics_flag="--data-plane-metrics-port")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return _serve(args, spawn=args.command == "serve")


if __name__ == "__main__":
    sys.exit(main())
