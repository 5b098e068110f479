"""The sampler's draws, by the CPU kernel (pagedserve_kernels/cpu/sampler.cpp) and by torch's route
(data_plane/sampler.py), against the rules worked out here in float64: the kept tokens of top-k, top-p and
min-p, then the token whose stretch of the kept probabilities' running sum, in token order, holds u.

Cases where a kept set would hang on a rounding (a top-p boundary or a min-p weight within 2e-6 of its
limit) are left out: there the float32 arithmetic may rightly keep one token more or less."""
from __future__ import annotations

import math

import pytest
import torch

from data_plane import sampler
from shared.protocol import SamplingSpec

# (temperature, top_k, top_p, min_p)
SETTINGS = [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 40, 0.8, 0.0), (0.8, 0, 1.0, 0.05),
            (0.8, 50, 0.95, 0.02), (2.5, 0, 0.5, 0.0), (1.0, 1, 1.0, 0.0), (0.9, 0, 1e-6, 0.0), (1.0, 10 ** 6, 0.6, 0.0)]
MARGIN = 2e-6   # relative: the float32 weights' error (under 1e-6), summed in float64


def logits_row(vocab: int, seed: int) -> torch.Tensor:
    """Random logits with a few banned tokens (-inf) and runs of equal values (ties to break by token id)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=gen) * 3
    x[torch.randint(0, vocab, (vocab // 50 + 1,), generator=gen)] = float("-inf")
    top = torch.topk(x, 4).indices
    x[top[1:]] = float(x[top[1]])   # the 2nd to 4th largest equal
    return x


def kept(x: torch.Tensor, t: float, k: int, p: float, q: float) -> torch.Tensor | None:
    """The kept tokens' probabilities (float64 [V], 0 elsewhere), or None where a rounding could decide."""
    vocab, xs = x.shape[0], x.tolist()
    ws = torch.exp((x.double() - x.max().double()) / t).tolist()
    keep = sorted(range(vocab), key=lambda i: (-xs[i], i))   # by logit, ties by token id
    if 0 < k < vocab:
        keep = [i for i in keep if xs[i] >= xs[keep[k - 1]]]
    if p < 1.0:
        limit = p * sum(ws[i] for i in keep)
        befores = [0.0]
        for i in keep[:-1]:
            befores.append(befores[-1] + ws[i])
        cut = next((j for j in range(1, len(keep)) if befores[j] >= limit), len(keep))
        # the sums on either side of the limit: the last kept token's and the first dropped one's
        if any(abs(befores[j] - limit) < MARGIN * limit / p for j in (cut - 1, cut) if 0 < j < len(keep)):
            return None
        keep = keep[:cut]
    if q > 0.0:
        if any(abs(ws[i] - q) < MARGIN for i in keep):
            return None
        keep = keep[:1] + [i for i in keep[1:] if ws[i] >= q]
    probs = torch.zeros(vocab, dtype=torch.float64)
    probs[keep] = torch.tensor([ws[i] for i in keep], dtype=torch.float64)
    return probs / probs.sum()


def assert_drawn(token: int, probs: torch.Tensor, u: float, what: str) -> None:
    assert 0 <= token < probs.shape[0] and probs[token] > 0, f"{what}: token {token} is not among the kept ones"
    cum = probs.cumsum(0)
    before = float(cum[token] - probs[token])
    assert before - 1e-6 <= u <= float(cum[token]) + 1e-6, \
        f"{what}: u {u} falls outside token {token}'s stretch [{before}, {float(cum[token])}]"


def cases(vocab: int):
    """(logits, settings, probs) for every setting, on the first seeds whose kept sets do not hang on a rounding."""
    out = []
    for setting in SETTINGS:
        for seed in range(20):
            x = logits_row(vocab, seed)
            probs = kept(x, *setting)
            if probs is not None:
                out.append((x, setting, probs))
                break
        else:
            raise AssertionError(f"no clear case for {setting}")
    return out


@pytest.mark.parametrize("vocab", [100, 49152])
def test_the_kernels_draws_follow_the_rules(kernel, vocab):
    chosen = cases(vocab)
    logits = torch.stack([x for x, _, _ in chosen]).contiguous()
    params = torch.tensor([[t, k, p, q] for _, (t, k, p, q), _ in chosen], dtype=torch.float32)
    us = torch.rand(len(chosen), 25, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rows = torch.arange(len(chosen)).repeat_interleave(us.shape[1])
    tokens = kernel.sample_draws(logits, params, rows, us.flatten().contiguous()).view(len(chosen), -1)
    for r, (_, setting, probs) in enumerate(chosen):
        for u, token in zip(us[r].tolist(), tokens[r].tolist()):
            assert_drawn(token, probs, u, f"kernel, vocab {vocab}, {setting}")
    # a draw alone is the draw of the batch (no dependence on the other rows or the threads)
    alone = kernel.sample_draws(logits[3:4].contiguous(), params[3:4].contiguous(), torch.zeros(1, dtype=torch.long),
                                us[3, :1].contiguous())
    assert int(alone) == int(tokens[3, 0])


@pytest.mark.parametrize("vocab", [100, 49152])
def test_torchs_route_draws_by_the_same_rules(vocab):
    gen = torch.Generator().manual_seed(2)
    for x, (t, k, p, q), probs in cases(vocab):
        spec = SamplingSpec(temperature=t, top_k=k, top_p=p, min_p=q)
        filtered = sampler._filter(x.clone(), spec).softmax(-1)
        for u in torch.rand(10, generator=gen, dtype=torch.float64).tolist():
            assert_drawn(sampler._draw(filtered, u), probs, u, f"torch, vocab {vocab}, {(t, k, p, q)}")


def test_the_kernel_turns_down_rows_without_a_finite_logit_and_bad_arguments(kernel):
    logits = torch.randn(4, 64)
    logits[1, 5] = float("nan")
    logits[2] = float("-inf")
    logits[3, 7] = float("inf")
    params = torch.tensor([[1.0, 0, 1.0, 0.0]] * 4)
    got = kernel.sample_draws(logits, params, torch.arange(4), torch.full((4,), 0.5, dtype=torch.float64))
    assert got[0] >= 0 and got[1:].tolist() == [-1, -1, -1]
    one = torch.zeros(1, dtype=torch.long)
    for rows, u, p, match in [(torch.tensor([4]), torch.tensor([0.5], dtype=torch.float64), params, "out of range"),
                              (one, torch.tensor([1.0], dtype=torch.float64), params, r"\[0, 1\)"),
                              (one, torch.tensor([0.5], dtype=torch.float64), torch.zeros(4, 4), "positive"),
                              (one, torch.tensor([0.5]), params, "float64")]:
        with pytest.raises(RuntimeError, match=match):
            kernel.sample_draws(logits, p, rows, u)


def test_a_seeded_tokens_u_is_fixed_by_seed_and_index_and_uniform():
    us = [sampler._uniform(7, i) for i in range(4000)]
    assert us == [sampler._uniform(7, i) for i in range(4000)]
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) == len(us)
    assert abs(sum(us) / len(us) - 0.5) < 0.02
    assert abs(sum(u < 0.1 for u in us) / len(us) - 0.1) < 0.02
    assert not math.isclose(sampler._uniform(7, 0), sampler._uniform(8, 0))


def test_a_temperature_whose_inverse_overflows_takes_the_first_max(kernel):
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.99, 1.9]])
    for t in (1e-40, 1e-30):   # 1 / T overflows float32, then it does not (the weights still leave token 1 alone)
        got = kernel.sample_draws(logits, torch.tensor([[t, 0, 0.9, 0.0]]), torch.zeros(1, dtype=torch.long),
                                  torch.tensor([0.99], dtype=torch.float64))
        assert int(got) == 1
