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


@pytest.mark.parametrize("lean_forward", [True, False], ids=["lean-forward", "transformers-forward"])
def test_a_step_runs_on_the_backend_chosen_at_start(monkeypatch, lean_forward):
    """The attention and cache ops' implementation is decided once, when the runner starts: a step asks
    no one again (the setting's reader raises here once the runner is up)."""
    from ops import attention as attention_ops
    from shared.protocol import NewSequence, SamplingSpec
    runner = make_runner(paged_model(seed=0), num_blocks=8, lean_forward=lean_forward)
    assert runner.backend == attention_ops.choose(runner.device, runner.dtype)

    def asked(*_):
        raise AssertionError("the backend was chosen again during a step")
    monkeypatch.setattr(attention_ops, "use_triton", asked)
    spec = SamplingSpec(temperature=0.0)
    first = runner.execute(StepPlan(1, new_seqs=[NewSequence(1, [1, 2, 3], 3, 0, 3, [0], spec)],
                                    copies=[(0, 1)]))
    assert [s.seq_id for s in first.sampled] == [1]
