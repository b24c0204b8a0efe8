"""One optimizer param group, flattened and partitioned: model weights, master shard, gradient shard.

- The model's parameters become views into one padded flat buffer in the model's dtype. After a
  step, a single all-gather of the updated shards writes every parameter at once, with no
  per-parameter copies, and the `nn.Parameter` objects (which the model, the hooks and the
  user's code hold) stay the same objects.
- This rank keeps an fp32 *master* copy of the slice it owns, as a standalone `nn.Parameter`
  that replaces the group's params in the user's torch optimizer, so the optimizer's state is
  created for the slice only (1/N of the memory). Its `.grad` is the reduced fp32 gradient of
  the slice.
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
from phalanx.zero.partition import FlatLayout


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

        self.flat = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, params):
                view = self.flat[slot.offset:slot.end]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
        lo, hi = self.shard_range
        master = self._fp32_shard()
        master.copy_(self.flat[lo:hi])
        self.master = nn.Parameter(master)

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
    def accumulate_grad(self, flat_lo: int, values: torch.Tensor) -> None:
        """Add reduced gradient `values` for flat elements `[flat_lo, flat_lo + len)` (inside this
        rank's range) into the fp32 master gradient, copying device→host when offloading."""
        if values.numel() == 0:
            return
        if self.master.grad is None:
            self.master.grad = self._fp32_shard()
        start = self.layout.to_shard(self.rank, flat_lo)
        target = self.master.grad[start:start + values.numel()]
        if self.store is not None:  # transfer in the communication dtype, widen on the host
            self.store.add_to(target, values)
        else:
            target.add_(values.float())

    # ------------------------------------------------------------------ weights
    def start_publish(self):
        """Start the all-gather that writes every rank's updated master shard, cast to the model
        dtype and copied host→device, into the model's parameters. Returns (work, shard): keep
        the shard alive until the work is waited on."""
        if self.store is not None:
            shard = self.store.to_device(self.master.detach(), self.device, self.dtype)
        else:
            shard = self.master.detach().to(dtype=self.dtype)
        if self.layout.world_size == 1:
            self.flat.copy_(shard)
            return None, shard
        return comm.all_gather_into(self.flat, shard, self.group, "zero.all_gather_params"), shard

    def gather_full_master(self) -> torch.Tensor:
        """The full fp32 master weights of the group (unpadded, on the CPU). A collective."""
        shard = self.master.detach().to(self.device)
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        if self.layout.world_size == 1:
            full.copy_(shard)
        else:
            comm.wait(comm.all_gather_into(full, shard, self.group, "zero.gather_master"), "zero.gather_master")
        return full[:self.layout.numel].cpu()

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
