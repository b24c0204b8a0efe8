"""The process group's collectives on device tensors (NCCL on GPUs), checked against the values
they must produce, plus one all-reduce bandwidth figure."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from phalanx.launch import context


def _tensor(values, device):
    return torch.tensor(values, dtype=torch.float32, device=device)


def all_reduce():
    ctx = context()
    t = _tensor([ctx.rank + 1.0] * 4, ctx.device)
    dist.all_reduce(t)
    want = ctx.world_size * (ctx.world_size + 1) / 2
    assert torch.equal(t.cpu(), torch.full((4,), want)), f"got {t.cpu().tolist()}, want {want}"


def all_gather_and_reduce_scatter():
    ctx = context()
    n = ctx.world_size
    out = torch.empty(2 * n, device=ctx.device)
    dist.all_gather_into_tensor(out, _tensor([ctx.rank, ctx.rank], ctx.device))
    assert out.cpu().tolist() == [float(r) for r in range(n) for _ in range(2)], out.cpu().tolist()
    part = torch.empty(2, device=ctx.device)
    dist.reduce_scatter_tensor(part, torch.arange(2 * n, dtype=torch.float32, device=ctx.device))
    assert part.cpu().tolist() == [n * (2.0 * ctx.rank), n * (2.0 * ctx.rank + 1)], part.cpu().tolist()


def broadcast_and_all_to_all():
    ctx = context()
    n = ctx.world_size
    t = _tensor([ctx.rank + 7.0], ctx.device)
    dist.broadcast(t, src=0)
    assert t.item() == 7.0
    send = _tensor([100.0 * ctx.rank + r for r in range(n)], ctx.device)
    recv = torch.empty(n, device=ctx.device)
    dist.all_to_all_single(recv, send)
    assert recv.cpu().tolist() == [100.0 * r + ctx.rank for r in range(n)], recv.cpu().tolist()


def bandwidth(megabytes: int = 64):
    ctx = context()
    if ctx.world_size == 1:
        return "one rank: nothing travels", {}
    t = torch.ones(megabytes * 2**20 // 4, device=ctx.device)
    dist.all_reduce(t)  # warm-up
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(t)
    t.sum().item()  # wait for the device
    seconds = (time.perf_counter() - start) / 3
    bus = 2 * (ctx.world_size - 1) / ctx.world_size * t.numel() * 4 / seconds / 1e9
    return f"{megabytes} MiB all-reduce {seconds * 1e3:.1f} ms, bus bandwidth {bus:.2f} GB/s", {"bus_gbps": bus}


def checks():
    return [("all_reduce", all_reduce), ("all_gather / reduce_scatter", all_gather_and_reduce_scatter),
            ("broadcast / all_to_all", broadcast_and_all_to_all), ("all_reduce bandwidth", bandwidth)]
