"""The data plane's runner refuses what it cannot run: a plan naming unknown sequences, block ids or
token ids out of range, and block size 4 on the Triton path."""
import pytest

from data_plane.model_runner import PlanError
from shared.protocol import CachedSequence, StepPlan
from tests.helpers import make_runner, paged_model


def test_runner_refuses_out_of_range_blocks_and_unknown_sequences():
    runner = make_runner(paged_model(seed=0), num_blocks=8)
    with pytest.raises(PlanError):
        runner.execute(StepPlan(1, cached_seqs=[CachedSequence(123, 1)]))
    from shared.protocol import NewSequence, SamplingSpec
    with pytest.raises(PlanError):
        runner.execute(StepPlan(2, new_seqs=[NewSequence(1, [1, 2], 2, 0, 2, [99], SamplingSpec())]))
    with pytest.raises(PlanError):
        runner.execute(StepPlan(3, new_seqs=[NewSequence(2, [1, 10_000], 2, 0, 2, [0], SamplingSpec())]))


def test_block_size_4_is_refused_on_the_triton_path(monkeypatch):
    from shared.config import ConfigError
    monkeypatch.setenv("PAGEDSERVE_TRITON", "1")
    with pytest.raises(ConfigError, match="for the CPU path"):
        make_runner(paged_model(seed=0), block_size=4)
