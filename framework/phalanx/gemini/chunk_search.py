"""Choosing the chunk size when the user gives none: the tightest packing, within the budget.

A chunk takes only its contents (`phalanx.gemini.chunk.chunk_numel_for`); the chunk size is the
capacity that decides where chunks are cut. A module's forward gathers every chunk holding one of
its parameters, whole, so the device must hold those chunks (and, in backward, as much again for
their gradients) at once: the capacity sets the largest module's working set, which can exceed
the device budget. (Before chunks were cut to their contents, a 30k-parameter model packed into
one default 8 MiB chunk "needed 20 MiB" on 2 ranks: 8 MiB gathered, 8 MiB of gradients, 4 MiB shard.)

So the search looks at the working set too. First the default range (`search_chunk_size` over
8-64 MiB, the tightest packing); if the largest module's working set there takes more than
`ROOM` of the budget (the rest is for activations and prefetching), the same search one octave
lower at a time ([4, 8) MiB, [2, 4) MiB, ... down to one element per rank), taking the first
octave whose best size fits. If none does, the size with the smallest working set (down to one
parameter per chunk, the least any chunking can need): the budget check then refuses only a
budget that no chunk size could meet, and says so.

The size found is then tightened (`tighten`): shrunk to the fullest chunk's contents, which packs
the parameters into exactly the same chunks (a small model in one 8 MiB chunk reports a chunk
size of its own size, the size its one chunk has).
"""
from __future__ import annotations

from typing import Sequence

from phalanx.gemini.chunk import _round_up, build_layouts, pack, search_chunk_size

ROOM = 0.5  # the share of the device budget the largest module's chunks and gradients may take
OCTAVE_STEPS = 16  # sizes tried per octave below the default range


def largest_working_set(numels: Sequence[int], trainable: Sequence[bool], modules: Sequence[Sequence[int]],
                        chunk_numel: int, world: int, shard_param_frac: float, itemsize: int) -> int:
    """Device bytes of the largest module's working set at this chunk size, counted as
    `phalanx.gemini.placement.working_set` counts it: each chunk holding one of the module's
    parameters gathered (twice if it has trainable parameters: the gradient buffer) plus, for a
    sharded chunk, the shard it is gathered from. `modules`: parameter indices per module."""
    chunk_of: dict[int, int] = {}
    cost: list[int] = []
    for ci, (idx, layout, _) in enumerate(build_layouts(list(numels), chunk_numel, world, shard_param_frac)):
        for i in idx:
            chunk_of[i] = ci
        full = layout.numel * itemsize
        grads = any(trainable[i] for i in idx)
        shard = 0 if layout.world_size == 1 else layout.shard_numel * itemsize
        cost.append(full * (2 if grads else 1) + shard)
    return max((sum(cost[ci] for ci in dict.fromkeys(chunk_of[i] for i in mod)) for mod in modules if mod),
               default=0)


def tighten(numels: Sequence[int], chunk_numel: int, world: int) -> int:
    """The smallest size (a multiple of `world`) that packs `numels` into the same chunks as
    `chunk_numel`: the contents of the fullest chunk that is not a lone oversized parameter.
    (Every chunk boundary stays: the next parameter still does not fit a smaller chunk.)"""
    used = [sum(numels[i] for i in idx) for idx in pack(list(numels), chunk_numel)]
    fullest = max((u for u in used if u <= chunk_numel), default=0)
    size = _round_up(max(fullest, 1), world)
    return size if size <= chunk_numel else chunk_numel


def search_chunk_numel(numels: Sequence[int], trainable: Sequence[bool], modules: Sequence[Sequence[int]], *,
                       budget: int, world: int, shard_param_frac: float, itemsize: int,
                       default_range: tuple[int, int, int]) -> tuple[int, bool]:
    """(chunk size in elements, whether it is the smallest-working-set fallback); see the
    module docstring. `default_range`: (lo, hi, step) in elements."""
    def working(size: int) -> int:
        return largest_working_set(numels, trainable, modules, size, world, shard_param_frac, itemsize)

    lo, hi, step = default_range
    room = ROOM * budget
    best = tighten(numels, search_chunk_size(numels, lo, hi, step, world), world)
    tried = {best: working(best)}
    if tried[best] <= room:
        return best, False
    top = lo
    while top > world:
        bottom = max(world, top // 2)
        size = search_chunk_size(numels, bottom, top - 1, max(1, (top - bottom) // OCTAVE_STEPS), world)
        size = tighten(numels, size, world)
        tried[size] = working(size)
        if tried[size] <= room:
            return size, False
        top = bottom
    tried.setdefault(world, working(world))  # every parameter of more than `world` elements alone
    smallest = min(tried, key=lambda s: (tried[s], -s))  # ties: the larger size, fewer collectives
    return smallest, True
