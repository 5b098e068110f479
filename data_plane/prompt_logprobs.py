"""Prompt log-probs: for a sequence that asks (SamplingSpec.prompt_logprobs = k >= 0), the log-probability
of each prompt token given the tokens before it, its rank, and the k most likely tokens at its position.

Which hidden rows score which tokens. The forward pass computes one hidden row per scheduled position;
the row of position p holds the model's distribution of the token at p + 1. A step that computes the
prompt positions [begin, end) of a sequence with P prompt tokens therefore scores prompt tokens
begin + 1 .. min(end, P - 1), from the rows of positions begin .. min(end, P - 1) - 1:

    positions   0    1    2    3    4   (P = 5; row of position 4 is the one sampled)
    tokens      t0   t1   t2   t3   t4
    row p  ──►  t1   t2   t3   t4   (first output token)

Token 0 has nothing before it and is never scored (the API reports null for it). Chunked prefill
scores each chunk's share, so the chunks together cover tokens 1 .. P-1 exactly once. Positions a
prefix-cache hit skipped are never computed: the control plane gives such sequences no prefix hit
(Scheduler._admit). A sequence recomputed after a preemption scores its prompt again; the control
plane keeps one value per position.

The distribution is the model's raw one: the runner's `final_logits` (the model's own head, with its
soft-cap and scaling), then log_softmax in float32. No temperature, penalty, logit_bias or grammar
mask applies (as vLLM reports prompt log-probs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol import PromptLogprobs

ROWS_PER_CHUNK = 256   # [rows, vocab] float32 logits at a time: 256 x 49152 x 4 B = 48 MiB for SmolLM2


@dataclass
class PromptSlice:
    """The rows of one scheduled sequence that score prompt tokens this step."""
    seq_id: int
    first_row: int          # hidden row (in the step's flattened batch) that scores `first_position`
    first_position: int     # the first prompt token scored (>= 1)
    targets: list[int]      # the prompt tokens scored, in order
    k: int                  # alternatives asked for


def plan_slices(scheduled, seqs) -> list[PromptSlice]:
    """`scheduled`: (seq_id, num_new_tokens) in the forward's row order; `seqs`: the runner's SeqStates,
    read before their num_computed_tokens advance past this step."""
    slices, row = [], 0
    for seq_id, num_new in scheduled:
        st = seqs[seq_id]
        k = st.sampling.prompt_logprobs
        begin = st.num_computed_tokens
        end = min(begin + num_new, st.num_prompt_tokens - 1)   # exclusive: the last row scores t[end]
        if k is not None and end > begin:
            slices.append(PromptSlice(seq_id, row, begin + 1, st.token_ids[begin + 1:end + 1], k))
        row += num_new
    return slices


@torch.inference_mode()
def compute(hidden: torch.Tensor, slices: list[PromptSlice], final_logits, vocab_size: int) -> list[PromptLogprobs]:
    """hidden: [rows, hidden size] of the whole step. One PromptLogprobs per slice."""
    out = []
    for sl in slices:
        k = min(sl.k, vocab_size)
        logprobs: list[float] = []
        ranks: list[int] = []
        top: list[list[tuple[int, float]]] = []
        targets = torch.tensor(sl.targets, dtype=torch.long, device=hidden.device)
        for lo in range(0, len(sl.targets), ROWS_PER_CHUNK):
            hi = min(lo + ROWS_PER_CHUNK, len(sl.targets))
            rows = hidden[sl.first_row + lo:sl.first_row + hi]
            row_logprobs = torch.log_softmax(final_logits(rows).float(), dim=-1)
            chosen = row_logprobs.gather(1, targets[lo:hi, None])
            logprobs.extend(chosen[:, 0].tolist())
            # rank 1 is the most likely token; ties with the chosen one count in its favour
            ranks.extend(((row_logprobs > chosen).sum(dim=1) + 1).tolist())
            if k > 0:
                values, ids = torch.topk(row_logprobs, k, dim=-1)
                top.extend(list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))
        out.append(PromptLogprobs(sl.seq_id, sl.first_position, logprobs, ranks, top))
    return out
