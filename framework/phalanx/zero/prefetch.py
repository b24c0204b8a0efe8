"""Publish the updated parameters while the next forward runs (ZeroConfig(overlap_param_gather=True)).

Without it, `step` all-gathers every updated shard into the model's parameters and returns when
they are all current. With it, `step` only *starts* publishing, chunk by chunk in forward order
(the chunks are the gradient buckets' contiguous flat ranges), and each module's forward
pre-hook waits for the chunks holding its own parameters: the collectives of later layers run
while earlier layers compute.

A chunk is a contiguous range of the flat layout, and the partition gives each rank one
contiguous range, so a chunk is usually owned by one or two ranks unevenly; an all-gather needs
equal parts, so each owner *broadcasts* its part instead (the same bytes: every rank receives
every part it does not own once).

The price: between `step` and the next forward the model's parameters may be stale or half
written. Anything that reads them there must call `ZeroOptimizer.wait_for_params()` first
(`ZeroPlugin`'s checkpoint hooks do; the next `step` does). That is why it is opt-in: a training
loop hook that reads the weights after each step (an EMA, say) would read old values.
"""
from __future__ import annotations

import collections
import functools
from typing import Sequence

from torch import nn

from phalanx.zero import comm
from phalanx.zero.flat_group import FlatParamGroup

_OP = "zero.publish_params"


class ParamPrefetch:
    def __init__(self, chunks: Sequence[tuple[FlatParamGroup, int, int]], model: nn.Module):
        """`chunks`: (group, lo, hi) flat ranges in forward order, covering every parameter."""
        self.chunks = list(chunks)
        self._pending: collections.deque[tuple[int, list]] = collections.deque()
        chunk_of: dict[int, int] = {}
        for i, (group, lo, hi) in enumerate(self.chunks):
            for slot, p in zip(group.layout.slots, group.params):
                if lo <= slot.offset < hi:
                    chunk_of[id(p)] = i
        self._handles = []
        for module in model.modules():
            own = [chunk_of[id(p)] for p in module.parameters(recurse=False) if id(p) in chunk_of]
            if own:
                hook = functools.partial(self._before_forward, max(own))
                self._handles.append(module.register_forward_pre_hook(hook))

    def launch(self) -> None:
        """Start publishing every chunk (after the optimizer updated the master shards)."""
        self.wait_all()
        for i, (group, lo, hi) in enumerate(self.chunks):
            self._pending.append((i, group.start_publish_range(lo, hi, _OP)))

    def wait_until(self, index: int) -> None:
        """Wait for chunks 0..index (they complete in order on every backend we use)."""
        while self._pending and self._pending[0][0] <= index:
            _, works = self._pending.popleft()
            for work in works:
                comm.wait(work, _OP)

    def wait_all(self) -> None:
        self.wait_until(len(self.chunks))

    def _before_forward(self, index: int, module, args) -> None:
        if self._pending:
            self.wait_until(index)
