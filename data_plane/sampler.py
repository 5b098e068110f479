"""Turns the logits of the sampled rows into tokens; logits never leave the device.

A sampled row (temperature > 0) keeps the tokens that its top-k, top-p and min-p let through (`_filter`),
then draws one by the exponential race: the first largest p_i / E_i over the kept tokens, with E_i = -ln U_i
and U_i a 32-bit hash of token i under the draw's key (`_noise`), which picks token i with probability p_i.
On the CPU, pagedserve_kernels/cpu/sampler.cpp does all of it in one call for the step's draws, without sorting
or writing the 49,152 probabilities of a row; elsewhere (and for a row it turns down) torch's operations do the
same, to the same token but where two tokens' ratios tie within rounding.

Reproducibility: a seeded sequence's k-th output token takes its key from (seed, k) alone, so the same seed
gives the same tokens whatever else is in the batch, and after a preemption that recomputes the sequence
from scratch; a change in the last bits of the logits moves the winner only where two ratios nearly tie.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from ops import cpu_kernels
from shared.protocol import SamplingSpec, draw_seed

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive seeds apart
_MASK64 = (1 << 63) - 1


@dataclass
class SampleRow:
    spec: SamplingSpec
    token_ids: list[int]      # the sequence's tokens: its prompt, then what it generated so far
    num_prompt_tokens: int
    num_draws: int = 1        # > 1 for the first token of a parallel-sampling request
    token_mask: bytes | None = None   # structured output: a packed bitmask of the allowed tokens

    # sliced only where a penalty or a bad word needs them: most rows never do
    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_outputs(self) -> int:   # min_tokens, the seed stream
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SampleOutput:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


def _token_seed(seed: int, index: int) -> int:
    return (seed * _SEED_MIX + index * 1_000_003 + 1) & _MASK64


def _key(seed: int | None, index: int) -> int:
    """The key (63 bits, as a seeded one: it fits the kernel's int64) of a sequence's index-th token's noise:
    from (seed, index) alone, or, unseeded, from Python's generator."""
    return random.getrandbits(63) if seed is None else _token_seed(seed, index)


_MIX = (0x7FEB352D, 0x1B873593)   # (each under 2^31: a 32-bit value times one fits in int64)
_BITS32 = (1 << 32) - 1


def _mix32(v: torch.Tensor) -> torch.Tensor:
    v = v ^ (v >> 16)
    v = (v * _MIX[0]) & _BITS32
    v = v ^ (v >> 15)
    v = (v * _MIX[1]) & _BITS32
    return v ^ (v >> 16)


def _noise(vocab: int, key: int, device) -> torch.Tensor:
    """E_i = -ln U_i (float32 [vocab]) for U_i = (floor(h_i / 2^9) + 1/2) / 2^23, h_i a 32-bit hash of token i
    under the key: the kernel's integer steps, in int64."""
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    h = _mix32(_mix32(ids ^ (key & _BITS32)) ^ ((key >> 32) & _BITS32))
    return -torch.log(((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23)))


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    spec = row.spec
    if spec.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long,
                            device=logits.device)
        if seen.numel():
            picked = logits[seen]
            # as transformers does: shrink positive logits, grow negative ones
            logits[seen] = torch.where(picked > 0, picked / spec.repetition_penalty,
                                       picked * spec.repetition_penalty)
    if (spec.presence_penalty or spec.frequency_penalty) and row.num_outputs:
        ids = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0).to(logits.dtype)
    if row.num_outputs < spec.min_tokens and spec.stop_token_ids:
        banned = [t for t in spec.stop_token_ids if 0 <= t < logits.shape[0]]
        logits[banned] = float("-inf")
    if spec.adjusts_logits:
        logits = apply_logit_adjustments(logits, row)
    return logits


def apply_logit_adjustments(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """logit_bias, allowed_token_ids and bad_words of one row (the control plane checked the ids)."""
    spec = row.spec
    if spec.logit_bias:
        ids = torch.tensor([int(t) for t, _ in spec.logit_bias], dtype=torch.long, device=logits.device)
        logits.index_add_(0, ids, torch.tensor([float(b) for _, b in spec.logit_bias], dtype=logits.dtype,
                                               device=logits.device))
    if spec.allowed_token_ids:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[torch.tensor(spec.allowed_token_ids, dtype=torch.long, device=logits.device)] = True
        logits.masked_fill_(~keep, float("-inf"))
    for word in spec.bad_words_ids:
        # the word's last token is banned only where the output already ends with the rest of it
        head = list(word[:-1])
        if not head or (row.num_outputs >= len(head) and row.token_ids[-len(head):] == head):
            logits[word[-1]] = float("-inf")
    return logits


def _filter(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, each setting dropped tokens to -inf."""
    logits = logits / spec.temperature
    if 0 < spec.top_k < logits.shape[0]:
        kth = torch.topk(logits, spec.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if spec.top_p < 1.0:
        # (equal logits in token order, as the kernel takes them)
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = sorted_logits.softmax(-1).double()   # (summed in float64, as the kernel sums)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= spec.top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    if spec.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < spec.min_p * probs.max(), float("-inf"))
    return logits


def _draw(probs: torch.Tensor, key: int) -> int:
    """The exponential race's token (torch's route): the first largest probs / E (token 0 where there is none:
    a row of NaN)."""
    ratios = probs / _noise(probs.shape[0], key, probs.device)
    return int(torch.argmax(torch.nan_to_num(ratios, nan=-1.0)))


def _kernel_draws(logits: torch.Tensor, rows: list[SampleRow]) -> dict[int, list[int]]:
    """The tokens of the sampled rows' draws by the CPU kernel, row by row: {} off the CPU, without the
    kernel, or with none to draw; a row the kernel turns down (a NaN, no finite logit) is left out."""
    sampled = [i for i, row in enumerate(rows) if row.spec.temperature != 0.0]
    if not sampled or logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return {}
    kernel = cpu_kernels.load()
    if kernel is None or not hasattr(kernel, "sample_draws"):
        return {}
    params = [[1.0, 0, 1.0, 0.0]] * logits.shape[0]   # (rows without draws: any temperature)
    draw_rows, keys = [], []
    for i in sampled:
        spec = rows[i].spec
        params[i] = [spec.temperature, max(spec.top_k, 0), spec.top_p, spec.min_p]
        for j in range(rows[i].num_draws):
            draw_rows.append(i)
            keys.append(_key(draw_seed(spec.seed, j), rows[i].num_outputs))
    tokens = kernel.sample_draws(logits, torch.tensor(params, dtype=torch.float32), torch.tensor(draw_rows),
                                 torch.tensor(keys)).tolist()
    drawn: dict[int, list[int]] = {}
    for i, token in zip(draw_rows, tokens):
        drawn.setdefault(i, []).append(token)
    return {i: draws for i, draws in drawn.items() if min(draws) >= 0}


def apply_token_masks(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Structured output: tokens outside a row's allowed set get -inf, before anything else, so that
    penalties, temperature and the reported log-probs all see the constrained distribution. The mask is
    little-endian bits (bit j of byte k: token 8k + j), the layout of xgrammar's int32 bitmask."""
    masked = [i for i, r in enumerate(rows) if r.token_mask is not None]
    if not masked:
        return
    vocab = logits.shape[1]
    packed = np.stack([np.frombuffer(rows[i].token_mask, dtype=np.uint8) for i in masked])
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab]
    if bits.shape[1] < vocab:   # the model's vocab is padded past the tokenizer's: pad tokens are not allowed
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    allowed = torch.from_numpy(bits.astype(bool)).to(logits.device)
    index = torch.tensor(masked, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def greedy_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits [rows, vocab]: the max, its first index and the log-sum-exp (float32), without
    writing a [rows, vocab] log-softmax. On the CPU, float32 or bfloat16 logits, one C++ pass per quantity
    (pagedserve_kernels/cpu/fused_ops.cpp; a 64-row step of SmolLM2's 49152 logits spent 4.7 ms in torch's two ops),
    bfloat16 widened as it is read, to the same results as on a float32 copy; a row with a NaN or no finite
    logit goes to torch's ops in float32, whose NaN and -inf conventions it then gets."""
    kernel = cpu_kernels.load() if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) \
        and logits.is_contiguous() and logits.dim() == 2 and logits.shape[1] > 0 else None
    if kernel is not None:
        best, index, lse = kernel.greedy_logsumexp(logits)
        if not bool(torch.isnan(lse).any()):
            return best, index, lse
    logits = logits.float()
    best, index = logits.max(dim=-1)
    return best, index, torch.logsumexp(logits, dim=-1)


def needs_processing(row: SampleRow) -> bool:
    """Whether a penalty, a min_tokens ban or a logits adjustment changes the row's logits."""
    spec = row.spec
    return spec.repetition_penalty != 1.0 or bool(spec.presence_penalty or spec.frequency_penalty) \
        or row.num_outputs < spec.min_tokens or spec.adjusts_logits


def greedy_plain(row: SampleRow) -> bool:
    """Whether a row's draws need only the greedy pass over its raw logits: temperature 0, no
    alternatives' log-probs, nothing changing its logits."""
    return row.spec.temperature == 0.0 and row.spec.logprobs <= 0 and row.token_mask is None \
        and not needs_processing(row)


def argmax_only(row: SampleRow) -> bool:
    """Whether all the row needs is the first index of its largest raw logit: a greedy_plain row with one
    draw, no log-prob asked for (logprobs -1), not a beam's."""
    return greedy_plain(row) and row.spec.logprobs < 0 and not row.spec.beam_width and row.num_draws == 1


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[list[SampleOutput]]:
    """logits: [rows, vocab] in any float dtype; one SampleRow per logits row; per row, its draws."""
    # greedy rows that report at most their token's log-prob read bfloat16 logits as they are (the greedy
    # pass widens them as it reads): a 64-row step skips writing a float32 copy of its 49152 logits a row
    if not (logits.dtype == torch.bfloat16 and all(greedy_plain(row) for row in rows)):
        logits = logits.float()
    apply_token_masks(logits, rows)
    for i, row in enumerate(rows):
        if needs_processing(row):
            logits[i] = apply_penalties(logits[i].clone(), row)
    best, greedy, lse = greedy_logsumexp(logits)
    greedy_logprob, greedy = (best - lse).tolist(), greedy.tolist()
    drawn = _kernel_draws(logits, rows)
    outputs = []
    for i, row in enumerate(rows):
        spec = row.spec
        if spec.temperature == 0.0:
            tokens, logprobs = [greedy[i]] * row.num_draws, [greedy_logprob[i]] * row.num_draws
        else:
            tokens = drawn.get(i)
            if tokens is None:
                probs = _filter(logits[i], spec).softmax(-1)
                tokens = [_draw(probs, _key(draw_seed(spec.seed, j), row.num_outputs)) for j in range(row.num_draws)]
            logprobs = (logits[i, tokens] - lse[i]).tolist()
        top: list[tuple[int, float]] = []
        if spec.logprobs > 0:
            # the chosen token's log-prob from the same log_softmax as the alternatives: a token that is
            # both reports one number (the lse route differs from it in the last float bits)
            row_logprobs = torch.log_softmax(logits[i], dim=-1)
            values, ids = torch.topk(row_logprobs, spec.logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
            logprobs = row_logprobs[tokens].tolist()
        outputs.append([SampleOutput(t, lp, top) for t, lp in zip(tokens, logprobs)])
    return outputs
