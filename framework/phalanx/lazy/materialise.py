"""Materialising a lazy (meta-device) model under the data-parallel plugins, one tensor at a time.

- `materialise_whole` (DDP, ZeRO-1/2): every parameter whole on this rank, cast to the compute
  dtype as it arrives, so the peak is the model in that dtype plus one tensor as stored;
- `materialise_fsdp_shards` (FSDPPlugin, after `fully_shard` on the meta model): only this rank's
  rows of each parameter are allocated and read;
- `flat_reader` (GeminiPlugin, ZeRO masters): a function that reads elements `[a, b)` of a
  flattened parameter, for filling flat shards.

Parameters are filled in place (`torch.utils.swap_tensors`): an optimizer the user built on the
meta model keeps pointing at the same `nn.Parameter` objects, and tied parameters stay tied.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from phalanx.lazy.sources import flat_range, materialise_buffers

FlatReader = Callable[[str, torch.Tensor, int, int], torch.Tensor]


def swap_in(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give the meta parameter `param` the storage of `value`, keeping the Python object."""
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))


def materialise_whole(model: nn.Module, source, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Every meta parameter and buffer of `model` gets its full value from `source`, parameters
    cast to `dtype` (default: as built) one at a time."""
    device = torch.device(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta:
                swap_in(p, source.full(name, p).to(device, dtype or p.dtype))
    materialise_buffers(model, source)


def buffers_first(model: nn.Module, source) -> dict[str, torch.Tensor]:
    """Materialise the buffers while the parameters are still on the meta device, and return them
    by name: a later `to_empty` (FSDP) replaces every tensor and they are put back afterwards."""
    materialise_buffers(model, source)
    return {n: b for n, b in model.named_buffers()}


def local_rows(p: torch.Tensor) -> tuple[int, int]:
    """Rows `[start, stop)` of dimension 0 that this rank holds of `p`: its `Shard(0)` piece for
    an FSDP2 DTensor, every row for a plain tensor (a 0-d tensor counts as one row)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if p.dim() == 0:
        return 0, 1
    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0], offset[0] + shape[0]


def materialise_fsdp_shards(model: nn.Module, source, device: torch.device | str,
                            buffers: dict[str, torch.Tensor]) -> None:
    """After `fully_shard` on the meta model: allocate this rank's shard of every parameter
    (`to_empty`), fill it with its rows from `source`, and put the buffers back."""
    from torch.distributed.tensor import DTensor

    model.to_empty(device=torch.device(device))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            start, stop = local_rows(p)
            local.copy_(source.rows(name, p, start, stop, local.dtype).reshape(local.shape))


def flat_reader(source, dtype: torch.dtype = torch.float32) -> FlatReader:
    """`read(name, param, a, b)`: elements `[a, b)` of the flattened parameter, in `dtype`."""
    def read(name: str, param: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return flat_range(source, name, param, a, b, dtype)
    return read
