"""One optimizer param group, flattened and partitioned: model weights, master shard, gradient shard.

- The model's parameters become views into one padded flat buffer in the model's dtype. After a
  step, a single all-gather of the updated shards writes every parameter at once, with no
  per-parameter copies, and the `nn.Parameter` objects (which the model, the hooks and the
  user's code hold) stay the same objects.
- This rank keeps an fp32 *master* copy of the slice it owns, as a standalone `nn.Parameter`
  that replaces the group's params in the user's torch optimizer, so the optimizer's state is
  created for the slice only (1/N of the memory). Its `.grad` is the reduced fp32 gradient of
  the slice. For an fp32 model without offload the master *is* the flat buffer's own slice
  (`master_is_view`): no second copy of it, and the step updates the rank's own parameters in
  place, so publishing only has to move the other ranks' parts.
- With CPU offload (`store`, a `phalanx.zero.offload.HostStore`) the master shard, its gradient
  and (therefore) the optimizer state live in host memory: gradients are copied device→host as
  they arrive from the reduction, the updated shard host→device before the all-gather, both
  through the store, which counts the bytes. Without, they live on the model's device.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from phalanx.zero import comm
from phalanx.zero.offload import HostStore
from phalanx.zero.partition import FlatLayout, Slot


class FlatParamGroup:
    def __init__(self, params: Sequence[nn.Parameter], *, rank: int, world_size: int,
                 process_group: dist.ProcessGroup | None, store: HostStore | None = None):
        params = list(params)
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"a ZeRO param group must hold parameters of one dtype on one device; got dtypes "
                             f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}: cast the model first "
                             "(ZeroPlugin does) or split the group")
        self.params = params
        self.rank = rank
        self.group = process_group
        self.layout = FlatLayout.build([p.numel() for p in params], world_size)
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.store = store
        self.host = torch.device("cpu") if store is not None else self.device

        self.flat = self._flatten(params)
        lo, hi = self.shard_range
        self.master_is_view = self.dtype == torch.float32 and store is None
        if self.master_is_view:
            master = self.flat[lo:hi]
        else:
            master = self._fp32_shard()
            master.copy_(self.flat[lo:hi])
        self.master = nn.Parameter(master)
        self._written: set[int] = set()  # starts of the ranges of master.grad written since the step
        self._grad_storage: torch.Tensor | None = None  # master.grad's memory, kept between steps

    def _flatten(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The flat buffer, filled parameter by parameter, each parameter's own memory released as
        soon as it is copied (its `.data` becomes the view). The buffer is allocated uninitialised
        (only the padding is zeroed): on the CPU its pages become resident as they are written, so
        the build peaks at the model plus one parameter, not twice the model (a zeroed buffer is
        resident at once, while every original still is). On a GPU the allocation is resident at
        once either way."""
        flat = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        flat[self.layout.numel:].zero_()
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, params):
                view = flat[slot.offset:slot.end]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
        return flat

    def _fp32_shard(self) -> torch.Tensor:
        if self.store is not None:
            return self.store.empty(self.layout.shard_numel)
        return torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ coordinates
    @property
    def shard_range(self) -> tuple[int, int]:
        """The flat elements this rank owns."""
        return self.layout.rank_range(self.rank)

    # ------------------------------------------------------------------ gradients
    def _grad_shard(self) -> torch.Tensor:
        """The fp32 master gradient, handed out at the first reduction after a step. On the
        device its memory is allocated once and kept (on the CPU a fresh shard-sized tensor costs
        page faults every step, as much time as several copies of it); every element that holds
        a parameter is written by exactly one bucket first (`_written` records which ranges
        were), so only the padding needs zeros. Offloaded, a zeroed host buffer is taken from
        the store each step (only ever added to) and given back at the end of the step."""
        if self.master.grad is None:
            if self.store is not None:
                self.master.grad = self._fp32_shard()
            else:
                if self._grad_storage is None:
                    self._grad_storage = torch.empty(self.layout.shard_numel, dtype=torch.float32,
                                                     device=self.device)
                    lo, _ = self.shard_range
                    self._grad_storage[max(0, min(self.layout.numel - lo, self.layout.shard_numel)):].zero_()
                self.master.grad = self._grad_storage
            self._written = set()
        return self.master.grad

    def _grad_slice(self, flat_lo: int, numel: int) -> torch.Tensor:
        start = self.layout.to_shard(self.rank, flat_lo)
        return self._grad_shard()[start:start + numel]

    def reduce_target(self, flat_lo: int, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a reduction of flat elements `[flat_lo, flat_lo + numel)` (inside this rank's
        range) may write its result: straight into the fp32 master gradient when this is the
        range's first reduction since the last step and no cast or host copy is needed (fp32
        model, no offload), which saves a temporary and a copy per bucket; None: reduce into a
        temporary and pass it to `accumulate_grad`."""
        if numel == 0 or self.store is not None or dtype != torch.float32:
            return None
        target = self._grad_slice(flat_lo, numel)
        if flat_lo in self._written:
            return None
        self._written.add(flat_lo)
        return target

    def accumulate_grad(self, flat_lo: int, *values: torch.Tensor) -> None:
        """Add reduced gradient `values` (one tensor, or several whose sum is the reduced
        gradient: an all-to-all's copies) for flat elements `[flat_lo, flat_lo + len)` (inside
        this rank's range) into the fp32 master gradient (the first reduction of a range since
        the last step writes instead of adding), copying device→host when offloading."""
        if values[0].numel() == 0:
            return
        target = self._grad_slice(flat_lo, values[0].numel())
        if self.store is not None:  # sum on the device, transfer once in the communication dtype
            total = sum(values[1:], values[0])  # a new tensor (values[0] itself is not changed)
            self.store.add_to(target, total)
            return
        if flat_lo not in self._written:
            comm.sum_into(target, values)
            self._written.add(flat_lo)
            return
        for v in values:
            target.add_(v)

    # ------------------------------------------------------------------ weights
    def start_publish(self):
        """Start writing every rank's updated master shard, cast to the model dtype and copied
        host→device, into the model's parameters: one all-gather, or on gloo one broadcast per
        owner from its own range of the flat buffer (five times cheaper there, `comm.is_gloo`).
        Returns (works, shard): keep the shard alive until the works are waited on."""
        if self.layout.world_size > 1 and comm.is_gloo(self.group):
            return self.start_publish_range(0, self.layout.padded_numel, "zero.broadcast_params"), None
        if self.master_is_view:  # the own part is already in place: an in-place all-gather
            if self.layout.world_size == 1:
                return [], None
            shard = self.master.detach()
            return [comm.all_gather_into(self.flat, shard, self.group, "zero.all_gather_params")], shard
        if self.store is not None:
            shard = self.store.to_device(self.master.detach(), self.device, self.dtype)
        else:
            shard = self.master.detach().to(dtype=self.dtype)
        if self.layout.world_size == 1:
            self.flat.copy_(shard)
            return [], shard
        return [comm.all_gather_into(self.flat, shard, self.group, "zero.all_gather_params")], shard

    def start_publish_range(self, lo: int, hi: int, name: str) -> list:
        """Start writing the updated master values of flat elements `[lo, hi)` into every rank's
        parameters: each owner casts its part into its own flat buffer and broadcasts it from
        there (the parts are uneven, so not an all-gather). Returns the work handles."""
        works = []
        own_lo, _ = self.shard_range
        for r, (a, b) in enumerate(self.layout.split_by_rank(lo, hi)):
            if a == b:
                continue
            if r == self.rank and not self.master_is_view:
                values = self.master.detach()[a - own_lo:b - own_lo]
                if self.store is not None:
                    values = self.store.to_device(values, self.device, self.dtype)
                self.flat[a:b].copy_(values)
            if self.layout.world_size > 1:
                works.append(comm.broadcast_async(self.flat[a:b], r, self.group, name))
        return works

    def gather_full_master(self) -> torch.Tensor:
        """The full fp32 master weights of the group (unpadded, on the CPU). A collective."""
        shard = self.master.detach().to(self.device)
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        if self.layout.world_size == 1:
            full.copy_(shard)
        else:
            comm.wait(comm.all_gather_into(full, shard, self.group, "zero.gather_master"), "zero.gather_master")
        return full[:self.layout.numel].cpu()

    def gather_master_slot(self, slot: Slot) -> torch.Tensor:
        """The full fp32 master of one parameter (flat, on the CPU): each rank that owns part of it
        broadcasts that part. A collective over the group (every rank calls it for the same slot);
        a streamed save gathers one parameter at a time with it."""
        own_lo, _ = self.shard_range
        ranges = [(a - slot.offset, b - slot.offset) for a, b in self.layout.split_by_rank(slot.offset, slot.end)]
        a, b = ranges[self.rank]
        mine = self.master.detach()[a + slot.offset - own_lo:b + slot.offset - own_lo] if a < b else None
        full = torch.empty(slot.numel, dtype=torch.float32, device=self.device)
        return comm.assemble_from_owners(full, ranges, mine, self.rank, self.group, "zero.gather_master_param").cpu()

    def load_master(self, full_values: dict[int, torch.Tensor]) -> None:
        """Set this rank's master slice from full parameter values keyed by position in the group
        (parameters missing from the dict keep their master values)."""
        with torch.no_grad():
            for slot, a, b in self.layout.owned_slots(self.rank):
                value = full_values.get(slot.index)
                if value is None:
                    continue
                start = self.layout.to_shard(self.rank, slot.offset + a)
                self.master[start:start + (b - a)].copy_(value.detach().reshape(-1)[a:b].float())
