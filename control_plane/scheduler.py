"""Continuous batching under one token budget.

Every sequence tracks num_computed_tokens against num_tokens; a step gives each scheduled
sequence some of its uncomputed tokens. A prompt is a sequence with many uncomputed tokens
(prefilled in chunks when it does not fit the budget), a decoding sequence has one (the
token sampled last step). Each step:

  1. running sequences, oldest arrival first, take what they need from the budget; a
     sequence that cannot get a block makes the lowest-priority, then latest-arriving, running request
     give way (see preemption.py): swapped out to the CPU pool (it keeps its computed
     tokens) or dropped for recompute (its blocks are freed, it goes back to the front of
     the waiting queue and later recomputes prompt and outputs);
  2. if nothing was preempted, swapped requests come back first (swap-in), oldest first;
  3. then, if none is left swapped, waiting sequences are admitted in order while budget,
     batch size and free blocks (above a small watermark) allow. A request preempted whole (parallel
     samples, beams) comes back whole, when the blocks it will hold are free (BlockManager.group_blocks:
     a prefix shared once, a window's worth at most) or nothing else runs; its first sequence
     computes, the others then share its cached prefix.

The step is two calls, as in vLLM V1. schedule() returns the StepPlan to send and records at once
what it tells the data plane (_update_after_schedule): its sequences count the tokens it computes as
computed. update(plan, result) applies the result: the blocks it filled join the prefix cache; then
apply() carries out what the output processor decided about the sampled tokens (a sequence ends, a
sample or beam forks). Nothing else changes the queues. With overlap on, the next step is planned while the data plane still runs this one: a sequence that
this step samples, and whose next step does not depend on the token drawn, counts that token as
pending (Sequence.num_pending_tokens) and is planned one token ahead; the data plane appended the
token itself. A sequence whose next step needs the token first (a beam: the control plane
chooses it; the first token of n > 1 samples: they fork; structured output: its next mask follows
from it) or that surely ends with it (max_tokens) sits out one step. A sequence that turns out to
have ended (a stop, an abort) is forgotten by the following plan and the token computed for it is
dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from control_plane.block_manager import BlockManager, Growth
from control_plane.preemption import PreemptionPolicy
from control_plane.sequence import Sequence, SeqStatus
from shared.protocol import CachedSequence, NewSequence, StepPlan, StepResult

WATERMARK_FRACTION = 0.01  # blocks kept free at admission so running sequences can grow


def watermark_of(bm: BlockManager) -> int:
    return max(1, int(WATERMARK_FRACTION * bm.pool.num_blocks))


def run_order(seq: Sequence) -> tuple:
    """Priority, then arrival; the sequences of one request stay together."""
    return seq.params.priority, seq.arrival_time, seq.request_id, seq.sample_index


@dataclass
class _Scheduled:
    """One sequence's share of a step, kept until the step's result is applied."""
    seq: Sequence
    num_new_tokens: int
    growth: Growth             # blocks appended to its table this step, copy-on-write copies
    is_new: bool               # the data plane does not know it: send it in full
    predicted: bool = False    # the token this step samples counts as pending (overlap)


@dataclass
class Finish:
    """The output processor's decision: `seq` ends with `reason` (stop, length, abort, error...)."""
    seq: Sequence
    reason: str


@dataclass
class Fork:
    """A parallel sample or beam `child` starts from `parent`: it shares the parent's blocks when the
    parent runs, and is queued for recompute when the parent waits (preempted)."""
    parent: Sequence
    child: Sequence


@dataclass
class SchedulerLoad:
    """The queues and pools at one moment: what metrics and the API read of a scheduler."""
    running: int                   # sequences in the running batch
    waiting: int                   # sequences waiting to be admitted (or recomputed)
    swapped: int                   # requests swapped out to the CPU pool
    kv_usage: float                # fraction of device blocks in use
    cpu_kv_usage: float            # fraction of CPU swap-pool blocks in use (0: no pool)
    num_cow_copies: int            # copy-on-write copies so far
    num_shared_blocks: int         # device blocks referenced by more than one sequence now
    prefix_queries: int            # prompt tokens looked up in the prefix cache so far
    prefix_hits: int               # of which found
    num_window_freed: int = 0      # blocks given back so far because they left every layer's window
    num_preemptions: int = 0       # sequences dropped for recompute so far
    num_swap_preemptions: int = 0  # sequences swapped out so far
    state_slots: int = 0           # slots of the state pool (a model with state layers; 0: none)
    state_slots_used: int = 0      # of which held by a sequence


@dataclass
class _Step:
    """What schedule() is deciding: the plan and the sequences it schedules."""
    plan: StepPlan
    scheduled: list[_Scheduled] = field(default_factory=list)
    evicted: bool = False      # a request gave way this step: nothing swapped in or admitted


def is_empty(plan: StepPlan) -> bool:
    """Whether a plan does nothing the data plane must do now (it need not be sent)."""
    return not (plan.new_seqs or plan.cached_seqs or plan.forget_seq_ids or plan.swap_out or plan.state_copies)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: PreemptionPolicy | None = None, overlap: bool = False):
        self.bm = block_manager
        self.overlap = overlap      # plans may be sent before the previous step's result (see the top)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy or PreemptionPolicy("recompute", 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[list[Sequence]] = deque()   # groups of sequences of one request
        self.num_swap_preemptions = 0
        self._forget: list[int] = []          # seq ids the data plane should drop at the next plan
        self.num_preemptions = 0
        self.watermark_blocks = watermark_of(block_manager)
        self._step_id = 0
        self._sent: dict[int, list[_Scheduled]] = {}   # step id -> what it scheduled, until update()

    # --- queues ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._forget)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (stop, length, abort, error) wherever it is and frees its blocks."""
        self._remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _remove(self, seq: Sequence) -> None:
        """Out of its queue, blocks freed, forgotten by the data plane."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            group = next(g for g in self.swapped if seq in g)
            group.remove(seq)
            if not group:
                self.swapped.remove(group)
        self.bm.free(seq.seq_id)
        if seq.known_to_data_plane:
            self._forget.append(seq.seq_id)
            seq.known_to_data_plane = False

    def set_aside(self, seqs: list[Sequence]) -> None:
        """Takes live sequences out of every queue to be recomputed later (requeue_front brings them
        back): their blocks are freed and the data plane forgets them; they keep their tokens."""
        for seq in seqs:
            self._remove(seq)
            seq.status, seq.finish_reason, seq.num_computed_tokens = SeqStatus.WAITING, None, 0

    def requeue_front(self, seqs: list[Sequence]) -> None:
        """Sequences (one request's) go to the head of the waiting queue, in order, to be recomputed."""
        self.set_aside(seqs)
        for seq in reversed(seqs):
            self.waiting.appendleft(seq)

    def apply(self, decisions: list) -> None:
        """Carries out, in order, what the output processor decided (Finish, Fork)."""
        for d in decisions:
            if isinstance(d, Finish):
                self.finish(d.seq, d.reason)
            elif d.parent.status is SeqStatus.RUNNING and self.bm.can_fork():
                self.bm.fork(d.parent.seq_id, d.child.seq_id)   # shares every block, copy-on-write
                d.child.num_computed_tokens = d.parent.num_computed_tokens
                d.child.status = SeqStatus.RUNNING
                self.running.append(d.child)
            else:
                # the parent was preempted (or no state slot is free for the child's copy of its
                # state): the child is recomputed
                self.add(d.child)

    def _group_at(self, index: int) -> list[Sequence]:
        """The running sequences of one request (parallel samples, beams): contiguous once sorted."""
        request_id = self.running[index].request_id
        end = index
        while end < len(self.running) and self.running[end].request_id == request_id:
            end += 1
        return self.running[index:end]

    def _last_group(self) -> list[Sequence]:
        start = len(self.running) - 1
        while start > 0 and self.running[start - 1].request_id == self.running[-1].request_id:
            start -= 1
        return self.running[start:]

    def _blocks_wanted(self, group: list[Sequence], budget: int) -> int:
        wanted = 0
        for seq in group:
            num_new = min(seq.num_expected_tokens - seq.num_computed_tokens, budget)
            budget -= num_new
            if num_new:
                wanted += self.bm.blocks_to_grow(seq.seq_id, seq.num_computed_tokens + num_new,
                                                 write_from=seq.num_computed_tokens)
        return wanted

    def _lacks_room(self, group: list[Sequence], budget: int) -> bool:
        """Whether the request cannot take its share of this step: blocks, and state slots for its
        sequences that have no table yet (a model with state layers)."""
        if self._blocks_wanted(group, budget) > self.bm.num_free_blocks():
            return True
        return sum(self.bm.slots_to_grow(s.seq_id) for s in group) > self.bm.num_free_slots()

    def _evict(self, group: list[Sequence], step: _Step) -> None:
        """A whole request gives its blocks back: swapped out, or dropped for recompute. Never only
        part of it: a beam or sample left behind would hold blocks while waiting for the others."""
        step.evicted = True
        seq_ids = [s.seq_id for s in group]
        mode = self.policy.choose(group, self.bm.num_blocks_of(seq_ids), self.bm.can_swap_out(seq_ids))
        if mode == "swap":
            self._swap_out(group, step.plan)
        else:
            for seq in reversed(group):   # appendleft in reverse keeps the group in order
                self._preempt(seq, step.plan)

    def _swap_out(self, group: list[Sequence], plan: StepPlan) -> None:
        plan.swap_out.extend(self.bm.swap_out([s.seq_id for s in group]))
        for seq in group:
            self.running.remove(seq)
            seq.status = SeqStatus.SWAPPED
            if seq.known_to_data_plane:   # it is sent in full again, with its new blocks, at swap-in
                plan.forget_seq_ids.append(seq.seq_id)
                seq.known_to_data_plane = False
        self.swapped.append(group)
        self.num_swap_preemptions += len(group)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        if seq.known_to_data_plane:
            plan.forget_seq_ids.append(seq.seq_id)
            seq.known_to_data_plane = False
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # --- one step -------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Decides the next step and returns its plan, already recorded as sent (see the top)."""
        self._step_id += 1
        step = _Step(StepPlan(self._step_id, forget_seq_ids=self._forget))
        self._forget = []
        budget = self.max_num_batched_tokens
        # most important first; the last request in this order is the first to give way
        self.running.sort(key=run_order)
        i = 0
        while i < len(self.running) and budget > 0:
            group = self._group_at(i)
            for seq in group[1:]:
                if seq.seq_id not in self.bm.tables and not seq.num_computed_tokens and \
                        not seq.wants_prompt_logprobs:
                    # the rest of a request admitted again whole: it shares what the first computed
                    seq.num_computed_tokens = self.bm.match_prefix(seq.seq_id, seq.token_ids)
            # room for the whole request first; the latest-arriving request gives way, whole
            while self._lacks_room(group, budget):
                victim = self._last_group()
                self._evict(victim, step)
                if victim[0] is group[0]:
                    break
            if group[0].status is not SeqStatus.RUNNING:
                continue   # the group itself gave way; running[i] is now the next request
            for seq in group:
                num_new = min(seq.num_expected_tokens - seq.num_computed_tokens, budget)
                if num_new == 0:
                    continue   # waits for a token (a beam, a sample to fork; overlap), or no budget left
                growth = self._grow(seq, num_new)
                assert growth is not None, "room was made for the whole group"
                step.scheduled.append(_Scheduled(seq, num_new, growth, not seq.known_to_data_plane))
                budget -= num_new
            i += len(group)
        if not step.evicted:
            budget = self._swap_in(step, budget)
            if not self.swapped:
                self._admit(step, budget)
        self._write_plan(step)
        self._update_after_schedule(step)
        return step.plan

    def _write_plan(self, step: _Step) -> None:
        """What the data plane needs of each scheduled sequence, read before _update_after_schedule
        moves the counters."""
        plan = step.plan
        if self.bm.state_slots is not None:   # forks since the last plan, swaps in this one: their states
            plan.state_copies = self.bm.state_slots.take_copies()
            plan.state_swap_out, plan.state_swap_in = self.bm.take_state_swaps()
        for s in step.scheduled:
            seq = s.seq
            plan.copies.extend((src, dst) for _, src, dst in s.growth.copies)
            if s.is_new:
                # sent once in full: every known token (outputs too, after a recompute preemption)
                plan.new_seqs.append(NewSequence(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                                                 seq.num_computed_tokens, s.num_new_tokens,
                                                 self.bm.block_ids(seq.seq_id), seq.spec,
                                                 self.bm.state_slot(seq.seq_id)))
            else:
                # a beam's tokens are chosen here: send those the data plane does not have yet (any
                # other sequence's new token was sampled, and appended, by the data plane itself)
                tokens = seq.token_ids[seq.num_tokens_sent:] if seq.spec.beam_width else []
                plan.cached_seqs.append(CachedSequence(seq.seq_id, s.num_new_tokens, list(s.growth.new_block_ids),
                                                       tokens, [(index, dst) for index, _, dst in s.growth.copies]))

    def _update_after_schedule(self, step: _Step) -> None:
        """The plan is sent: the data plane now knows every scheduled sequence and every token the
        plan carried, and computes what it scheduled (the one place these are recorded). With
        overlap, a token it samples may be counted as pending (see the top)."""
        for s in step.scheduled:
            seq = s.seq
            seq.known_to_data_plane = True
            seq.num_tokens_sent = seq.num_tokens
            seq.num_computed_tokens += s.num_new_tokens
            if self.overlap and seq.num_computed_tokens == seq.num_expected_tokens and self._plans_ahead(seq):
                seq.num_pending_tokens += 1
                s.predicted = True
        if step.scheduled:
            self._sent[step.plan.step_id] = step.scheduled

    @staticmethod
    def _plans_ahead(seq: Sequence) -> bool:
        """Whether the step after this one can be planned before the token this one samples is known."""
        if seq.spec.beam_width:
            return False        # the control plane chooses a beam's next token from the result
        if seq.params.constraint is not None:
            return False        # the mask of its next token follows from this one
        num_output = seq.num_expected_tokens - seq.num_prompt_tokens
        if num_output == 0 and seq.spec.n > 1:
            return False        # the first token of parallel samples: they fork from the result
        return num_output + 1 < seq.params.max_tokens    # else it surely ends with this token

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """The result of `plan` came back (its tokens, or an error). Returns the sequences it scheduled.
        On success the blocks it filled join the prefix cache, then those that left the sliding
        window go back to the pool (registered first, so that they can still serve a prefix until
        the pool hands them out again). (With overlap, a later step planned since may count tokens
        not known yet: those wait.) The sampled tokens are the output processor's to append, after
        this: apply() then carries out what it decided."""
        scheduled = self._sent.pop(plan.step_id, [])
        for s in scheduled:
            if s.predicted:
                s.seq.num_pending_tokens -= 1
        if not result.error:
            for s in scheduled:
                seq = s.seq
                if seq.status is SeqStatus.RUNNING:
                    computed = min(seq.num_computed_tokens, seq.num_tokens)
                    self.bm.cache_computed_blocks(seq.seq_id, seq.token_ids, computed)
                    self.bm.free_outside_window(seq.seq_id, computed)
        return [s.seq for s in scheduled]

    def _grow(self, seq: Sequence, num_new: int, reserve: int = 0) -> Growth | None:
        return self.bm.grow(seq.seq_id, seq.num_computed_tokens + num_new, write_from=seq.num_computed_tokens,
                            reserve=reserve)

    def _swap_in(self, step: _Step, budget: int) -> int:
        while self.swapped:
            group = self.swapped[0]
            if any(s.num_pending_tokens for s in group):
                break       # swapped out while a step sampled for it: sent in full once the token is known
            # each sequence's share of the budget: a sequence swapped out in the middle of its prompt goes on
            # in chunks, like any prefill
            shares, left = [], budget
            for s in group:
                shares.append(min(s.num_tokens - s.num_computed_tokens, left))
                left -= shares[-1]
            wanted = sum(s.num_tokens - s.num_computed_tokens for s in group)
            if len(self.running) + len(group) > self.max_num_seqs or (wanted and not sum(shares)):
                break
            # room for the blocks, and for the blocks (or copy) each sequence's share needs this step
            growth_blocks = sum(max(0, self.bm.entries_needed(s.num_computed_tokens + n) -
                                    len(self.bm.cpu_tables[s.seq_id])) + self.bm.num_groups
                                for s, n in zip(group, shares))
            pairs = self.bm.swap_in([s.seq_id for s in group], reserve=self.watermark_blocks + growth_blocks)
            if pairs is None:
                break
            self.swapped.popleft()
            step.plan.swap_in.extend(pairs)
            for seq, n in zip(group, shares):
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                if n:
                    growth = self._grow(seq, n)
                    assert growth is not None, "swap-in reserved room for growth"
                    step.scheduled.append(_Scheduled(seq, n, growth, True))
                    budget -= n
        return budget

    def _admit(self, step: _Step, budget: int) -> None:
        while self.waiting and budget > 0:
            head = self.waiting[0]
            group = [head]
            for seq in list(self.waiting)[1:]:
                if seq.request_id != head.request_id:
                    break
                group.append(seq)   # a request preempted whole comes back whole
            if len(self.running) + len(group) > self.max_num_seqs or any(s.num_pending_tokens for s in group):
                break       # (pending: preempted while a step sampled for it; sent in full once it is known)
            if len(group) > 1:
                needed = self.bm.group_blocks([s.token_ids for s in group], budget)
                # with nothing running the pool is as free as it gets: waiting would never end (the count
                # is an estimate: a window frees blocks as the group catches up)
                if (needed + self.watermark_blocks > self.bm.num_free_blocks() and self.running) or \
                        len(group) > self.bm.num_free_slots():
                    break
            seq = head
            if seq.seq_id not in self.bm.tables and not seq.wants_prompt_logprobs:
                # (prompt log-probs need every prompt position computed: no prefix hit for those)
                seq.num_computed_tokens = self.bm.match_prefix(seq.seq_id, seq.token_ids)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            growth = self._grow(seq, num_new, reserve=self.watermark_blocks)
            if growth is None:
                self.bm.free(seq.seq_id)     # give back the prefix blocks it matched
                seq.num_computed_tokens = 0
                break
            for member in group:
                self.waiting.popleft()
                member.status = SeqStatus.RUNNING
                self.running.append(member)
            step.scheduled.append(_Scheduled(seq, num_new, growth, True))
            budget -= num_new
            # the rest of a group is scheduled with the running requests from the next step on

    def restart(self, block_manager: BlockManager) -> int:
        """The data plane came back with a new, empty pool: every unfinished sequence waits to be
        recomputed from scratch (keeping the tokens it generated). Returns how many."""
        seqs = self.running + [s for group in self.swapped for s in group] + list(self.waiting)
        self.bm = block_manager
        self.watermark_blocks = watermark_of(block_manager)   # the new pool may differ in size
        self.running, self._forget = [], []
        self._sent.clear()                  # the steps in flight are lost with the old data plane
        self.swapped.clear()
        self.waiting.clear()
        for seq in sorted(seqs, key=run_order):
            seq.status, seq.num_computed_tokens, seq.known_to_data_plane = SeqStatus.WAITING, 0, False
            seq.num_pending_tokens = 0
            self.waiting.append(seq)
        return len(seqs)

    def load(self) -> SchedulerLoad:
        bm = self.bm
        slots = bm.state_slots
        return SchedulerLoad(len(self.running), len(self.waiting), len(self.swapped), bm.usage(), bm.cpu_usage(),
                             bm.num_cow_copies, bm.num_shared_blocks, bm.prefix_queries, bm.prefix_hits,
                             bm.num_window_freed, self.num_preemptions, self.num_swap_preemptions,
                             slots.num_slots if slots else 0, slots.num_used if slots else 0)

    def check_integrity(self) -> None:
        self.bm.check_integrity()
        live = {s.seq_id for s in self.running}
        assert set(self.bm.tables) <= live | {s.seq_id for s in self.waiting}, "blocks held by a sequence not queued"
        for seq in self.waiting:
            assert seq.seq_id not in self.bm.tables, f"waiting sequence {seq.seq_id} holds blocks"
        swapped = {s.seq_id for group in self.swapped for s in group}
        assert set(self.bm.cpu_tables) == swapped, "CPU blocks held by sequences that are not swapped"
        assert all(s.status is SeqStatus.SWAPPED for group in self.swapped for s in group)
