"""One optimizer param group, flattened and partitioned: model weights, master shard, gradient shard.

- The model's parameters become views into one padded flat buffer in the model's dtype. After a
  step, a single all-gather of the updated shards writes every parameter at once, with no
  per-parameter copies, and the `nn.Parameter` objects (which the model, the hooks and the
  user's code hold) stay the same objects.
- This rank keeps an fp32 *master* copy of the slice it owns, as a standalone `nn.Parameter`
  that replaces the group's params in the user's torch optimizer, so the optimizer's state is
  created for the slice only (1/N of the memory). Its `.grad` is the reduced fp32 gradient of
  the slice.
- `host` is where the master shard, its gradient and (therefore) the optimizer state live: the
  model's device, or the CPU with `cpu_offload=True`. Gradients are copied device→host as they
  arrive from the reduction and the updated shard host→device before the all-gather; on a
  CPU-only machine the copies are no-ops but the code path is the same.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from phalanx.zero import comm
from phalanx.zero.partition import FlatLayout


def _host_buffer(numel: int, host: torch.device) -> torch.Tensor:
    """An fp32 buffer on `host`, page-locked when it is the CPU side of a GPU run (so that
    device↔host copies can run at full bandwidth)."""
    pin = host.type == "cpu" and torch.cuda.is_available()
    return torch.zeros(numel, dtype=torch.float32, device=host, pin_memory=pin)


class FlatParamGroup:
    def __init__(self, params: Sequence[nn.Parameter], *, rank: int, world_size: int,
                 process_group: dist.ProcessGroup | None, host: torch.device | None = None):
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
        self.host = host or self.device

        self.flat = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, params):
                view = self.flat[slot.offset:slot.end]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
        lo, hi = self.shard_range
        master = _host_buffer(self.layout.shard_numel, self.host)
        master.copy_(self.flat[lo:hi])
        self.master = nn.Parameter(master)

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
            self.master.grad = _host_buffer(self.layout.shard_numel, self.host)
        start = self.layout.to_shard(self.rank, flat_lo)
        target = self.master.grad[start:start + values.numel()]
        # Transfer in the communication dtype (half the bytes for bf16), widen on the host.
        target.add_(values.to(self.host).float())

    # ------------------------------------------------------------------ weights
    def start_publish(self):
        """Start the all-gather that writes every rank's updated master shard, cast to the model
        dtype and copied host→device, into the model's parameters. Returns (work, shard): keep
        the shard alive until the work is waited on."""
        shard = self.master.detach().to(device=self.device, dtype=self.dtype)
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
