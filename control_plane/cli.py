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
import time
import uuid

from shared import config as C

log = logging.getLogger("pagedserve.control_plane")
HANDSHAKE_TIMEOUT = 600.0  # the data plane loads the model before it answers
SHUTDOWN_WRITE_SECONDS = 5.0  # after aborting, what handlers get to write their last answer


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
    parser.add_argument("--max-n", type=int, default=16,
                        help="most sequences one request may ask for (n, best_of, beam width)")
    parser.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                        help="abort requests not finished after this long (default: no limit); a body's "
                             "'timeout' may ask for less")
    parser.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM or SIGINT, seconds in-flight requests get to finish before they "
                             "are aborted (a second signal aborts them at once)")


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
        # its own session: a Ctrl-C in the terminal reaches only us, and we stop it in order
        return subprocess.Popen(self.cmd, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def restart(self) -> None:
        """Kills it if it still runs (hung, or stopped: SIGKILL ends both) and starts a new one."""
        if self.alive():
            self.proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, self.proc.wait)
        log.warning("the data plane exited with code %s; restarting it", self.proc.returncode)
        self.proc = self._start()

    def stop(self, timeout: float = 10.0) -> None:
        """Waits for it to exit (after SHUTDOWN), then asks with SIGTERM, then kills it."""
        for ask in (None, self.proc.terminate, self.proc.kill):
            if ask is not None:
                log.warning("the data plane did not exit; sending %s", ask.__name__)
                ask()
            try:
                self.proc.wait(timeout=timeout)
                return
            except subprocess.TimeoutExpired:
                pass


async def run_server(cp: C.ControlPlaneConfig, child: SpawnedDataPlane | None) -> None:
    from control_plane.dp_client import DataPlaneClient, DataPlaneRefused
    from control_plane.engine import Engine

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()     # set by the first SIGTERM/SIGINT: drain; `hurry` by a second: abort now
    hurry = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: (hurry if stop.is_set() else stop).set())
    tokenizer_task = loop.run_in_executor(None, load_tokenizer, cp.model)
    client = DataPlaneClient(cp.data_plane, cp.curve_keys)
    log.info("waiting for the data plane at %s%s", cp.data_plane, " (CURVE)" if cp.curve_keys else "")
    handshake_task = asyncio.ensure_future(client.handshake(HANDSHAKE_TIMEOUT))
    while not handshake_task.done():
        await asyncio.wait([handshake_task], timeout=1.0)
        if child is not None and not child.alive():
            handshake_task.cancel()
            raise SystemExit(f"the data plane exited with code {child.proc.returncode} before the handshake")
        if stop.is_set():
            handshake_task.cancel()
            log.info("stopped before the data plane answered")
            await client.shutdown()
            client.close()
            return
    try:
        hs = handshake_task.result()
    except DataPlaneRefused as exc:   # another control plane owns it: it keeps it, we leave
        client.close()
        log.error("%s", exc)
        raise SystemExit(f"pagedserve: {exc}") from None
    log.info("data plane ready: %s on %s, %s, %d blocks of %d tokens, max length %d", hs.model_id, hs.device,
             hs.dtype, hs.num_device_blocks, hs.block_size, hs.max_model_len)
    engine = Engine(cp, client, hs, await tokenizer_task)
    if child is not None:
        client.alive_check = child.alive
        engine.on_dead = child.restart
    await serve_until_stopped(engine, cp, stop, hurry)
    await client.shutdown()
    client.close()


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
    log.info("serving %s on http://%s:%d%s", cp.model_name, cp.host, cp.port, what)

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


def _serve(args: argparse.Namespace, spawn: bool) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s control-plane: %(message)s")
    try:
        model = args.model or C.default_model_path()
        addresses = args.data_plane or []
        num_replicas = max(len(addresses), getattr(args, "data_parallel_size", 1))
        if addresses and num_replicas > len(addresses):
            raise C.ConfigError("give either --data-plane addresses or --data-parallel-size, not both")
        if num_replicas < 1:
            raise C.ConfigError("--data-parallel-size must be at least 1")
        cp = C.ControlPlaneConfig(model=model, host=args.host, port=args.port,
                                  data_plane=addresses[0] if addresses else None,
                                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  served_model_name=args.served_model_name, step_timeout=args.step_timeout,
                                  log_interval=args.log_interval,
                                  enable_prefix_caching=args.prefix_caching,
                                  preemption_mode=args.preemption_mode, max_waiting=args.max_waiting,
                                  api_key=args.api_key, max_n=args.max_n, request_timeout=args.request_timeout,
                                  shutdown_grace=args.shutdown_grace, curve_keys=args.curve_keys).validate()
        child = None
        if num_replicas > 1:
            return _serve_replicas(args, cp, addresses, spawn)
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


def _serve_replicas(args, cp: C.ControlPlaneConfig, addresses: list[str], spawn: bool) -> int:
    from control_plane import replicas
    children = []
    if not addresses:
        if not spawn:
            raise C.ConfigError("control-plane needs --data-plane ADDRESS for every replica")
        addresses, children = replicas.spawn_replicas(args, args.data_parallel_size)
    try:
        asyncio.run(replicas.run_replicated_server(cp, addresses, children))
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            child.stop()
    return 0


def _keygen(argv: list[str]) -> int:
    from shared import curve
    parser = argparse.ArgumentParser(prog="pagedserve keygen",
                                     description="write server and client CURVE key pairs into DIR")
    parser.add_argument("dir")
    args = parser.parse_args(argv)
    try:
        files = curve.keygen(args.dir)
    except curve.CurveKeyError as exc:
        print(f"pagedserve keygen: {exc}", file=sys.stderr)
        return 2
    print("\n".join(files))
    print("data plane: needs server.key_secret and client.key; control plane: client.key_secret and "
          "server.key; both take --curve-keys DIR")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "data-plane":
        from data_plane.__main__ import main as data_plane_main
        return data_plane_main(argv[1:])
    if argv and argv[0] == "keygen":
        return _keygen(argv[1:])
    parser = argparse.ArgumentParser(prog="pagedserve", description="PagedAttention LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="control plane plus a local data plane (or --data-plane ADDRESS)")
    cpl = sub.add_parser("control-plane", help="control plane only, connecting to --data-plane ADDRESS")
    sub.add_parser("data-plane", help="data plane only (see pagedserve data-plane --help)")
    sub.add_parser("keygen", help="write CURVE key pairs for the ZeroMQ link into DIR")
    for p in (serve, cpl):
        C.add_model_args(p)
        _control_plane_args(p)
        p.add_argument("--data-plane", default=None, action="append",
                       help="ZeroMQ address of a running data plane; give it again for more replicas")
    C.add_data_plane_args(serve, metrics_flag="--data-plane-metrics-port")
    serve.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="spawn N data-plane replicas, each with its own KV pool; requests are routed by "
                            "load and prefix affinity")
    cpl.add_argument("--curve-keys", default=None, metavar="DIR",
                     help="folder of CURVE keys (pagedserve keygen DIR) shared with the data plane")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return _serve(args, spawn=args.command == "serve")


if __name__ == "__main__":
    sys.exit(main())
