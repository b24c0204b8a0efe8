"""Where each parameter lives in a flat, rank-partitioned buffer: pure index arithmetic.

The parameters of one optimizer param group are laid end to end in model order, padded at the
end to a multiple of the world size, and cut into `world_size` equal contiguous shards: rank r
owns flat elements `[r * shard_numel, (r + 1) * shard_numel)`. A parameter may therefore
straddle two (or more) ranks. Everything else in `phalanx.zero` (buckets, master shards,
checkpoint fragments) is expressed in these coordinates, so the arithmetic lives here once,
with no tensors and no communication, and is unit-tested on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer: elements `[offset, offset + numel)`."""

    index: int  # position of the parameter in its group
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """The flat layout of one param group over `world_size` ranks."""

    slots: tuple[Slot, ...]
    numel: int  # sum of the parameters' sizes
    world_size: int

    @classmethod
    def build(cls, numels: Sequence[int], world_size: int) -> "FlatLayout":
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        slots, offset = [], 0
        for i, n in enumerate(numels):
            slots.append(Slot(i, offset, int(n)))
            offset += int(n)
        return cls(tuple(slots), offset, world_size)

    @property
    def padded_numel(self) -> int:
        """`numel` rounded up to a multiple of the world size (at least one element per rank)."""
        per_rank = max(1, -(-self.numel // self.world_size))
        return per_rank * self.world_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Flat elements `[lo, hi)` that `rank` owns (the last rank's may include padding)."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def split_by_rank(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Cut the flat range `[lo, hi)` at rank boundaries: one `(start, end)` per rank, in rank
        order, empty (`start == end`) for ranks that own none of it."""
        out = []
        for r in range(self.world_size):
            r_lo, r_hi = self.rank_range(r)
            a = min(max(lo, r_lo), hi)
            b = max(min(hi, r_hi), a)
            out.append((a, b))
        return out

    def owned_part(self, slot: Slot, rank: int) -> tuple[int, int] | None:
        """The part of `slot`'s parameter owned by `rank`, as `[start, end)` of the *flattened
        parameter* (0 … numel), or None when the rank owns none of it."""
        r_lo, r_hi = self.rank_range(rank)
        a, b = max(slot.offset, r_lo), min(slot.end, r_hi)
        if a >= b:
            return None
        return a - slot.offset, b - slot.offset

    def owned_slots(self, rank: int) -> Iterator[tuple[Slot, int, int]]:
        """For each parameter `rank` owns part of: (slot, start, end) in parameter coordinates."""
        for slot in self.slots:
            part = self.owned_part(slot, rank)
            if part is not None:
                yield slot, part[0], part[1]

    def to_shard(self, rank: int, flat_index: int) -> int:
        """Convert a flat index inside `rank`'s range into an index into its shard."""
        return flat_index - rank * self.shard_numel


def bucket_slots(layout: FlatLayout, bucket_numel: int) -> list[list[Slot]]:
    """Group a layout's parameters into buckets of about `bucket_numel` elements, walking the
    parameters from last to first: backward produces gradients roughly in reverse model order,
    so the first bucket fills first and its reduction starts while backward is still running.
    Each bucket holds whole, adjacent parameters (a contiguous flat range); a parameter larger
    than `bucket_numel` gets a bucket of its own."""
    buckets: list[list[Slot]] = []
    current: list[Slot] = []
    size = 0
    for slot in reversed(layout.slots):
        if slot.numel == 0:
            continue
        if current and size + slot.numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(slot)
        size += slot.numel
    if current:
        buckets.append(current)
    return [sorted(b, key=lambda s: s.offset) for b in buckets]
