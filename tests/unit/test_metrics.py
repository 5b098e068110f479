"""EngineStats and DataPlaneStats on fake steps: what each hook counts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from control_plane.metrics import EngineStats
from data_plane import metrics as dpm
from control_plane.scheduler import SchedulerLoad
from shared.protocol import CachedSequence, NewSequence, SamplingSpec, StepPlan, StepResult
from tests.helpers import handshake

MODEL = "m"


def value(registry, name: str, **labels) -> float:
    v = registry.get_sample_value(name, {"model_name": MODEL, **labels})
    assert v is not None, f"{name} {labels} is not exported"
    return v


def fake_seq(seq_id: int, arrival: float, num_prompt: int = 5, num_output: int = 0):
    return SimpleNamespace(seq_id=seq_id, arrival_time=arrival, num_prompt_tokens=num_prompt,
                           num_output_tokens=num_output)


def fake_load(running=0, waiting=0, usage=0.5, **rest):
    fields = {"swapped": 0, "cpu_kv_usage": 0.0, "num_cow_copies": 0, "num_shared_blocks": 0, "prefix_queries": 0,
              "prefix_hits": 0, **rest}
    return SchedulerLoad(running=running, waiting=waiting, kv_usage=usage, **fields)


def test_a_request_from_arrival_to_finish(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("control_plane.metrics.time.monotonic", lambda: clock[0])
    stats = EngineStats(MODEL)
    r = stats.registry
    seq = fake_seq(1, arrival=100.0)
    stats.on_arrival(5)
    clock[0] = 102.0
    before = dict(vars(seq))
    stats.on_step([seq], 0.5, fake_load(running=1, waiting=2, usage=0.25))
    assert vars(seq) == before                  # metrics read the sequence, never write it
    assert value(r, "pagedserve_request_queue_time_seconds_count") == 1
    assert value(r, "pagedserve_request_queue_time_seconds_sum") == 1.5
    assert value(r, "pagedserve_num_requests_running") == 1
    assert value(r, "pagedserve_num_requests_waiting") == 2
    assert value(r, "pagedserve_kv_cache_usage_perc") == 0.25
    stats.on_token(seq, first=True)
    clock[0] = 102.25
    seq.num_output_tokens = 1
    stats.on_token(seq, first=False)
    seq.num_output_tokens = 2
    clock[0] = 103.0
    stats.on_step([seq], 0.1, fake_load())    # already scheduled: no second queue time
    stats.on_finish(seq, "length")
    assert value(r, "pagedserve_request_queue_time_seconds_count") == 1
    assert value(r, "pagedserve_time_to_first_token_seconds_sum") == 2.0
    assert value(r, "pagedserve_inter_token_latency_seconds_sum") == 0.25
    assert value(r, "pagedserve_e2e_request_latency_seconds_sum") == 3.0
    assert value(r, "pagedserve_request_prompt_tokens_sum") == 5
    assert value(r, "pagedserve_request_generation_tokens_sum") == 2
    assert value(r, "pagedserve_generation_tokens_total") == 2
    assert value(r, "pagedserve_prompt_tokens_total") == 5
    assert value(r, "pagedserve_requests_received_total") == 1
    assert value(r, "pagedserve_request_success_total", finished_reason="length") == 1
    assert value(r, "pagedserve_request_success_total", finished_reason="stop") == 0
    assert value(r, "pagedserve_step_duration_seconds_count") == 2
    assert stats.take_generated() == 2 and stats.take_generated() == 0


def test_forked_samples_add_no_queue_time():
    stats = EngineStats(MODEL)
    child = fake_seq(2, arrival=0.0, num_output=1)     # forked after its parent's first token
    stats.on_step([child], 0.1, fake_load())
    stats.on_step([child], 0.1, fake_load())
    assert value(stats.registry, "pagedserve_request_queue_time_seconds_count") == 0


def test_preemptions_swap_and_prefix_cache():
    stats = EngineStats(MODEL)
    r = stats.registry
    # the scheduler's cumulative preemption counts are turned into increments, step after step
    stats.on_step([], 0.1, fake_load(num_preemptions=2))
    stats.on_step([], 0.1, fake_load(num_preemptions=2, num_swap_preemptions=1))
    stats.on_swap(num_blocks_out=3, num_blocks_in=1)
    assert value(r, "pagedserve_num_preemptions_total", kind="recompute") == 2
    assert value(r, "pagedserve_num_preemptions_total", kind="swap") == 1
    assert value(r, "pagedserve_swap_blocks_total", direction="out") == 3
    assert value(r, "pagedserve_swap_blocks_total", direction="in") == 1
    # the block manager's cumulative prefix counters are turned into increments, step after step
    stats.on_step([], 0.1, fake_load(prefix_queries=40, prefix_hits=16))
    stats.on_step([], 0.1, fake_load(prefix_queries=40, prefix_hits=16))
    stats.on_step([], 0.1, fake_load(prefix_queries=100, prefix_hits=48))
    assert value(r, "pagedserve_prefix_cache_queries_total") == 100
    assert value(r, "pagedserve_prefix_cache_hits_total") == 48


def test_swapped_queue_and_cpu_pool_are_read_when_present():
    stats = EngineStats(MODEL)
    stats.on_step([], 0.1, fake_load(cpu_kv_usage=0.75, swapped=2))
    assert value(stats.registry, "pagedserve_num_requests_swapped") == 2
    assert value(stats.registry, "pagedserve_cpu_kv_cache_usage_perc") == 0.75


def test_an_unknown_finish_reason_is_still_counted():
    stats = EngineStats(MODEL)
    stats.on_finish(fake_seq(1, 0.0), "timeout")
    assert value(stats.registry, "pagedserve_request_success_total", finished_reason="timeout") == 1


# --- data plane ---------------------------------------------------------------------------------
def new_seq(seq_id: int, num_new: int) -> NewSequence:
    return NewSequence(seq_id, [1] * num_new, num_new, 0, num_new, [0], SamplingSpec())


def test_data_plane_step_swap_and_copies():
    hs = handshake(model_id="/x/m.gguf", num_cpu_blocks=4)
    stats = dpm.DataPlaneStats(hs)
    r = stats.registry
    block = stats.block_bytes
    assert block == 30 * 2 * 16 * 3 * 64 * 4
    plan = StepPlan(1, new_seqs=[new_seq(1, 7)], cached_seqs=[CachedSequence(2, 1)], swap_out=[(1, 0), (2, 1), (3, 2)],
                    swap_in=[(0, 5)], copies=[(4, 6)])
    stats.on_step(plan, StepResult(1, num_tokens=8, forward_seconds=0.3, swap_seconds=0.04), 0.5)
    assert value(r, "pagedserve_data_plane_step_duration_seconds_sum") == 0.5
    assert value(r, "pagedserve_data_plane_forward_duration_seconds_sum") == 0.3
    assert value(r, "pagedserve_data_plane_step_tokens_sum") == 8
    assert value(r, "pagedserve_data_plane_step_sequences_sum") == 2
    assert value(r, "pagedserve_data_plane_swap_bytes_total", direction="out") == 3 * block
    assert value(r, "pagedserve_data_plane_swap_bytes_total", direction="in") == block
    assert value(r, "pagedserve_data_plane_swap_duration_seconds_sum", direction="out") == pytest.approx(0.03)
    assert value(r, "pagedserve_data_plane_swap_duration_seconds_sum", direction="in") == pytest.approx(0.01)
    assert value(r, "pagedserve_data_plane_blocks_copied_total") == 1
    assert value(r, "pagedserve_data_plane_kv_pool_bytes", pool="cpu") == 4 * block
    stats.on_step(StepPlan(2, new_seqs=[new_seq(3, 2)]), StepResult(2, error="bad plan"), 0.01)
    assert value(r, "pagedserve_data_plane_step_errors_total") == 1
    assert value(r, "pagedserve_data_plane_step_tokens_count") == 1    # a failed step computed nothing
    text = generate_latest(r).decode()
    assert 'pagedserve_data_plane_kv_pool_info{block_bytes="%d",block_size="16"' % block in text


@pytest.mark.parametrize("listen, host", [
    ("tcp://127.0.0.1:5555", "127.0.0.1"), ("tcp://0.0.0.0:5555", "0.0.0.0"), ("tcp://*:5555", "0.0.0.0"),
    ("tcp://localhost:5555", "127.0.0.1"), ("tcp://[::1]:5555", "::1"), ("ipc:///tmp/dp.sock", "127.0.0.1"),
    ("tcp://eth0:5555", "0.0.0.0")])
def test_metrics_bind_where_the_data_plane_listens(listen, host):
    assert dpm.metrics_host(listen) == host


def test_a_taken_metrics_port_is_not_fatal(caplog):
    import socket
    stats = dpm.DataPlaneStats(handshake())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert dpm.start_metrics_server(stats, port, "127.0.0.1") is False
    assert "metrics server NOT started" in caplog.text
    assert dpm.start_metrics_server(stats, 0, "127.0.0.1") is False     # 0: off


def test_copy_on_write_and_shared_blocks_follow_the_block_manager():
    stats = EngineStats("m")
    stats.on_step([], 0.01, fake_load(num_cow_copies=3, num_shared_blocks=2))
    stats.on_step([], 0.01, fake_load(num_cow_copies=5, num_shared_blocks=0))
    r = stats.registry
    assert value(r, "pagedserve_kv_block_copies_total") == 5
    assert value(r, "pagedserve_kv_blocks_shared") == 0


def test_blocks_freed_by_the_window_follow_the_block_manager():
    stats = EngineStats("m")
    assert value(stats.registry, "pagedserve_kv_blocks_freed_by_window_total") == 0   # exported from the start
    stats.on_step([], 0.01, fake_load(num_window_freed=3))
    stats.on_step([], 0.01, fake_load(num_window_freed=7))
    assert value(stats.registry, "pagedserve_kv_blocks_freed_by_window_total") == 7
