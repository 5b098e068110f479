"""`pagedserve serve | control-plane | data-plane`: the console script."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from control_plane import launch, server
from shared import config as C


def _check_ports(cp: C.ControlPlaneConfig, metrics_port: int, num_replicas: int) -> None:
    """Ports this server will bind, checked before anything starts: a second server on the same
    defaults gets an error naming the flag at once, not a failure after the model has loaded."""
    if C.port_taken(cp.host, cp.port):
        raise C.ConfigError(f"--port {cp.port} is taken on {cp.host} (another server?): give another --port")
    for port in range(metrics_port, metrics_port + num_replicas) if metrics_port else ():
        if C.port_taken("127.0.0.1", port):
            raise C.ConfigError(f"--metrics-port {metrics_port}: port {port}, for the data plane's metrics, is "
                                "taken (another pagedserve?): give another --metrics-port, or 0 to turn the "
                                "data plane's metrics off")


def _serve(args: argparse.Namespace, spawn: bool) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s control-plane: %(message)s")
    try:
        cp = C.from_args(C.ControlPlaneConfig, args).validate()
        args.model = cp.model   # resolved once (the default model's path) for the data planes too
        addresses = cp.data_plane
        if addresses and cp.data_parallel_size > 1:
            raise C.ConfigError("give either --data-plane addresses or --data-parallel-size, not both")
        if not addresses and not spawn:
            raise C.ConfigError("control-plane needs --data-plane ADDRESS (or use 'pagedserve serve')")
        num_replicas = len(addresses) or cp.data_parallel_size
        _check_ports(cp, 0 if addresses else args.metrics_port, num_replicas)
        children = []
        if not addresses:
            addresses, children = launch.spawn(args, num_replicas)
    except C.ConfigError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(server.run_server(cp, addresses, children))
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
    serve = sub.add_parser(C.SERVE, help="control plane plus a local data plane (or --data-plane ADDRESS)",
                           description="the REST API, with a data plane it spawns and watches")
    cpl = sub.add_parser(C.CONTROL_PLANE, help="control plane only, connecting to --data-plane ADDRESS",
                         description="the REST API over data planes started separately (--data-plane)")
    sub.add_parser(C.DATA_PLANE, help="data plane only (see pagedserve data-plane --help)")
    sub.add_parser("keygen", help="write CURVE key pairs for the ZeroMQ link into DIR")
    for command, p in ((C.SERVE, serve), (C.CONTROL_PLANE, cpl)):
        C.add_settings(p, command)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return _serve(args, spawn=args.command == "serve")


if __name__ == "__main__":
    sys.exit(main())
