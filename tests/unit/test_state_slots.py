"""State slots on the control plane (control_plane/state_slots.py through the block manager and the
scheduler) and on the wire: one slot per sequence with a table, none shared, admission waits for a
free one, a fork copies its parent's state into a slot of its own, and a preempted sequence gives its
slot back."""
import pytest

from control_plane.block_manager import BlockManager
from control_plane.scheduler import Finish, Fork, Scheduler
from control_plane.sequence import Sequence, SeqStatus
from control_plane.state_slots import StateSlots
from shared import protocol as P
from shared.protocol import StepResult
from tests.unit.test_scheduler import fake_step, make_seqs


def state_scheduler(num_slots: int, num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=True, num_state_slots=num_slots),
                     max_num_seqs, budget)


def test_slots_are_taken_given_back_and_forks_order_a_copy():
    slots = StateSlots(3)
    assert [slots.take(10), slots.take(11), slots.take(10)] == [0, 1, 0]
    assert slots.fork(10, 12) and slots.take_copies() == [(0, 2)] and slots.take_copies() == []
    assert slots.take(13) is None and not slots.fork(10, 13)     # all three held
    slots.give_back(11)
    assert slots.num_used == 2 and slots.usage() == pytest.approx(2 / 3)
    assert slots.fork(12, 14) and slots.held[14] == 1
    slots.give_back(14)                                          # gone before the plan: no copy
    assert slots.take_copies() == []
    slots.check_integrity({10, 12})
    with pytest.raises(AssertionError, match="disagree"):
        slots.check_integrity({10})


def test_the_block_manager_holds_a_slot_per_table_and_no_prefix_cache():
    bm = BlockManager(16, 4, enable_prefix_caching=True, num_state_slots=1)
    assert not bm.enable_prefix_caching          # a cached block holds KV, not the state after it
    assert bm.grow(1, 6) is not None and bm.state_slot(1) == 0
    free = bm.num_free_blocks()
    assert bm.grow(2, 4) is None                 # blocks are free, the one slot is not
    assert bm.num_free_blocks() == free and 2 not in bm.tables
    bm.free(1)
    assert bm.num_free_slots() == 1 and bm.grow(2, 4) is not None and bm.state_slot(2) == 0
    bm.check_integrity()
    assert BlockManager(16, 4).state_slot(3) == P.NO_STATE_SLOT


def test_a_swapped_sequence_takes_its_state_to_a_cpu_slot_and_back():
    bm = BlockManager(16, 4, num_cpu_blocks=8, num_state_slots=2)
    for seq_id in (1, 2):
        bm.grow(seq_id, 6)
    assert bm.can_swap_out([2]) and bm.swap_out([2])
    assert bm.take_state_swaps() == ([(1, 0)], []) and bm.take_state_swaps() == ([], [])
    bm.grow(3, 4)                                    # the freed device slot serves another sequence
    assert bm.state_slot(3) == 1 and bm.swap_in([2]) is None    # no device slot for it now
    bm.free(1)
    assert bm.swap_in([2]) is not None and bm.take_state_swaps() == ([], [(0, 0)])
    bm.check_integrity()
    assert not BlockManager(16, 4, num_state_slots=2).can_swap_out([1])   # no CPU pool: recompute


def test_admission_waits_for_a_free_slot_and_plans_carry_the_slots():
    sched = state_scheduler(num_slots=2)
    seqs = make_seqs(5, 5, 5, max_tokens=2)
    for s in seqs:
        sched.add(s)
    step = fake_step(sched)
    # blocks and budget for all three, slots for two
    assert [(n.seq_id, n.state_slot) for n in step.plan.new_seqs] == [(seqs[0].seq_id, 0), (seqs[1].seq_id, 1)]
    assert seqs[2].status is SeqStatus.WAITING
    sched.apply([Finish(seqs[0], "length")])
    step = fake_step(sched)
    assert [(n.seq_id, n.state_slot) for n in step.plan.new_seqs] == [(seqs[2].seq_id, 0)]
    assert sched.load().state_slots == 2 and sched.load().state_slots_used == 2


def test_a_fork_copies_the_parents_state_and_waits_when_no_slot_is_free():
    sched = state_scheduler(num_slots=2)
    (parent,) = make_seqs(6, max_tokens=4)
    sched.add(parent)
    fake_step(sched)
    kids = [Sequence(parent.request_id, list(parent.token_ids), parent.num_prompt_tokens, parent.params,
                     parent.spec, sample_index=j, arrival_time=parent.arrival_time) for j in (1, 2)]
    sched.apply([Fork(parent, kids[0]), Fork(parent, kids[1])])
    assert kids[0].status is SeqStatus.RUNNING and kids[1].status is SeqStatus.WAITING   # one slot was left
    plan = sched.schedule()
    assert plan.state_copies == [(sched.bm.state_slot(parent.seq_id), sched.bm.state_slot(kids[0].seq_id))]
    child = next(n for n in plan.new_seqs if n.seq_id == kids[0].seq_id)
    assert child.num_computed_tokens == 6 and child.state_slot == 1
    sched.update(plan, StepResult(plan.step_id))
    sched.check_integrity()


def test_a_preempted_sequence_gives_its_slot_back():
    # 5 blocks of 4 tokens: two 6-token prompts fit (2 blocks each, 1 kept free), their growth does not
    sched = state_scheduler(num_slots=2, num_blocks=5, budget=16)
    seqs = make_seqs(6, 6, max_tokens=8)
    for s in seqs:
        sched.add(s)
    for _ in range(6):
        step = fake_step(sched)
        if step.preempted:
            break
    assert step.preempted == [seqs[1]] and seqs[1].seq_id not in sched.bm.state_slots.held
    assert sched.load().state_slots_used == 1


def test_state_fields_on_the_wire():
    spec = P.SamplingSpec()
    new = P.NewSequence(4, [1, 2], 2, 0, 2, [0], spec, state_slot=3)
    plan = P.StepPlan(9, [new], state_copies=[(3, 5)])
    assert P.decode(P.encode(P.STEP_PLAN, plan)) == (P.STEP_PLAN, plan)
    swapped = P.StepPlan(10, state_swap_in=[(1, 2)])
    assert P.decode(P.encode(P.STEP_PLAN, swapped)) == (P.STEP_PLAN, swapped)
    plain = P.NewSequence(4, [1, 2], 2, 0, 2, [0], spec)
    assert len(plain.to_wire()) == 7 and len(P.StepPlan(9, [plain]).to_wire()) == 7   # nothing added unused
    with pytest.raises(P.ProtocolError, match="state slot"):
        P.NewSequence.from_wire(new.to_wire()[:7] + [-2])
