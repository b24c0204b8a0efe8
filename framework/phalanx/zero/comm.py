"""The collectives the ZeRO optimizer (and FSDP2's and Gemini's gloo paths) use, named so that a hang
or failure says which.

Every launch and every wait goes through `phalanx.launch.collective(name)`: when another rank
died or diverged, the error names this rank and the ZeRO operation instead of a bare gloo/NCCL
timeout. Nothing here decides *what* to communicate; that is the reducer's and the flat
group's job.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from phalanx.emulate.collectives import BACKEND as EMULATED_BACKEND
from phalanx.launch import collective

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_gloo(group: dist.ProcessGroup | None) -> bool:
    """Whether `group` runs on gloo (the CPU backend). Measured there by `bench/collectives.py`
    (84 MB fp32, the slowest rank's wall / CPU ms, quiet 2-core Xeon): 2 ranks reduce_scatter
    144 / 120, all_reduce 103 / 85, all_to_all + adding the copies 57 / 47, all_gather 131 / 104,
    one broadcast per owner 29 / 25; 4 ranks 223 / 100, 215 / 103, 108 / 54, 226 / 112, 79 / 36.
    With each rank's own part kept out of the exchange (`OwnPartExchange`, session 11) the
    all-to-all + add measured 42 / 38 on 2 ranks (reduce_scatter 99 / 85 in that run) and 97 / 48
    on 4 (213 / 100).
    So on gloo ZeRO and FSDPPlugin reduce with an all-to-all (each rank then adds the copies of
    its own part) and publish parameters with broadcasts; elsewhere (NCCL) with reduce-scatter
    and all-gather."""
    try:
        # the emulated GPU's collectives are gloo's (phalanx.emulate.collectives): gloo's costs apply
        return dist.get_backend(group) in ("gloo", EMULATED_BACKEND)
    except (RuntimeError, ValueError):
        return False


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None, name: str):
    """Start an in-place SUM all-reduce; returns the work handle."""
    with collective(name):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter_uneven(output: torch.Tensor, parts: Sequence[torch.Tensor], group: dist.ProcessGroup | None,
                          name: str):
    """Start a SUM reduce-scatter where rank r receives the sum of everyone's `parts[r]`.

    The parts may differ in size and may be empty: a bucket is a contiguous range of the flat
    gradient, cut at the rank boundaries of the ZeRO partition, so it is rarely split evenly.
    `reduce_scatter_single` (`reduce_scatter_tensor`) needs equal splits; the list form accepts
    uneven ones on gloo and on NCCL (where torch runs it as one coalesced reduce per owner), and
    every element still travels only to its owner.
    """
    with collective(name):
        return dist.reduce_scatter(output, list(parts), op=dist.ReduceOp.SUM, group=group, async_op=True)


class OwnPartExchange:
    """The exchange half of a SUM reduce-scatter, started: `tensor` is cut into consecutive parts
    of `sizes` (one per rank, uneven, possibly empty), part r goes to rank r, and this rank ends
    with every rank's copy of its own part (`copies()`, once `wait` returned); their sum is the
    reduced part. On gloo this moves the bytes of a reduce-scatter at the speed of gloo's pairwise
    all-to-all (`is_gloo`), leaving the sum to the caller, who adds the copies straight into where
    the result is wanted.

    When this rank's part lies at either end of `tensor` (always with two ranks) it stays out of
    the exchange: the all-to-all would copy it into the receive buffer only to be read back (gloo
    copies a rank's part to itself), which cost 25% of a 25 MB bucket's exchange on 2 ranks (19.4
    against 14.5 ms wall), and the receive buffer shrinks by one part. Each rank decides for
    itself: its own entries of the split sizes concern no other rank.

    `receive(numel)` gives the receive buffer (the reducer hands out kept ones); the caller keeps
    `tensor` unchanged until `wait` returns and, when its part stayed out, until the copies are
    summed."""

    def __init__(self, tensor: torch.Tensor, sizes: Sequence[int], rank: int, group: dist.ProcessGroup | None,
                 name: str, receive=None):
        world = len(sizes)
        self.name = name
        self.part = own = sizes[rank]
        lo = sum(sizes[:rank])
        hi = lo + own
        send_sizes, receive_sizes = list(sizes), [own] * world
        self.own: torch.Tensor | None = None
        send = tensor
        if own and (lo == 0 or hi == tensor.numel()):
            self.own = tensor[lo:hi]
            send = tensor[hi:] if lo == 0 else tensor[:lo]
            send_sizes[rank] = receive_sizes[rank] = 0
        numel = sum(receive_sizes)
        self.received = (receive or (lambda n: torch.empty(n, dtype=tensor.dtype, device=tensor.device)))(numel)
        with collective(name):
            self.work = dist.all_to_all_single(self.received, send, output_split_sizes=receive_sizes,
                                               input_split_sizes=send_sizes, group=group, async_op=True)

    def wait(self) -> None:
        wait(self.work, self.name)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def copies(self) -> list[torch.Tensor]:
        """Every rank's copy of this rank's part (this rank's own first when it stayed out)."""
        if not self.part:
            return [self.received[:0]]
        received = list(self.received.split(self.part))
        return ([self.own] if self.own is not None else []) + received


def sum_into(out: torch.Tensor, values: Sequence[torch.Tensor], widen: bool = False) -> torch.Tensor:
    """Write the sum of `values` (an exchange's copies) into `out`: the first two in one `add`,
    the rest added in place (summing through a [k, n] view cost as much as the exchange). With
    bf16/fp16 copies and an fp32 `out`, torch computes that first sum in the copies' dtype and
    rounds it (1 + 2^-9 -> 1 in bf16) before writing `out`: ZeRO's bf16 reduction on gloo rounds
    like DDP's bf16 all-reduce, and its CPU-offload path (which sums on the device in that dtype
    before the one device-to-host copy) gives the same numbers. `widen=True` adds in `out`'s
    dtype instead (FSDPPlugin's bf16 exchange, which must equal an fp32 reduce-scatter)."""
    if widen or len(values) == 1:
        out.copy_(values[0])
        rest = values[1:]
    else:
        torch.add(values[0], values[1], out=out)
        rest = values[2:]
    for value in rest:
        out.add_(value)
    return out


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, name: str):
    """Start an all-gather of equal shards into one flat `output` (rank order)."""
    with collective(name):
        return _all_gather_single(output, shard, group=group, async_op=True)


def broadcast_from_first(tensor: torch.Tensor, group: dist.ProcessGroup | None, name: str) -> None:
    """Overwrite `tensor` on every rank with the first rank's (of `group`) value."""
    src = 0 if group is None or group is dist.group.WORLD else dist.get_global_rank(group, 0)
    with collective(name):
        dist.broadcast(tensor, src=src, group=group)


def broadcast_async(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, name: str):
    """Start a broadcast of `tensor` from rank `src` of `group` (a group rank); returns the handle."""
    global_src = src if group is None or group is dist.group.WORLD else dist.get_global_rank(group, src)
    with collective(name):
        return dist.broadcast(tensor, src=global_src, group=group, async_op=True)


def start_broadcast_into_place(full: torch.Tensor, ranges: Sequence[tuple[int, int]], mine: torch.Tensor | None,
                               rank: int, group: dist.ProcessGroup | None, name: str) -> list:
    """Start filling `full` (flat along dim 0) on every rank of `group` from its owners: rank r
    owns rows `ranges[r]` (possibly empty, possibly uneven) and broadcasts them straight into their
    place; `mine` is this rank's part, copied into its place first. Returns the work handles
    (none for a one-rank group); `full` is complete once they are waited on.

    The all-gather of one sharded buffer without a staging copy: gloo's all-gather into one tensor
    stages the whole output in a temporary of its own (+1 output resident, measured in Gemini:
    +128 MiB for a 128 MiB chunk), the broadcasts write in place and are the faster collective
    there (`is_gloo`). Used by ZeRO's per-parameter master gather, FSDP2's gloo all-gather
    (`phalanx.booster.plugins.fsdp_comms.BroadcastAllGather`) and Gemini's chunk gathers."""
    works = []
    for r, (a, b) in enumerate(ranges):
        if a == b:
            continue
        if r == rank:
            full[a:b].copy_(mine)
        if len(ranges) > 1:
            works.append(broadcast_async(full[a:b], r, group, name))
    return works


def assemble_from_owners(full: torch.Tensor, ranges: Sequence[tuple[int, int]], mine: torch.Tensor | None,
                         rank: int, group: dist.ProcessGroup | None, name: str) -> torch.Tensor:
    """`start_broadcast_into_place`, waited on: returns the filled `full`."""
    for work in start_broadcast_into_place(full, ranges, mine, rank, group, name):
        wait(work, name)
    return full


def equal_ranges(numel: int, world: int) -> list[tuple[int, int]]:
    """`[r * numel, (r + 1) * numel)` for each rank: equal shards laid back to back."""
    return [(r * numel, (r + 1) * numel) for r in range(world)]


def wait(work, name: str) -> None:
    """Wait for a work handle (None means nothing was launched: a one-rank group)."""
    if work is None:
        return
    with collective(name):
        work.wait()
