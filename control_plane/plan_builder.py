"""Turns the scheduler's decisions into the StepPlan sent to the data plane. Pure: it reads the
sequences and writes nothing; Scheduler.commit records what a sent plan told the data plane."""
from __future__ import annotations

from control_plane.block_manager import BlockManager
from control_plane.scheduler import SchedulerOutput
from shared.protocol import CachedSequence, NewSequence, StepPlan


def build_plan(step_id: int, out: SchedulerOutput, bm: BlockManager) -> StepPlan:
    plan = StepPlan(step_id, forget_seq_ids=list(out.forget_seq_ids), swap_out=list(out.swap_out),
                    swap_in=list(out.swap_in))
    for s in out.scheduled:
        seq = s.seq
        plan.copies.extend((src, dst) for _, src, dst in s.growth.copies)
        if s.is_new:
            # sent once in full: every known token (outputs too, after a recompute preemption)
            plan.new_seqs.append(NewSequence(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                                             seq.num_computed_tokens, s.num_new_tokens, bm.block_ids(seq.seq_id),
                                             seq.spec))
        else:
            # a beam's tokens are chosen here: send those the data plane does not have yet (any
            # other sequence's new token was sampled, and appended, by the data plane itself)
            tokens = seq.token_ids[seq.num_tokens_sent:] if seq.spec.beam_width else []
            plan.cached_seqs.append(CachedSequence(seq.seq_id, s.num_new_tokens, list(s.new_block_ids), tokens,
                                                   [(index, dst) for index, _, dst in s.growth.copies]))
    return plan
