from control_plane.block_manager import BlockManager
from control_plane.sampling_params import SamplingParams
from control_plane.scheduler import Finish, Scheduler, is_empty
from control_plane.sequence import Sequence, SeqStatus
from shared.protocol import StepResult


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                   caching=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=caching), max_num_seqs,
                     max_num_batched_tokens)


def make_seqs(*prompt_lens, max_tokens=8) -> list[Sequence]:
    seqs = []
    for i, n in enumerate(prompt_lens):
        params = SamplingParams(max_tokens=max_tokens)
        seqs.append(Sequence(f"r{i}", list(range(1, n + 1)), n, params, params.spec([]), arrival_time=float(i)))
    return seqs


class Step:
    """A step's plan and what it did to the queues: the sequences it dropped for recompute (the
    preempted) and the request ids of the sequences it scheduled, by seq id."""

    def __init__(self, sched: Scheduler, plan):
        self.plan = plan
        self.names = {s.seq_id: s.request_id for s in sched.running}
        self.preempted = [s for s in sched.waiting if s.seq_id in plan.forget_seq_ids]


def fake_step(sched: Scheduler, token: int = 7) -> Step:
    """Schedules one step and plays the data plane: every sequence whose tokens are all computed
    gets one sampled token, as the engine would append it."""
    plan = sched.schedule()
    step = Step(sched, plan)
    for seq in sched.update(plan, StepResult(plan.step_id)):
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)
    sched.check_integrity()
    return step


def scheduled(step: Step):
    """(request id, tokens, blocks, sent in full) per scheduled sequence, in plan order: the new
    sequences with their whole table, then the cached ones with the blocks added to theirs."""
    names = step.names
    return ([(names[s.seq_id], s.num_new_tokens, s.block_ids, True) for s in step.plan.new_seqs]
            + [(names[s.seq_id], s.num_new_tokens, s.new_block_ids, False) for s in step.plan.cached_seqs])


def test_prefill_then_decode_share_one_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = make_seqs(10, 5)
    sched.add(a)
    sched.add(b)
    out = fake_step(sched)
    # a takes 10 tokens (blocks 0-2), b gets the remaining 6 of budget, needs 5 (blocks 3-4)
    assert scheduled(out) == [("r0", 10, [0, 1, 2], True), ("r1", 5, [3, 4], True)]
    out = fake_step(sched)
    # b's 6th token still fits its 2 blocks
    assert scheduled(out) == [("r0", 1, [], False), ("r1", 1, [], False)]


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    sched = make_scheduler(max_num_batched_tokens=8)
    (a,) = make_seqs(20)
    sched.add(a)
    chunks = [scheduled(fake_step(sched))[0][1] for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert a.num_output_tokens == 1        # sampled only after the last chunk
    assert scheduled(fake_step(sched)) == [("r0", 1, [5], False)]   # token 21 opens a sixth block


def test_decodes_go_first_and_new_prompts_fill_the_rest():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b, c = make_seqs(4, 4, 12)
    for s in (a, b):
        sched.add(s)
    fake_step(sched)
    sched.add(c)
    out = fake_step(sched)
    assert [(r, n) for r, n, _, _ in scheduled(out)] == [("r2", 6), ("r0", 1), ("r1", 1)]   # new ones first


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    for s in make_seqs(3, 3, 3):
        sched.add(s)
    out = fake_step(sched)
    assert [r for r, *_ in scheduled(out)] == ["r0", "r1"]
    assert len(sched.waiting) == 1


def test_preemption_takes_the_latest_arrival_and_it_resumes_from_scratch():
    # 6 blocks of 4 tokens; two prompts of 8 fill 4 blocks, growth needs more
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, caching=False)
    a, b = make_seqs(8, 8)
    sched.add(a)
    sched.add(b)
    sched.watermark_blocks = 0
    fake_step(sched)                       # both prefilled (blocks 0-1 and 2-3), one token each
    out = fake_step(sched)                 # token 9 of each needs a third block: 4, 5
    assert scheduled(out) == [("r0", 1, [4], False), ("r1", 1, [5], False)]
    for _ in range(3):
        fake_step(sched)                   # 12 tokens fill three blocks each
    out = fake_step(sched)                 # token 13 of a needs a block: b (latest arrival) gives way
    assert [s.request_id for s in out.preempted] == ["r1"]
    assert out.plan.forget_seq_ids == [b.seq_id]
    assert scheduled(out) == [("r0", 1, [5], False)]   # b's last block freed first, reused first
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert b.num_tokens == 13              # its generated tokens stay: it recomputes them later
    sched.finish(a, "stop")
    out = fake_step(sched)
    assert scheduled(out) == [("r1", 13, [3, 2, 5, 4], True)]  # reverse-freed order
    sched.finish(b, "stop")
    assert sched.bm.num_free_blocks() == 6


def test_a_sequence_preempts_itself_when_it_is_the_latest():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    sched.watermark_blocks = 0
    a, b = make_seqs(8, 7)
    sched.add(a)
    sched.add(b)
    fake_step(sched)      # a: blocks 0,1 ; b: blocks 2,3 ; b now has 8 tokens (fits)
    out = fake_step(sched)  # a needs a third block: b gives way; b is after a, so a is scheduled
    assert [s.request_id for s in out.preempted] == ["r1"]
    assert [r for r, *_ in scheduled(out)] == ["r0"]


def test_finish_frees_blocks_and_tells_the_data_plane_to_forget():
    sched = make_scheduler()
    (a,) = make_seqs(6)
    sched.add(a)
    fake_step(sched)
    sched.finish(a, "length")
    assert sched.bm.num_free_blocks() == 64
    plan = sched.schedule()
    assert plan.forget_seq_ids == [a.seq_id] and not plan.new_seqs and not plan.cached_seqs
    assert not sched.has_work()


def test_abort_of_a_waiting_sequence_needs_no_forget():
    sched = make_scheduler()
    (a,) = make_seqs(6)
    sched.add(a)
    sched.finish(a, "abort")
    assert not sched.has_work()
    assert is_empty(sched.schedule())


def test_preempted_sequence_resumes_from_its_cached_blocks():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    sched.watermark_blocks = 0
    a, b = make_seqs(8, 8)
    b.token_ids = [20 + t for t in b.token_ids]      # different prompts: no sharing between a and b
    sched.add(a)
    sched.add(b)
    for _ in range(5):
        fake_step(sched)
    out = fake_step(sched)
    assert [s.request_id for s in out.preempted] == ["r1"]
    sched.finish(a, "stop")                           # a's blocks go back to the free list
    out = fake_step(sched)
    # b's first two blocks (its prompt) survived in the cache: only its third block is recomputed
    assert [(r, n) for r, n, _, _ in scheduled(out)] == [("r1", 5)]
    assert sched.bm.prefix_hits == 8


def test_shared_prompt_is_computed_once():
    sched = make_scheduler(max_num_batched_tokens=64)
    a, b = make_seqs(10, 10)
    sched.add(a)
    fake_step(sched)
    sched.add(b)
    out = fake_step(sched)
    assert [(r, n) for r, n, _, _ in scheduled(out)] == [("r1", 2), ("r0", 1)]   # 8 of 10 from cache
    assert sched.bm.block_ids(b.seq_id)[:2] == sched.bm.block_ids(a.seq_id)[:2]


def test_the_lowest_priority_gives_way_before_a_later_arrival():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, caching=False)
    sched.watermark_blocks = 0
    a, b = make_seqs(8, 8)
    a.params = SamplingParams(max_tokens=8, priority=5)   # a arrived first but matters less
    sched.add(a)
    sched.add(b)
    for _ in range(8):
        out = fake_step(sched)
        if out.preempted:
            break
    assert [s.request_id for s in out.preempted] == ["r0"]
    assert [r for r, *_ in scheduled(out)] == ["r1"]


def test_schedule_records_what_its_plan_tells_the_data_plane():
    sched = make_scheduler()
    (a,) = make_seqs(6)
    sched.add(a)
    plan = sched.schedule()
    assert [(s.seq_id, s.token_ids, s.num_computed_tokens, s.num_new_tokens) for s in plan.new_seqs] == [
        (a.seq_id, [1, 2, 3, 4, 5, 6], 0, 6)]          # the plan holds what was true before it
    assert a.known_to_data_plane and a.num_tokens_sent == 6 and a.num_computed_tokens == 6
    assert sched.update(plan, StepResult(plan.step_id)) == [a]
    a.token_ids.append(7)
    plan = sched.schedule()
    assert not plan.new_seqs and [(c.seq_id, c.num_new_tokens) for c in plan.cached_seqs] == [(a.seq_id, 1)]
    assert sched.update(plan, StepResult(plan.step_id, error="boom")) == [a]
    sched.apply([Finish(a, "error")])
    assert a.is_finished and sched.schedule().forget_seq_ids == [a.seq_id]


def test_restart_on_a_larger_pool_renews_the_watermark():
    sched = make_scheduler(num_blocks=64)
    assert sched.watermark_blocks == 1
    sched.restart(BlockManager(1000, 4))
    assert sched.watermark_blocks == 10


def test_group_blocks_counts_a_shared_prefix_once_and_a_window_at_most():
    bm = BlockManager(64, 4)
    parent = list(range(1, 26))                  # 25 tokens: 7 blocks
    twin, other = parent[:], parent[:20] + [99] * 5
    assert bm.group_blocks([parent, twin], chunk=8) == 7 + 1     # 6 full blocks shared; its last one is its own
    assert bm.group_blocks([parent, other], chunk=8) == 7 + 2    # 20 common tokens: 5 blocks shared
    assert BlockManager(64, 4, enable_prefix_caching=False).group_blocks([parent, twin], chunk=8) == 14
    # a window of 8 with chunks of 4: a query and a chunk read at most 12 positions, 3 blocks, + 1 straddling
    assert BlockManager(64, 4, enable_prefix_caching=False, sliding_window=8).group_blocks([parent, twin], 4) == 8


def test_a_preempted_pair_of_samples_comes_back_in_a_pool_too_small_for_two_whole_copies():
    # 10 blocks of 4; two samples of one request at 33 and 29 tokens would need 9 + 8 blocks unshared, and
    # 9 + 1 with the shared prefix: more than the pool less its watermark. With nothing else running the
    # pair is admitted (it waited forever before), and its prompt is computed once
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, n=2)
    parent = Sequence("r0", list(range(1, 34)), 20, params, params.spec([]))
    child = Sequence("r0", list(range(1, 30)), 20, params, params.spec([], draw=1), sample_index=1)
    assert sched.bm.group_blocks([parent.token_ids, child.token_ids], 64) + sched.watermark_blocks > 10
    sched.requeue_front([parent, child])
    out = fake_step(sched)
    assert [(r, n, whole) for r, n, _, whole in scheduled(out)] == [("r0", 33, True)]
    assert parent.status is child.status is SeqStatus.RUNNING
    out = fake_step(sched)    # the child matches the parent's 7 full blocks and computes the rest
    assert [(r, n) for r, n, _, _ in scheduled(out)] == [("r0", 1), ("r0", 1)]
