"""Serves prompts greedily on an in-process ModelRunner (tests/control_loop.py plays the control plane:
the real scheduler and block manager, no engine, no sockets), and the oracle it is compared with:
transformers' `generate`.

Used by the architecture matrix (tests/integration/test_architectures.py) and the sliding-window
block freeing test (tests/integration/test_window_freeing.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data_plane.model_runner import ModelRunner
from shared.config import DataPlaneConfig
from tests.control_loop import play


def hf_reference(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and the log-prob of each under the model's own logits, from `generate`."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@dataclass
class Served:
    outputs: list[tuple[list[int], list[float]]]   # per prompt: greedy tokens, their log-probs
    preemptions: int                 # by recompute
    swap_preemptions: int            # by swapping the victim's blocks to the CPU pool
    prefix_hits: int                 # prompt tokens served from the prefix cache
    window_freed: int                # blocks given back because they left the sliding window
    peak_blocks: int                 # most device blocks in use after any step
    sliding_window: int              # what the runner's handshake said
    group_reaches: list[int]         # its layer groups' reaches (empty: one group)
    state_slots: int = 0             # the runner's state pool (a model with state layers)
    # parallel samples after the first: (prompt index, (tokens, log-probs)); copy-on-write copies made
    forks: list[tuple[int, tuple[list[int], list[float]]]] = field(default_factory=list)
    cow_copies: int = 0


def serve(model, prompts: list[list[int]], max_tokens: int, block_size: int, num_blocks: int,
          max_num_seqs: int = 3, budget: int = 16, free_window: bool = True, swap: bool = False,
          samples: dict[int, int] | None = None, logprobs: int | None = 0, dtype: str = "float32") -> Served:
    """Greedy decoding of every prompt (all queued at once, in order) on a pool of `num_blocks`;
    `free_window`: the block manager learns the window from the handshake, as the engine's does;
    `swap`: preempted sequences are swapped to a CPU pool as large as the device pool, not recomputed;
    `samples`: prompt index -> n greedy parallel samples (forks of the first); `logprobs`: as play's; `dtype`:
    the serving type (the runner narrows a float32 model to it)."""
    config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=block_size, kv_cache_blocks=num_blocks,
                             swap_blocks=num_blocks if swap else 0, dtype=dtype)
    runner = ModelRunner(model, config, torch.device("cpu"))
    handshake = runner.handshake()
    window = handshake.sliding_window
    played = play(runner, prompts, max_tokens, budget=budget, max_num_seqs=max_num_seqs,
                  sliding_window=window if free_window else 0, mode="swap" if swap else "recompute",
                  num_cpu_blocks=num_blocks if swap else 0, num_state_slots=handshake.num_state_slots,
                  samples=samples, logprobs=logprobs,
                  group_reaches=handshake.group_reaches if free_window else [0] * len(handshake.group_reaches))
    outputs = [(tokens, logprobs[-max_tokens:]) for tokens, logprobs in zip(played.outputs, played.logprobs)]
    forks = [(i, (tokens, logprobs[-max_tokens:])) for i, tokens, logprobs in played.forks]
    return Served(outputs, played.preemptions, played.swap_preemptions, played.prefix_hits, played.window_freed,
                  played.peak_blocks, window, handshake.group_reaches, handshake.num_state_slots, forks,
                  played.cow_copies)


def assert_same(outputs, expected, atol: float = 1e-4) -> None:
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(outputs, expected)):
        assert tokens == want_tokens, f"prompt {i}: {tokens} != {want_tokens}"
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=atol, rtol=0)
