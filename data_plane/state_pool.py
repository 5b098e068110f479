"""The device state pool: per state layer, one fixed-size slot per sequence, allocated beside the KV pool.

    states[layer][i][slot] = part i of that layer's state for the sequence holding the slot

A layer that keeps a per-sequence state instead of a KV cache (LFM2's short convolution keeps the
last kernel - 1 inputs of its convolution; a Mamba2 mixer keeps those of its convolution and its SSM state)
reads and writes its slot at every step; the state after
a sequence's computed tokens, whatever their number, is all the layer needs to go on. The control
plane decides which sequence holds which slot (control_plane/state_slots.py) and sends slot ids in
the plan: NewSequence.state_slot, and StepPlan.state_copies for forks. A sequence whose step starts
at position 0 starts from zeros, whatever its slot held before (so a slot is never cleared). A model
without state layers has no pool and pays nothing.

`StateStep` is what one forward pass tells the state layers (data_plane/state_layers.py): for each
scheduled sequence, its rows of the flattened batch, its slot, and whether it starts from zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# slots when the model has state layers: one per running sequence; the control plane admits no more
DEFAULT_NUM_SLOTS = 256


class StatePool:
    def __init__(self, parts: dict[int, tuple[tuple[tuple[int, ...], torch.dtype | None], ...]], num_slots: int,
                 dtype: torch.dtype, device: torch.device, swap: bool = False):
        """`parts`: layer index -> (shape, dtype) of each part of one sequence's state in that layer (dtype
        None: the model's `dtype`); `swap`: as many slots again in CPU memory, for swapped sequences."""
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots

        def allocate(on):
            return {layer: tuple(torch.zeros(num_slots, *shape, dtype=part_dtype or dtype, device=on,
                                             pin_memory=on == "cpu" and device.type == "cuda")
                                 for shape, part_dtype in layer_parts)
                    for layer, layer_parts in parts.items()}
        self.states = allocate(device)
        self.cpu_states = allocate("cpu") if swap else None

    @property
    def slot_bytes(self) -> int:
        """Bytes of one sequence's state, every state layer together."""
        return sum(t[0].numel() * t.element_size() for parts in self.states.values() for t in parts)

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.states[index]

    def check(self, slots) -> None:
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"state slot {slot} out of range [0, {self.num_slots})")

    def swap(self, pairs: list[tuple[int, int]], out: bool) -> None:
        """(device slot, CPU slot) pairs when `out`, else (CPU slot, device slot): every layer's parts."""
        if not pairs:
            return
        if self.cpu_states is None:
            raise ValueError("the plan swaps state slots; this data plane has no swap space")
        src_ids, dst_ids = (torch.tensor(ids) for ids in zip(*pairs))
        src, dst = (self.states, self.cpu_states) if out else (self.cpu_states, self.states)
        for layer, parts in src.items():
            for part, target in zip(parts, dst[layer]):
                moved = part.index_select(0, src_ids.to(part.device)).to(target.device)
                target.index_copy_(0, dst_ids.to(target.device), moved)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src slot, dst slot): a fork's child starts from its parent's state; in order."""
        for src, dst in pairs:
            for parts in self.states.values():
                for states in parts:
                    states[dst].copy_(states[src])


@dataclass
class StateStep:
    pool: StatePool
    # per scheduled sequence, in the order of the flattened batch: (first row, end row, slot, from zeros)
    seqs: list[tuple[int, int, int, bool]]
    decode_only: bool              # every sequence computes one token and continues a state
    slots: torch.Tensor | None = None   # int64 [seqs] on the device: the slots, for decode-only steps

    @classmethod
    def build(cls, pool: StatePool, seqs: list[tuple[int, int, int, bool]], device: torch.device) -> "StateStep":
        decode_only = all(end - start == 1 and not fresh for start, end, _, fresh in seqs)
        slots = torch.tensor([s[2] for s in seqs], dtype=torch.int64, device=device) if decode_only else None
        return cls(pool, seqs, decode_only, slots)
