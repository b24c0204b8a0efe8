"""How one parameter is split over the tensor-parallel ranks: pure tensor/index arithmetic.

A `ShardSpec` says along which dimension a parameter is cut, in which *sections* (a fused QKV
weight is three sections, each cut on its own so that rank r gets the q, k and v of its heads),
and whether the pieces are padded (a vocabulary that the tensor-parallel size does not divide).
Every rank's local piece has the same shape — padding rows are zeros and belong to no element of
the full tensor — so flat layouts (ZeRO) are identical on every tensor-parallel rank.

`shard` and `unshard` move whole tensors; `runs` maps the flattened local piece to contiguous
ranges of the flattened full tensor (what optimizer-state fragments are written in).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch


@dataclass(frozen=True)
class ShardSpec:
    """dim=None: the parameter is replicated on every tensor-parallel rank.

    sections: sizes along `dim` of parts that are split independently (`()`: one section, the
        whole dimension). pad: allow a section size that `tp` does not divide; the last ranks'
        pieces are zero-padded to the common size ceil(size / tp).
    partial_grad: a replicated parameter whose gradient on each rank covers only that rank's part
        of the computation (norms on a sharded sequence, per-head norms, replicated KV heads), so
        gradients must be summed over the tensor-parallel group.
    """

    dim: int | None = None
    sections: tuple[int, ...] = ()
    pad: bool = False
    partial_grad: bool = False

    @property
    def is_sharded(self) -> bool:
        return self.dim is not None

    def _sections(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        size = full_shape[self.dim]
        sections = self.sections or (size,)
        if sum(sections) != size:
            raise ValueError(f"sections {sections} do not add up to dimension {self.dim} of shape {tuple(full_shape)}")
        return sections

    def _chunks(self, full_shape: Sequence[int], tp: int) -> list[tuple[int, int, int]]:
        """Per section: (start in the full dim, size, chunk per rank)."""
        out, start = [], 0
        for size in self._sections(full_shape):
            if size % tp and not self.pad:
                raise ValueError(f"dimension {self.dim} section of size {size} (shape {tuple(full_shape)}) is not "
                                 f"divisible by tp={tp}")
            out.append((start, size, -(-size // tp)))
            start += size
        return out

    def local_shape(self, full_shape: Sequence[int], tp: int) -> tuple[int, ...]:
        shape = list(full_shape)
        if self.dim is not None:
            shape[self.dim] = sum(c for _, _, c in self._chunks(full_shape, tp))
        return tuple(shape)

    def slices(self, full_shape: Sequence[int], rank: int, tp: int) -> list[tuple[int, int, int]]:
        """This rank's piece as (start, stop, padding) ranges along `dim` of the full tensor, one per
        section, in local order."""
        out = []
        for start, size, chunk in self._chunks(full_shape, tp):
            lo = min(rank * chunk, size)
            hi = min(lo + chunk, size)
            out.append((start + lo, start + hi, chunk - (hi - lo)))
        return out

    def assemble(self, parts: Sequence[torch.Tensor], full_shape: Sequence[int], rank: int, tp: int) -> torch.Tensor:
        """The local piece from the parts of the full tensor named by `slices` (zero-padded)."""
        pieces = []
        for part, (_, _, pad) in zip(parts, self.slices(full_shape, rank, tp)):
            if pad:
                pad_shape = list(part.shape)
                pad_shape[self.dim] = pad
                part = torch.cat([part, part.new_zeros(pad_shape)], dim=self.dim)
            pieces.append(part)
        return torch.cat(pieces, dim=self.dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous()

    def shard(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's piece of `full` (a new tensor; works on the meta device too)."""
        if self.dim is None:
            return full
        parts = [full.narrow(self.dim, a, b - a) for a, b, _ in self.slices(full.shape, rank, tp)]
        return self.assemble(parts, full.shape, rank, tp)

    def unshard(self, pieces: Sequence[torch.Tensor], full_shape: Sequence[int]) -> torch.Tensor:
        """The full tensor from every rank's piece (in tensor-parallel rank order)."""
        if self.dim is None:
            return pieces[0]
        tp = len(pieces)
        parts, local_start = [], 0
        for _, size, chunk in self._chunks(full_shape, tp):
            section = torch.cat([p.narrow(self.dim, local_start, chunk) for p in pieces], dim=self.dim)
            parts.append(section.narrow(self.dim, 0, size))
            local_start += chunk
        return torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0]

    def runs(self, full_shape: Sequence[int], rank: int, tp: int) -> "Runs":
        """Where the flattened local piece lies in the flattened full tensor."""
        full_shape = tuple(full_shape)
        numel = math.prod(full_shape)
        if self.dim is None:
            return Runs(((0, 0, numel),), numel)
        d = self.dim
        outer = math.prod(full_shape[:d])
        inner = math.prod(full_shape[d + 1:])
        chunks = self._chunks(full_shape, tp)
        local_dim = sum(c for _, _, c in chunks)
        out = []
        for o in range(outer):
            local_pos = 0
            for start, size, chunk in chunks:
                lo = min(rank * chunk, size)
                real = min(chunk, size - lo)
                if real > 0:
                    out.append(((o * local_dim + local_pos) * inner, (o * full_shape[d] + start + lo) * inner,
                                real * inner))
                local_pos += chunk
        return Runs(tuple(out), outer * local_dim * inner)


@dataclass(frozen=True)
class Runs:
    """(local_start, full_start, length) triples, sorted by local_start; local elements not covered
    are padding."""

    runs: tuple[tuple[int, int, int], ...]
    local_numel: int

    @cached_property
    def starts(self) -> list[int]:
        return [r[0] for r in self.runs]

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The parts of local range [lo, hi) that hold real elements: (local_start, full_start, length)."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.runs):
            l_start, f_start, length = self.runs[i]
            if l_start >= hi:
                break
            a, b = max(lo, l_start), min(hi, l_start + length)
            if a < b:
                out.append((a, f_start + (a - l_start), b - a))
            i += 1
        return out


REPLICATED = ShardSpec()
