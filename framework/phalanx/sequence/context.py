"""Which part of the sequence a rank holds under Ulysses or ring sequence parallelism.

The sequence of length S is cut into equal chunks. "contiguous" (Ulysses): rank r holds chunk r
of `sp`. "zigzag" (ring attention, load-balanced): the sequence is cut into 2·sp chunks and rank r
holds chunks r and 2·sp−1−r, so under a causal mask every rank has the same amount of work
(an early chunk sees few keys, its partner many).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from phalanx.mesh import LayoutError

MODES = ("split_gather", "ulysses", "ring")
# attention module -> the context it runs under: transformers calls the registered attention
# function with the module alone (phalanx.sequence.attention), so the function looks it up here.
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class SequenceContext:
    """mode, group, its size and this rank's index; `inputs_sharded` is set while a forward runs
    on a batch cut by `shard_inputs` (Ulysses/ring models refuse whole-sequence calls)."""

    mode: str
    group: object
    size: int
    rank: int
    inputs_sharded: bool = False

    @classmethod
    def create(cls, mode: str, group) -> "SequenceContext":
        if mode not in MODES:
            raise LayoutError(f"sequence_parallelism={mode!r} is not one of {', '.join(MODES)}")
        return cls(mode, group, dist.get_world_size(group), dist.get_rank(group))

    def attach(self, module) -> None:
        """Mark an attention module as running under this context."""
        _ATTACHED[module] = self

    @staticmethod
    def of(module) -> "SequenceContext | None":
        """The context `attach` gave `module`, or None."""
        return _ATTACHED.get(module)

    @contextlib.contextmanager
    def sharded_inputs(self, on: bool = True) -> Iterator[None]:
        """`inputs_sharded` is `on` inside (a forward on a batch cut by `shard_inputs`), and back
        to what it was after."""
        before, self.inputs_sharded = self.inputs_sharded, on
        try:
            yield
        finally:
            self.inputs_sharded = before

    @property
    def layout(self) -> str:
        return "zigzag" if self.mode == "ring" else "contiguous"

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.layout == "zigzag" else 1

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        r = self.rank if rank is None else rank
        if self.layout == "zigzag":
            return (r, 2 * self.size - 1 - r)
        return (r,)

    def check_length(self, seq_len: int) -> None:
        parts = self.size * self.chunks_per_rank
        if seq_len % parts:
            what = (f"2 × sp = 2 × {self.size} = {parts} chunks (ring attention balances a causal mask with two "
                    "chunks per rank)" if self.layout == "zigzag" else f"sp = {self.size} ranks")
            lo = seq_len - seq_len % parts
            raise LayoutError(f"sequence length {seq_len} is not divisible into {what}: {seq_len} % {parts} = "
                              f"{seq_len % parts}; pad or crop sequences to a multiple of {parts} "
                              f"(e.g. {lo or parts} or {lo + parts})")

    def local_positions(self, seq_len: int, device=None) -> torch.Tensor:
        """The global positions of this rank's tokens, in local order."""
        self.check_length(seq_len)
        c = seq_len // (self.size * self.chunks_per_rank)
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunk_ids()])

    def global_order(self, seq_len: int, device=None) -> torch.Tensor:
        """Index that puts the rank-order concatenation of every rank's local tokens back in
        sequence order."""
        c = seq_len // (self.size * self.chunks_per_rank)
        held = torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                          for r in range(self.size) for i in self.chunk_ids(r)])
        return torch.argsort(held)
