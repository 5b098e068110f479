"""shared/config.py: a spawned data plane gets the same configuration as the one that spawned it
(`pagedserve serve` passes its DataPlaneConfig on as a command line)."""
import argparse
import dataclasses

from shared.config import DataPlaneConfig, add_data_plane_args, add_model_args, data_plane_argv, data_plane_config


def _round_trip(config: DataPlaneConfig) -> DataPlaneConfig:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_data_plane_args(parser)
    parser.add_argument("--listen")
    args = parser.parse_args(data_plane_argv(config))
    return data_plane_config(args, args.listen)


def test_defaults_and_every_changed_setting_survive_the_command_line(tmp_path):
    model = str(tmp_path)   # a local model folder (only its path is checked here)
    base = DataPlaneConfig(model=model, listen="tcp://127.0.0.1:5555").validate()
    assert _round_trip(base) == base
    changed = dataclasses.replace(
        base, block_size=32, kv_cache_blocks=77, swap_blocks=5, max_model_len=300, num_threads=1,
        metrics_port=9100, lean_forward=False, gguf_codes=False, decode_graphs="eager")
    assert _round_trip(changed) == changed
