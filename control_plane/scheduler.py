"""Continuous batching under one token budget.

Every sequence tracks num_computed_tokens against num_tokens; a step gives each scheduled
sequence some of its uncomputed tokens. A prompt is a sequence with many uncomputed tokens
(prefilled in chunks when it does not fit the budget), a decoding sequence has one (the
token sampled last step). Each step:

  1. running sequences, oldest arrival first, take what they need from the budget; a
     sequence that cannot get a block makes the latest-arriving unscheduled running
     sequence give way (preemption by recompute: its blocks are freed, it goes back to the
     front of the waiting queue and later recomputes prompt and outputs);
  2. if nothing was preempted, waiting sequences are admitted in order while budget,
     batch size and free blocks (above a small watermark) allow.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from control_plane.block_manager import BlockManager, Growth
from control_plane.sequence import Sequence, SeqStatus

WATERMARK_FRACTION = 0.01  # blocks kept free at admission so running sequences can grow


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    growth: Growth             # blocks appended to its table this step, copy-on-write copies
    is_new: bool               # the data plane does not know it: send it in full

    @property
    def new_block_ids(self) -> list[int]:
        return self.growth.new_block_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    forget_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.forget_seq_ids


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._forget: list[int] = []          # seq ids the data plane should drop at the next plan
        self.num_preemptions = 0
        self.watermark_blocks = max(1, int(WATERMARK_FRACTION * block_manager.pool.num_blocks))

    # --- queues ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._forget)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (stop, length, abort, error) wherever it is and frees its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.bm.free(seq.seq_id)
        if seq.known_to_data_plane:
            self._forget.append(seq.seq_id)
            seq.known_to_data_plane = False

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        if seq.known_to_data_plane:
            out.forget_seq_ids.append(seq.seq_id)
            seq.known_to_data_plane = False
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    # --- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(forget_seq_ids=self._forget)
        self._forget = []
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda s: s.arrival_time)
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:
                i += 1   # a beam waiting for the rest of its group to be computed
                continue
            growth = self._grow(seq, num_new)
            while growth is None:
                victim = self.running[-1]   # latest arrival; never one already scheduled (those sit before i)
                self._preempt(victim, out)
                if victim is seq:
                    break
                growth = self._grow(seq, num_new)
            if growth is None:
                continue  # seq itself gave way; running[i] is now the next sequence
            out.scheduled.append(ScheduledSeq(seq, num_new, growth, not seq.known_to_data_plane))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        for s in out.scheduled:
            s.seq.known_to_data_plane = True
        return out

    def _grow(self, seq: Sequence, num_new: int, reserve: int = 0) -> Growth | None:
        return self.bm.grow(seq.seq_id, seq.num_computed_tokens + num_new, write_from=seq.num_computed_tokens,
                            reserve=reserve)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.seq_id not in self.bm.tables:
                seq.num_computed_tokens = self.bm.match_prefix(seq.seq_id, seq.token_ids)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            growth = self._grow(seq, num_new, reserve=self.watermark_blocks)
            if growth is None:
                self.bm.free(seq.seq_id)     # give back the prefix blocks it matched
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, growth, True))
            budget -= num_new

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks and computed tokens, and runs beside it."""
        self.bm.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The data plane computed what `out` scheduled."""
        for s in out.scheduled:
            if s.seq.status is SeqStatus.RUNNING:
                s.seq.num_computed_tokens += s.num_new_tokens
                self.bm.cache_computed_blocks(s.seq.seq_id, s.seq.token_ids, s.seq.num_computed_tokens)

    def check_integrity(self) -> None:
        self.bm.check_integrity()
        live = {s.seq_id for s in self.running}
        assert set(self.bm.tables) <= live | {s.seq_id for s in self.waiting}, "blocks held by a sequence not queued"
        for seq in self.waiting:
            assert seq.seq_id not in self.bm.tables, f"waiting sequence {seq.seq_id} holds blocks"
