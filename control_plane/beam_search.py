"""Beam search decisions for one request, scored as transformers' `generate(num_beams=W)` scores.

Each step, every live beam reports its best K = 2W continuations (log-probabilities from the
data plane). Then, as transformers does:

  1. candidates = (beam score + log p) over all beams, best K first;
  2. a candidate *hits stop* if its token ends a sequence or it reaches max_tokens;
  3. the best W candidates that do not hit stop become the next beams;
  4. of the first W candidates, those that hit stop become finished hypotheses scored
     score / generated_length ** length_penalty (kept: the best W ever seen);
  5. the search ends when every candidate hits stop, when W hypotheses are finished and
     early_stopping is True, or when no live beam can beat the worst finished hypothesis.

Scores are kept in float32 like transformers' tensors, so that ties break the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

NEG = np.float32(-1.0e9)
_MAX_LOG = 700.0   # exp(700) is about 1e304: the largest power float64 holds with room to spare


def length_divisor(length: int, length_penalty: float) -> np.float32:
    """length ** length_penalty as float32 (what transformers divides by). An exponent past float64's
    range is clamped in log space instead of raising OverflowError; a value past float32's becomes
    inf, which divides a score into -0.0: a degenerate but valid ranking, never a crash."""
    try:
        value = float(length) ** length_penalty
    except OverflowError:
        value = math.exp(max(-_MAX_LOG, min(_MAX_LOG, length_penalty * math.log(length))))
    with np.errstate(over="ignore"):
        return np.float32(value)


@dataclass
class Hypothesis:
    score: float              # length-penalized, what the final ranking uses
    output_ids: list[int]     # generated tokens, the stop token included
    logprob: float            # sum of log-probabilities
    finish_reason: str        # "stop" or "length"


@dataclass
class Choice:
    parent_seq_id: int
    token_id: int
    score: np.float32         # the new beam's cumulative log-probability


@dataclass
class BeamSearch:
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    stop_ids: frozenset[int]
    num_generated: int = 0                       # tokens every live beam has generated
    scores: dict[int, np.float32] = field(default_factory=dict)       # live beam seq id -> score
    candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True

    def start(self, seq_id: int) -> None:
        self.scores[seq_id] = np.float32(0.0)

    def report(self, seq_id: int, top_logprobs: list[tuple[int, float]]) -> None:
        self.candidates[seq_id] = top_logprobs

    def ready(self) -> bool:
        return set(self.candidates) == set(self.scores)

    def step(self, output_ids: dict[int, list[int]]) -> tuple[list[Choice], bool]:
        """Chooses the next beams from the reported candidates. `output_ids` gives each live beam's
        generated tokens so far. Returns the next beams and whether the search is over."""
        assert self.ready(), "every live beam must report before a beam step"
        k = 2 * self.width if len(self.stop_ids) <= 1 else (1 + len(self.stop_ids)) * self.width
        pool = [(np.float32(self.scores[sid] + np.float32(lp)), sid, tok)
                for sid in self.scores for tok, lp in self.candidates[sid]]
        pool.sort(key=lambda c: -c[0])
        top = pool[:k]
        length = self.num_generated + 1
        hits = [tok in self.stop_ids or length >= self.max_tokens for _, _, tok in top]

        ranked = sorted(range(len(top)), key=lambda i: -(top[i][0] + (NEG if hits[i] else 0)))
        next_beams = [Choice(top[i][1], top[i][2], top[i][0] + (NEG if hits[i] else np.float32(0)))
                      for i in ranked[:self.width]]

        all_finished = len(self.finished) >= self.width
        if self.improvable and not (all_finished and self.early_stopping is True):
            penalty = length_divisor(length, self.length_penalty)
            for i in range(min(self.width, len(top))):
                if hits[i]:
                    score, sid, tok = top[i]
                    reason = "stop" if tok in self.stop_ids else "length"
                    with np.errstate(divide="ignore", over="ignore"):
                        penalized = float(np.float32(score / penalty))
                    self.finished.append(Hypothesis(penalized, output_ids[sid] + [tok],
                                                    float(score), reason))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width:]

        self.num_generated = length
        self.candidates.clear()
        self.scores = {}
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = length
        with np.errstate(divide="ignore", over="ignore"):
            best_running = np.float32(next_beams[0].score / length_divisor(best_length, self.length_penalty))
        worst_finished = self.finished[-1].score if len(self.finished) >= self.width else float(NEG)
        self.improvable = self.improvable and bool(best_running > worst_finished)
        done = (not self.improvable or (len(self.finished) >= self.width and self.early_stopping is True)
                or all(hits))
        return next_beams, done

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
