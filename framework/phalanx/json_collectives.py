"""Small metadata between ranks as JSON text in `uint8` tensors, never pickled objects.

torch's `*_object*` collectives pickle what they send and unpickle what they receive, so a rank
that receives runs whatever the sender's bytes say. The checkpoint save path (the temporary
directory's name, the optimizer fragment index, the hybrid plugin's manifests) passes names,
shapes, ranges and numbers only, which JSON carries: these helpers encode the object as UTF-8
JSON, send its length first (the objects differ in size from rank to rank), then the bytes.
Each is a collective (or a point-to-point pair) over `group` (default: every rank), wrapped in
`phalanx.launch.collective` so a hang or failure names the operation.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from phalanx.launch import collective, uses_nccl_path
from phalanx_kernels.accelerator import current_device


def _device(group: dist.ProcessGroup | None, device: torch.device | None) -> torch.device:
    """Where the tensors travel: `device` if given, else the GPU under NCCL (which carries no CPU
    tensors), else the CPU."""
    if device is not None:
        return torch.device(device)
    if uses_nccl_path(dist.get_backend(group)):
        return current_device()
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    try:
        text = json.dumps(obj)
    except TypeError as exc:
        raise TypeError(f"only JSON data (dicts, lists, str, numbers, bool, None) crosses ranks here: {exc}") from None
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device)


def _decode(payload: torch.Tensor) -> Any:
    return json.loads(payload.cpu().numpy().tobytes().decode())


def _length(payload: torch.Tensor) -> torch.Tensor:
    return torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)


def broadcast_json(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None,
                   device: torch.device | None = None) -> Any:
    """`obj` of the rank `src` (a global rank), returned on every rank of `group`; the other
    ranks' `obj` is ignored."""
    device = _device(group, device)
    with collective("json.broadcast"):
        if dist.get_rank() == src:
            payload = _encode(obj, device)
            dist.broadcast(_length(payload), src, group=group)
        else:
            size = torch.empty(1, dtype=torch.int64, device=device)
            dist.broadcast(size, src, group=group)
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(payload, src, group=group)
    return _decode(payload)


def all_gather_json(obj: Any, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> list:
    """Every rank's `obj`, in the order of the ranks of `group`, on every rank (its own too goes
    through JSON, so all ranks see the same values). The lengths are gathered first; the texts
    are padded to the longest."""
    device = _device(group, device)
    world = dist.get_world_size(group)
    payload = _encode(obj, device)
    with collective("json.all_gather"):
        sizes = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(sizes, _length(payload), group=group)
        lengths = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
        padded[:payload.numel()] = payload
        parts = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
    return [_decode(part[:n]) for part, n in zip(parts, lengths)]


def send_json(obj: Any, dst: int, device: torch.device | None = None) -> None:
    """Point to point: `obj` to the global rank `dst`, which calls `recv_json(src=this rank)`."""
    payload = _encode(obj, _device(None, device))
    with collective("json.send"):
        dist.send(_length(payload), dst)
        dist.send(payload, dst)


def recv_json(src: int, device: torch.device | None = None) -> Any:
    """Point to point: the object the global rank `src` sends with `send_json`."""
    device = _device(None, device)
    with collective("json.recv"):
        size = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(size, src)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.recv(payload, src)
    return _decode(payload)
