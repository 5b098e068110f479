"""Slots of the data plane's state pool: which sequence holds which (control_plane/block_manager.py uses it).

A model whose layers keep a per-sequence state (LFM2's short convolutions) needs, beside its KV
blocks, one fixed-size slot per running sequence in the data plane's state pool
(data_plane/state_pool.py): the state after the sequence's computed tokens, whatever their number.
A slot is taken when the sequence gets its block table and given back with its blocks; a fork's
child takes a slot of its own, and the plan tells the data plane to copy the parent's state into it
(`take_copies`). Slots are never shared: a state changes at every token, unlike a full KV block.
"""
from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int):
        assert num_slots >= 0, f"num_slots must be >= 0, got {num_slots}"
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))   # popped from the end: slot 0 first
        self.held: dict[int, int] = {}                     # seq id -> its slot
        self._copies: list[tuple[int, int]] = []           # (parent slot, child slot) not yet in a plan

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_slots if self.num_slots else 0.0

    def slot_of(self, seq_id: int) -> int:
        return self.held[seq_id]

    def take(self, seq_id: int) -> int | None:
        """The sequence's slot, taken now if it has none; None when every slot is held."""
        slot = self.held.get(seq_id)
        if slot is None and self._free:
            slot = self.held[seq_id] = self._free.pop()
        return slot

    def give_back(self, seq_id: int) -> None:
        slot = self.held.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
            if self._copies:   # a child gone before its copy was sent: the copy is moot
                self._copies = [c for c in self._copies if c[1] != slot]

    def fork(self, parent_id: int, child_id: int) -> bool:
        """A slot for the child, with an order to copy the parent's state into it; False (nothing
        changed) when no slot is free."""
        assert child_id not in self.held, f"sequence {child_id} already holds a slot"
        if not self._free:
            return False
        child = self.take(child_id)
        self._copies.append((self.held[parent_id], child))
        return True

    def move_out(self, seq_id: int, cpu: "StateSlots") -> tuple[int, int]:
        """The sequence's slot moves to `cpu` (a swap-out): (device slot, CPU slot). A fork's copy into it
        that is still to be sent stays: the data plane runs the copies before the swaps."""
        slot = self.held.pop(seq_id)
        self._free.append(slot)
        return slot, cpu.take(seq_id)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies ordered since the last plan, for the next one (run before its forward)."""
        copies, self._copies = self._copies, []
        return copies

    def check_integrity(self, holders: set[int]) -> None:
        assert set(self.held) == holders, \
            f"state slots held by {sorted(set(self.held) ^ holders)} disagree with the block tables"
        assert len(set(self.held.values())) == len(self.held), "a state slot held twice"
        assert sorted(self._free + list(self.held.values())) == list(range(self.num_slots)), "state slots leaked"
