"""The memory tracer: the non-model memory each step of an iteration needs (for `auto`).

During the warm-up iteration it records, at every module step (a position of the chunk
manager), how much memory the step needs besides the chunks: activations saved for backward,
temporaries. On CUDA that is measured: `torch.cuda.memory_allocated()` minus the bytes the
manager has on the device. On a CPU "device" nothing separates the two, so it is estimated
from the tensors autograd saves for backward (the manager's pack hook, `ChunkManager.saved_tensors`,
reports every saved tensor that is not a view of a chunk, and the tracer adds up their bytes);
backward steps are charged the forward's total, an upper bound, since backward only frees saved
activations.

It also records the peak *working set* of the iteration: gathered chunks, gradient buffers and
non-model memory at the same step — what `AutoPlacement` must keep free when it moves
optimizer chunks to the device.
"""
from __future__ import annotations

import torch

from phalanx_kernels.accelerator import device_module, is_accelerator
from torch import nn

from phalanx.gemini.tiers import DEVICE


class MemoryTracer:
    def __init__(self, manager):
        self.manager = manager
        self.by_position: list[int] = []
        self.peak_working = 0
        self._live = 0
        self._seen: set[tuple[int, int]] = set()
        self._recording = False
        self._forward_total = 0

    # ------------------------------------------------------------------ saved activations (CPU)
    def saw(self, t: torch.Tensor) -> None:
        """A tensor autograd saved that is not a chunk view (the manager's pack hook filters
        those): count its storage once while a traced forward runs."""
        if not self._recording or isinstance(t, nn.Parameter) or t.device.type == "meta":
            return
        try:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        except RuntimeError:
            return
        if key not in self._seen:
            self._seen.add(key)
            self._live += key[1]

    def start_forward(self) -> None:
        self.by_position.clear()
        self.peak_working = 0
        self._live, self._seen = 0, set()
        self._recording = True

    def stop_forward(self) -> None:
        if self._recording:
            self._recording = False
            self._forward_total = self._live

    # ------------------------------------------------------------------ per step
    def nonmodel_now(self) -> int:
        tiers = self.manager.tiers
        if is_accelerator(tiers.device):
            return max(0, device_module(tiers.device).memory_allocated(tiers.device) - tiers.bytes[DEVICE])
        return self._live if self._recording else self._forward_total

    def record(self, pos: int, chunks=(), backward: bool = False) -> None:
        """Called right after the step at `pos` gathered `chunks`."""
        nonmodel = self.nonmodel_now()
        while len(self.by_position) <= pos:
            self.by_position.append(0)
        self.by_position[pos] = max(self.by_position[pos], nonmodel)
        m = self.manager
        pinned = sum((0 if c.full_is_shard else c.full_bytes()) + c.shard_bytes()
                     for c in m.chunks if m.gathered(c))
        grads = {c.index for c in m.chunks if c.grad_full is not None}
        if backward:  # this step's gradient buffers are about to be allocated
            grads |= {c.index for c in chunks if c.trainable}
        pinned += sum(m.chunks[i].full_bytes() for i in grads)
        self.peak_working = max(self.peak_working, pinned + nonmodel)

    def nonmodel(self, pos: int) -> int:
        return self.by_position[pos] if pos < len(self.by_position) else max(self.by_position, default=0)
