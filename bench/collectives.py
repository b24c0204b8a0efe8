"""gloo's collectives for a gradient reduction and a parameter gather, timed side by side.

Why ZeRO and FSDPPlugin reduce gradients on gloo with an all-to-all and gather parameters with one
broadcast per owner (`phalanx.zero.comm.is_gloo`): for one fp32 buffer of `--mb` MB on `--world`
gloo ranks (one thread each) it times, per rank, the median wall and CPU milliseconds of

- reduce (every rank ends with the sum of its 1/world part): torch's `reduce_scatter_single`
  (the peer it replaces), `all_reduce` (in place, then read the part: twice the bytes), and
  an all-to-all (a reduce-scatter's bytes; then the copies are added into a preallocated result:
  `phalanx.zero.comm.OwnPartExchange` and `sum_into`, what the ZeRO reducer and `fsdp_comms` do,
  a rank's own part kept out of the exchange where it lies at an end);
- gather (every rank ends with the whole buffer): torch's `all_gather_single` (the peer) and one
  broadcast per owner of its part straight into place.

    python bench/collectives.py                  # 2 ranks, 84 MB
    python bench/collectives.py --world 4 --mb 168

Run it on a quiet machine: it prints the CPU model and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import cpu_kind, load_average  # bench/timing.py


def rank_main(numel: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from phalanx.zero.comm import OwnPartExchange, sum_into

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    numel -= numel % world
    part = numel // world
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    scratch, full, result, received = torch.empty(numel), torch.empty(numel), torch.empty(part), torch.empty(numel)
    ranges = [(r * part, (r + 1) * part) for r in range(world)]

    torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def reduce_scatter():
        torch_reduce_scatter(result, x)

    def all_reduce():
        scratch.copy_(x)  # in place on a copy (the benchmark's input must stay the same)
        dist.all_reduce(scratch)
        result.copy_(scratch[rank * part:(rank + 1) * part])

    def all_to_all():  # the plugins' own exchange and sum (phalanx.zero.comm)
        exchange = OwnPartExchange(x, [part] * world, rank, None, "bench.all_to_all", receive=lambda n: received[:n])
        exchange.wait()
        sum_into(result, exchange.copies())

    def all_gather():
        torch_all_gather(full, x[rank * part:(rank + 1) * part])

    def broadcasts():
        works = [dist.broadcast(full[a:b], r, async_op=True) for r, (a, b) in enumerate(ranges)]
        for w in works:
            w.wait()

    timings = {}
    for name, fn in [("reduce_scatter", reduce_scatter), ("all_reduce", all_reduce), ("all_to_all", all_to_all),
                     ("all_gather", all_gather), ("broadcast_per_owner", broadcasts)]:
        fn()  # warm-up: connections, first-touch pages
        walls, cpus = [], []
        for _ in range(reps):
            dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        timings[name] = (statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3)
    # the all-to-all's sum equals the reduce-scatter's result (checked every run)
    want = torch.empty(part)
    torch_reduce_scatter(want, x)
    all_to_all()
    timings["max_abs_diff"] = float((result - want).abs().max())
    return timings


def main() -> None:
    import warnings

    from phalanx.testing import spawn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mb", type=float, default=84.0, help="fp32 buffer size in MB")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    load0 = load_average()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ranks = spawn(rank_main, args.world, int(args.mb * 1e6 / 4), args.reps, timeout=600)
    load1 = load_average()
    print(f"CPU: {cpu_kind()}, {os.cpu_count()} cores; load average {load0} -> {load1}")
    print(f"gloo, {args.world} ranks x 1 thread, {args.mb:.0f} MB fp32, median of {args.reps}; "
          "slowest rank's wall ms, its CPU ms")
    rows = {}
    for name in ("reduce_scatter", "all_reduce", "all_to_all", "all_gather", "broadcast_per_owner"):
        wall = max(r[name][0] for r in ranks)
        cpu = max(r[name][1] for r in ranks)
        rows[name] = {"wall_ms": wall, "cpu_ms": cpu}
    for name, peer in (("reduce_scatter", "reduce_scatter"), ("all_reduce", "reduce_scatter"),
                       ("all_to_all", "reduce_scatter"), ("all_gather", "all_gather"),
                       ("broadcast_per_owner", "all_gather")):
        r, base = rows[name], rows[peer]
        print(f"  {name:22s} {r['wall_ms']:8.1f} ms {r['cpu_ms']:8.1f} CPU ms   "
              f"{r['wall_ms'] / base['wall_ms']:.2f}x torch's {peer} (wall)")
    diff = max(r["max_abs_diff"] for r in ranks)
    print(f"  all-to-all + add vs reduce_scatter: max |diff| {diff:.2e}")
    print("BENCH_JSON " + json.dumps({"bench": "collectives", "world": args.world, "mb": args.mb, "cpu_model": cpu_kind(),
                                      "loadavg": [load0, load1], "rows": rows, "max_abs_diff": diff}))


if __name__ == "__main__":
    main()
