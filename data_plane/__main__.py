"""`python -m data_plane --listen ADDRESS ...`: the data-plane process (also `pagedserve data-plane`)."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from shared import config as C
    parser = argparse.ArgumentParser(prog="pagedserve data-plane", description="pagedserve data plane")
    C.add_settings(parser, C.DATA_PLANE)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s data-plane: %(message)s")
    try:
        config = C.data_plane_config(args, args.listen)
    except C.ConfigError as exc:
        print(f"pagedserve data-plane: {exc}", file=sys.stderr)
        return 2
    if config.tensor_parallel_size > 1:
        from data_plane import tp_launch
        return tp_launch.main(config, sys.argv[1:] if argv is None else argv)
    import torch
    from data_plane import collector
    from data_plane.model_runner import ModelRunner, load_model, resolve_device
    from data_plane.worker import Worker
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    log = logging.getLogger("pagedserve.data_plane")
    log.info("loading %s (%s) on %s", config.model, config.dtype, device)
    collector.hold()
    try:
        model = load_model(config, device)   # refuses a model it cannot serve exactly
        runner = ModelRunner(model, config, device)
    except C.ConfigError as exc:   # that refusal, or settings only the device can refuse (block size with Triton)
        print(f"pagedserve data-plane: {exc}", file=sys.stderr)
        return 2
    from data_plane import metrics
    stats = metrics.DataPlaneStats(runner.handshake())
    metrics.start_metrics_server(stats, config.metrics_port, metrics.metrics_host(config.listen))
    with collector.serving():
        Worker(runner, config.listen, stats, curve_keys=config.curve_keys).serve_forever()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
