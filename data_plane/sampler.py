"""Turns the logits of the sampled rows into tokens; logits never leave the device.

Reproducibility: a seeded sequence draws its k-th output token from a generator seeded with
(seed, k), so the same seed gives the same tokens whatever else is in the batch, and after a
preemption that recomputes the sequence from scratch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from shared.protocol import SamplingSpec, draw_seed

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive seeds apart
_MASK64 = (1 << 63) - 1


@dataclass
class SampleRow:
    spec: SamplingSpec
    prompt_ids: list[int]     # for the repetition penalty
    output_ids: list[int]     # tokens generated so far (penalties, min_tokens, seed stream)
    num_draws: int = 1        # > 1 for the first token of a parallel-sampling request


@dataclass
class SampleOutput:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


def _token_seed(seed: int, index: int) -> int:
    return (seed * _SEED_MIX + index * 1_000_003 + 1) & _MASK64


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    spec = row.spec
    if spec.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long,
                            device=logits.device)
        if seen.numel():
            picked = logits[seen]
            # as transformers does: shrink positive logits, grow negative ones
            logits[seen] = torch.where(picked > 0, picked / spec.repetition_penalty,
                                       picked * spec.repetition_penalty)
    if (spec.presence_penalty or spec.frequency_penalty) and row.output_ids:
        ids = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0).to(logits.dtype)
    if len(row.output_ids) < spec.min_tokens and spec.stop_token_ids:
        banned = [t for t in spec.stop_token_ids if 0 <= t < logits.shape[0]]
        logits[banned] = float("-inf")
    return logits


def _filter(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, each setting dropped tokens to -inf."""
    logits = logits / spec.temperature
    if 0 < spec.top_k < logits.shape[0]:
        kth = torch.topk(logits, spec.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= spec.top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    if spec.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < spec.min_p * probs.max(), float("-inf"))
    return logits


def _draw(probs: torch.Tensor, seed: int | None, index: int) -> int:
    seed = seed if seed is not None else random.getrandbits(62)
    gen = torch.Generator(device=probs.device).manual_seed(_token_seed(seed, index))
    # exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise))


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[list[SampleOutput]]:
    """logits: [rows, vocab] in any float dtype; one SampleRow per logits row; per row, its draws."""
    logits = logits.float()
    needs_processing = [r.spec.repetition_penalty != 1.0 or r.spec.presence_penalty or r.spec.frequency_penalty
                        or len(r.output_ids) < r.spec.min_tokens for r in rows]
    for i, row in enumerate(rows):
        if needs_processing[i]:
            logits[i] = apply_penalties(logits[i].clone(), row)
    # one pass for the normalizer and one for the best token: no [rows, vocab] log-softmax is written
    lse = torch.logsumexp(logits, dim=-1)
    best, greedy = logits.max(dim=-1)
    greedy_logprob, greedy = (best - lse).tolist(), greedy.tolist()
    outputs = []
    for i, row in enumerate(rows):
        spec = row.spec
        if spec.temperature == 0.0:
            tokens, logprobs = [greedy[i]] * row.num_draws, [greedy_logprob[i]] * row.num_draws
        else:
            probs = _filter(logits[i], spec).softmax(-1)
            tokens = [_draw(probs, draw_seed(spec.seed, j), len(row.output_ids)) for j in range(row.num_draws)]
            logprobs = (logits[i, tokens] - lse[i]).tolist()
        top: list[tuple[int, float]] = []
        if spec.logprobs > 0:
            values, ids = torch.topk(torch.log_softmax(logits[i], dim=-1), spec.logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        outputs.append([SampleOutput(t, lp, top) for t, lp in zip(tokens, logprobs)])
    return outputs
