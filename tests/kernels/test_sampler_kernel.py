"""The sampler's draws, by the CPU kernel (pagedserve_kernels/cpu/sampler.cpp) and by torch's route
(data_plane/sampler.py), against the rules worked out here in float64: the kept tokens of top-k, top-p and
min-p, then the exponential race's winner, the first largest p_i / E_i over them, with E_i = -ln U_i from the
32-bit hash of token i under the draw's key.

Cases where a kept set would hang on a rounding (a top-p boundary or a min-p weight within 2e-6 of its
limit) are left out, and so are draws whose two best ratios lie within 1e-5 of each other: there the
float32 arithmetic may rightly decide otherwise."""
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


M32 = (1 << 32) - 1


def mix32(v: int) -> int:
    v ^= v >> 16
    v = (v * 0x7FEB352D) & M32
    v ^= v >> 15
    v = (v * 0x1B873593) & M32
    return v ^ (v >> 16)


def race(probs: torch.Tensor, key: int) -> int | None:
    """The winner of the race in float64, or None where the two best ratios nearly tie."""
    kept = torch.nonzero(probs > 0).flatten().tolist()
    ratios = []
    for i in kept:
        h = mix32(mix32(i ^ (key & M32)) ^ (key >> 32 & M32))
        ratios.append((float(probs[i]) / -math.log(((h >> 9) + 0.5) / (1 << 23)), i))
    ratios.sort(key=lambda r: (-r[0], r[1]))
    if len(ratios) > 1 and ratios[0][0] - ratios[1][0] < 1e-5 * ratios[0][0]:
        return None
    return ratios[0][1]


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


def checked(tokens, probs, keys, what: str) -> int:
    """How many draws were checked against the race's winner (not near a tie)."""
    count = 0
    for key, token in zip(keys, tokens):
        want = race(probs, key)
        if want is not None:
            assert token == want, f"{what}, key {key}: token {token}, the race's winner {want}"
            count += 1
    return count


@pytest.mark.parametrize("vocab", [100, 49152])
def test_the_kernels_draws_follow_the_rules(kernel, vocab):
    chosen = cases(vocab)
    logits = torch.stack([x for x, _, _ in chosen]).contiguous()
    params = torch.tensor([[t, k, p, q] for _, (t, k, p, q), _ in chosen], dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randint(-(1 << 62), 1 << 62, (len(chosen), 25), generator=gen) * 2 + 1   # (negative ones too)
    rows = torch.arange(len(chosen)).repeat_interleave(keys.shape[1])
    tokens = kernel.sample_draws(logits, params, rows, keys.flatten().contiguous()).view(len(chosen), -1)
    total = 0
    for r, (_, setting, probs) in enumerate(chosen):
        total += checked(tokens[r].tolist(), probs, [k % (1 << 64) for k in keys[r].tolist()],
                         f"kernel, vocab {vocab}, {setting}")
    assert total >= 0.9 * keys.numel()
    # a draw alone is the draw of the batch (no dependence on the other rows or the threads)
    alone = kernel.sample_draws(logits[3:4].contiguous(), params[3:4].contiguous(), torch.zeros(1, dtype=torch.long),
                                keys[3, :1].contiguous())
    assert int(alone) == int(tokens[3, 0])


@pytest.mark.parametrize("vocab", [100, 49152])
def test_torchs_route_draws_by_the_same_rules(vocab):
    rng = torch.Generator().manual_seed(2)
    total = 0
    for x, (t, k, p, q), probs in cases(vocab):
        spec = SamplingSpec(temperature=t, top_k=k, top_p=p, min_p=q)
        filtered = sampler._filter(x.clone(), spec).softmax(-1)
        keys = [int(v) for v in torch.randint(0, 1 << 62, (8,), generator=rng)]
        total += checked([sampler._draw(filtered, key) for key in keys], probs, keys, f"torch, vocab {vocab}, {(t, k, p, q)}")
    assert total >= 0.9 * 8 * len(SETTINGS)


def test_the_kernel_turns_down_rows_without_a_finite_logit_and_bad_arguments(kernel):
    logits = torch.randn(4, 64)
    logits[1, 5] = float("nan")
    logits[2] = float("-inf")
    logits[3, 7] = float("inf")
    params = torch.tensor([[1.0, 0, 1.0, 0.0]] * 4)
    got = kernel.sample_draws(logits, params, torch.arange(4), torch.arange(4))
    assert got[0] >= 0 and got[1:].tolist() == [-1, -1, -1]
    one = torch.zeros(1, dtype=torch.long)
    for rows, keys, p, match in [(torch.tensor([4]), one, params, "out of range"),
                                 (one, one, torch.zeros(4, 4), "positive"),
                                 (one, torch.tensor([0.5]), params, "keys int64")]:
        with pytest.raises(RuntimeError, match=match):
            kernel.sample_draws(logits, p, rows, keys)


def test_the_noise_is_exponential_and_fixed_by_its_key():
    e = sampler._noise(40000, 12345, "cpu")
    assert torch.equal(e, sampler._noise(40000, 12345, "cpu")) and not torch.equal(e, sampler._noise(40000, 12346, "cpu"))
    assert bool((e > 0).all()) and abs(float(e.mean()) - 1.0) < 0.02
    assert abs(float((e > 1.0).float().mean()) - math.exp(-1)) < 0.01
    assert sampler._key(7, 3) == sampler._key(7, 3) != sampler._key(7, 4)


def test_a_temperature_whose_inverse_overflows_takes_the_first_max(kernel):
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.99, 1.9]])
    for t in (1e-40, 1e-30):   # 1 / T overflows float32, then it does not (the weights still leave token 1 alone)
        got = kernel.sample_draws(logits, torch.tensor([[t, 0, 0.9, 0.0]]), torch.zeros(1, dtype=torch.long),
                                  torch.tensor([99]))
        assert int(got) == 1
