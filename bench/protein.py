"""Evoformer forward + backward: time and peak memory against sequence length, one process against
Dynamic Axial Parallelism on 2 ranks, with and without chunked attention; and the longest
sequence that fits a memory budget either way (extrapolated from the measured growth).

    python bench/protein.py                                   # CPU defaults: small channels, short sequences
    python bench/protein.py --lengths 64 128 256 384 --c-m 256 --c-z 128 --budget-gb 40   # a GPU

Each configuration runs in fresh processes (phalanx.testing.spawn: one thread per rank on CPU),
so the peak memory is that configuration's own: CUDA's max_memory_allocated on a GPU, the peak
resident set size of the process on CPU. Prints a table, the DAP/one-process ratios, and one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _measure(length: int, msa_rows: int, c_m: int, c_z: int, blocks: int, chunk: int | None, reps: int) -> dict:
    """One rank: build the stack, run fwd+bwd `reps` times, report the median time and peak memory."""
    import torch
    import torch.distributed as dist

    from apps.protein.model.dap import Axial, DapAxial
    from apps.protein.model.evoformer import EvoformerConfig, EvoformerStack
    from phalanx.launch import context

    device = context().device
    world = dist.get_world_size()
    ax = DapAxial() if world > 1 else Axial()
    torch.manual_seed(0)
    cfg = EvoformerConfig(c_m=c_m, c_z=c_z, heads_msa=8, c_hidden_msa=max(c_m // 8, 4), heads_pair=4,
                          c_hidden_pair=max(c_z // 4, 4), c_hidden_mul=c_z, c_hidden_opm=max(c_m // 8, 4),
                          chunk_size=chunk)
    stack = EvoformerStack(cfg, blocks).to(device)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m = torch.randn(1, msa_rows, length, c_m, device=device)
    z = torch.randn(1, length, length, c_z, device=device)
    msa_mask = torch.ones(1, msa_rows, length, device=device)
    pair_mask = torch.ones(1, length, length, device=device)
    m_local, z_local = ax.scatter(m, 1).requires_grad_(), ax.scatter(z, 1).requires_grad_()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        mo, zo = stack(m_local, z_local, msa_mask, pair_mask, ax)
        (mo.float().square().mean() + zo.float().square().mean()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        stack.zero_grad()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2 ** 20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024  # KiB -> MiB (Linux)
    return {"time_s": statistics.median(times[1:]), "peak_mib": peak}


def measure(world: int, **kwargs) -> dict:
    from phalanx.testing import spawn

    results = spawn(_measure, world, timeout=1800, **kwargs)
    return {"time_s": max(r["time_s"] for r in results), "peak_mib": max(r["peak_mib"] for r in results)}


def longest_fitting(points: list[tuple[int, float]], budget_mib: float) -> int | None:
    """Extrapolate peak memory ~ a + b L^2 (the pair representation and its attention logits grow
    with the square of the length) through the two longest measured points."""
    if len(points) < 2:
        return None
    (l1, m1), (l2, m2) = points[-2], points[-1]
    b = (m2 - m1) / max(l2 ** 2 - l1 ** 2, 1)
    if b <= 0:
        return None
    a = m2 - b * l2 ** 2
    return int(math.sqrt(max(budget_mib - a, 0) / b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--msa-rows", type=int, default=16)
    parser.add_argument("--c-m", type=int, default=32)
    parser.add_argument("--c-z", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=8, help="attention rows per chunk in the chunked runs")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget-gb", type=float, default=4.0)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    machine = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
               "loadavg": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None,
               "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    rows = []
    for length in args.lengths:
        for world in (1, 2):
            for chunk in (None, args.chunk):
                r = measure(world, length=length, msa_rows=args.msa_rows, c_m=args.c_m, c_z=args.c_z,
                            blocks=args.blocks, chunk=chunk, reps=args.reps)
                rows.append({"length": length, "ranks": world, "chunk": chunk, **r})
                print(f"L={length:4d} ranks={world} chunk={str(chunk):>4}  fwd+bwd {r['time_s'] * 1e3:9.1f} ms  "
                      f"peak {r['peak_mib']:8.1f} MiB/rank", flush=True)
    budget = args.budget_gb * 1024
    fits = {}
    for world in (1, 2):
        for chunk in (None, args.chunk):
            pts = [(r["length"], r["peak_mib"]) for r in rows if r["ranks"] == world and r["chunk"] == chunk]
            fits[f"ranks{world}_chunk{chunk}"] = longest_fitting(pts, budget)
    ratios = {}
    for length in args.lengths:
        one = next(r for r in rows if r["length"] == length and r["ranks"] == 1 and r["chunk"] is None)
        dap = next(r for r in rows if r["length"] == length and r["ranks"] == 2 and r["chunk"] is None)
        ratios[length] = {"time_dap2_over_one": dap["time_s"] / one["time_s"],
                          "peak_dap2_over_one": dap["peak_mib"] / max(one["peak_mib"], 1e-9)}
        print(f"L={length}: DAP-2 / one process: time x{ratios[length]['time_dap2_over_one']:.2f}, "
              f"peak memory per rank x{ratios[length]['peak_dap2_over_one']:.2f}")
    for key, value in fits.items():
        print(f"longest sequence in {args.budget_gb:g} GB per rank ({key}): ~{value} residues (extrapolated)")
    print(json.dumps({"bench": "protein_evoformer", "machine": machine, "args": vars(args), "rows": rows,
                      "ratios": ratios, "longest_fitting": fits}))


if __name__ == "__main__":
    main()
