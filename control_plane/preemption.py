"""How a preempted request gives back its device blocks: swapped to the CPU pool, or dropped and
recomputed later. In `auto` mode the choice is made per victim by estimated cost:

    swap      = 2 * blocks * block_bytes / swap bandwidth        (out now, in later)
    recompute = computed tokens / prefill rate                   (prompt and outputs again)

Both rates are measured on the running system (moving averages of what the data plane reports)
and start from conservative guesses. A group of sequences that share blocks (parallel samples,
beams) is swapped whenever the CPU pool has room, in every mode: recomputed, each of its sequences
would need private copies of the blocks they shared, and the group might never fit again.
"""
from __future__ import annotations

from control_plane.sequence import Sequence
from shared.config import kv_block_bytes

EMA = 0.2                          # weight of a new measurement
MIN_PREFILL_TOKENS = 32            # steps smaller than this say little about the prefill rate


class PreemptionPolicy:
    def __init__(self, mode: str, block_bytes: int, swap_bytes_per_s: float = 2e9, prefill_tokens_per_s: float = 500.0):
        assert mode in ("auto", "swap", "recompute"), mode
        self.mode = mode
        self.block_bytes = block_bytes
        self.swap_bytes_per_s = swap_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s

    @staticmethod
    def block_bytes_of(handshake) -> int:
        return kv_block_bytes(handshake.num_layers, handshake.block_size, handshake.num_kv_heads,
                              handshake.head_dim, handshake.dtype)

    def observe(self, blocks_swapped: int, swap_seconds: float, tokens: int, forward_seconds: float) -> None:
        if blocks_swapped and swap_seconds > 0:
            rate = blocks_swapped * self.block_bytes / swap_seconds
            self.swap_bytes_per_s += EMA * (rate - self.swap_bytes_per_s)
        if tokens >= MIN_PREFILL_TOKENS and forward_seconds > 0:
            self.prefill_tokens_per_s += EMA * (tokens / forward_seconds - self.prefill_tokens_per_s)

    def costs(self, group: list[Sequence], num_blocks: int) -> tuple[float, float]:
        """(seconds to swap out and back in, seconds to recompute) for this victim group."""
        swap = 2 * num_blocks * self.block_bytes / self.swap_bytes_per_s
        recompute = sum(s.num_computed_tokens for s in group) / self.prefill_tokens_per_s
        return swap, recompute

    def choose(self, group: list[Sequence], num_blocks: int, can_swap: bool) -> str:
        if not can_swap:
            return "recompute"
        if self.mode == "swap" or len(group) > 1:
            return "swap"
        if self.mode == "recompute":
            return "recompute"
        swap, recompute = self.costs(group, num_blocks)
        return "swap" if swap < recompute else "recompute"
