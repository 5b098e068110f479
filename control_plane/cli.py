"""`pagedserve serve | control-plane | data-plane`: the console script."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from control_plane import launch, server
from shared import config as C


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
    parser.add_argument("--async-scheduling", action="store_true",
                        help="plan each step while the data plane still computes the one before (overlap); "
                             "the outputs are the same")
    parser.add_argument("--no-ui", dest="ui", action="store_false",
                        help="do not serve the built-in page at / (the KV block map, charts, a chat playground)")


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
                                  shutdown_grace=args.shutdown_grace, curve_keys=args.curve_keys,
                                  async_scheduling=args.async_scheduling, ui=args.ui).validate()
        if not addresses and not spawn:
            raise C.ConfigError("control-plane needs --data-plane ADDRESS (or use 'pagedserve serve')")
        children = []
        if not addresses:
            addresses, children = launch.spawn(args, num_replicas)
            cp.data_plane = addresses[0]
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
