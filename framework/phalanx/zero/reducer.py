"""Gradient reduction in flat buckets, launched from backward hooks so it overlaps compute.

Each parameter's `post_accumulate_grad` hook copies its gradient into a flat bucket (a
contiguous range of its group's flat layout, about `bucket_numel` elements, filled in reverse
model order), divided by the world size on the way in, and frees `param.grad`. When a bucket is
full it is reduced with an asynchronous collective while backward carries on computing earlier
layers.

Both stages reduce-scatter the bucket, cut at the rank boundaries of the partition, so each
rank receives only the sum of the part it owns (the same bytes as half an all-reduce; a rank
never reads the rest of the reduced gradient, so an all-reduce would be wasted work). On gloo,
whose reduce-scatter is slow, the same bytes travel by an all-to-all: each rank receives every
rank's copy of its own part and adds them into its fp32 gradient shard (`grad_collective`,
`comm.is_gloo`). The stages differ in memory:

- stage 1: the buckets are views of one persistent flat gradient buffer per group, so stage 1
  holds a full gradient buffer (in the model dtype), as ZeRO-1 does, and allocates nothing per
  step;
- stage 2: bucket buffers are temporary, so the gradients held per rank are the fp32 shard
  plus the buckets in flight.

The reduced part lands in the owner's fp32 master gradient (`FlatParamGroup`): written there
directly by the collective when it is the range's first reduction since the step and no cast is
needed (fp32), else reduced into a temporary and added. Adding, not assigning, makes several
backward passes before one step accumulate correctly.

Buckets are launched in a fixed order (bucket 0, 1, …), never out of order even if a later
bucket happens to fill first: every rank then issues the same collectives in the same order,
which gloo and NCCL require. A bucket whose parameters received no gradient in a backward
(unused parameters) is launched at the end of backward, with zeros for the missing ones, by
`flush()`, which `ZeroOptimizer.backward` and `step` call.

Gradient accumulation (`no_sync`): the hooks do nothing, gradients accumulate in `param.grad`
in the model dtype as in plain torch, and the last micro-step's hooks reduce the accumulated
sum once. That is one reduction per optimizer step (the least communication), at the price of
holding full gradients during accumulation also at stage 2.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from phalanx.amp import fp8_comm
from phalanx.zero import comm
from phalanx.zero.flat_group import FlatParamGroup
from phalanx.zero.partition import Slot, bucket_slots


@dataclass(eq=False)
class _Bucket:
    group: FlatParamGroup
    slots: list[Slot]
    params: list[nn.Parameter]
    lo: int  # flat range [lo, hi) in the group's layout
    hi: int
    buffer: torch.Tensor | None = None
    arrived: set[int] = field(default_factory=set)  # positions in `slots` copied this round
    launched: bool = False
    in_flight: int = 0
    exchange: bool = False  # reduced by an all-to-all (else an all-reduce or a reduce-scatter)

    def view(self, k: int) -> torch.Tensor:
        slot = self.slots[k]
        return self.buffer[slot.offset - self.lo:slot.end - self.lo]

    @property
    def full(self) -> bool:
        return len(self.arrived) == len(self.slots)


GRAD_COLLECTIVES = ("auto", "all_reduce", "reduce_scatter", "all_to_all")


def _largest_part(bucket: _Bucket) -> int:
    return max(hi - lo for lo, hi in bucket.group.layout.split_by_rank(bucket.lo, bucket.hi))


def _exchange_fits(bucket: _Bucket, world_size: int) -> bool:
    """Whether an all-to-all's receive buffer (world × the bucket's largest part) stays within
    twice the bucket. With more than two ranks a bucket that lies mostly in one rank's range
    would make that rank receive world copies of nearly all of it: such buckets are all-reduced
    in place instead (every rank decides alike: the parts are the layout's)."""
    return world_size * _largest_part(bucket) <= 2 * (bucket.hi - bucket.lo)


_SPARE_BUFFERS = 2  # freed bucket (stage 2) and receive buffers kept for the next buckets


@dataclass(eq=False)
class _Pending:
    bucket: _Bucket
    work: object  # a torch.distributed Work, a comm.OwnPartExchange, or None on one rank
    result: torch.Tensor  # this rank's reduced part of the bucket (an exchange: its receive buffer)
    flat_lo: int  # where `result` starts in the group's flat layout
    direct: bool = False  # `result` is already the master gradient's slice: nothing to add
    buffer: torch.Tensor | None = None  # stage 2: the bucket's buffer, reusable once this completes


@dataclass
class ReducerStats:
    """Counts for tests and logs: how many bucket reductions started inside backward (hooks)
    and how many only at its end (flush)."""

    launched_in_backward: int = 0
    launched_at_flush: int = 0


class GradReducer:
    def __init__(self, groups: Sequence[FlatParamGroup], *, stage: int, bucket_numel: int, overlap: bool,
                 process_group: dist.ProcessGroup | None, rank: int, world_size: int,
                 model_order: dict[int, int] | None = None, collective: str = "auto", fp8: str | None = None):
        if stage not in (1, 2):
            raise ValueError(f"stage={stage}: the ZeRO gradient reducer implements stages 1 and 2")
        if collective not in GRAD_COLLECTIVES:
            raise ValueError(f"grad_collective={collective!r}: use one of {', '.join(GRAD_COLLECTIVES)}")
        if collective == "auto":
            collective = "all_to_all" if comm.is_gloo(process_group) else "reduce_scatter"
        self.collective = collective
        self.fp8 = fp8  # "e4m3" / "e5m2": buckets travel as fp8 (phalanx.amp.fp8_comm); None: as they are
        self.fp8_traffic = fp8_comm.Fp8Traffic()
        self.stage = stage
        self.group = process_group
        self.rank = rank
        self.world_size = world_size
        self.overlap = overlap
        self.sync = True
        self.stats = ReducerStats()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._next = 0  # index of the next bucket to launch in this round
        self._persistent: dict[int, torch.Tensor] = {}  # stage 1: id(group) -> flat gradient buffer
        self._spare: list[torch.Tensor] = []  # stage 2: freed bucket buffers, reused (see _release)
        self._spare_received: list[torch.Tensor] = []  # all_to_all: receive buffers, reused
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self.buckets: list[_Bucket] = []
        for g in groups:
            for slots in bucket_slots(g.layout, bucket_numel):
                bucket = _Bucket(g, slots, [g.params[s.index] for s in slots], slots[0].offset, slots[-1].end)
                self.buckets.append(bucket)
        # Launch order = the order backward is expected to fill them: a bucket is full when its
        # earliest parameter (in model order) has its gradient, and backward reaches the
        # earliest parameters last.
        order = model_order or {}
        self.buckets.sort(key=lambda b: -min(order.get(id(p), 0) for p in b.params))
        self._largest_bucket = max((b.hi - b.lo for b in self.buckets), default=0)
        for b in self.buckets:
            b.exchange = self.collective == "all_to_all" and world_size > 1 and _exchange_fits(b, world_size)
        self._largest_exchange = max((world_size * _largest_part(b) for b in self.buckets if b.exchange), default=0)
        for b in self.buckets:
            for k, p in enumerate(b.params):
                self._where[id(p)] = (b, k)
        if overlap:
            for b in self.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._on_grad)

    # ------------------------------------------------------------------ public
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in `param.grad`; reduce on the next synchronised backward."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def flush(self) -> None:
        """End the current round: launch every bucket not launched yet (taking gradients that
        hooks did not deliver from `param.grad`, zeros where there are none)."""
        round_open = self._next > 0 or any(b.arrived for b in self.buckets)
        has_local = any(p.grad is not None for b in self.buckets for p in b.params)
        if not (round_open or has_local):
            return
        for b in self.buckets[self._next:]:
            self._launch(b, from_hook=False)
        self._end_round()

    def finish(self) -> None:
        """Flush and wait for every reduction; afterwards the master gradients are complete."""
        self.flush()
        while self._pending:
            self._complete(self._pending.popleft())

    def discard(self) -> None:
        """Drop gradients in flight (zero_grad): wait for launched collectives — they cannot be
        cancelled — and forget their results and the partial round."""
        while self._pending:
            pending = self._pending.popleft()
            comm.wait(pending.work, self._op_name)
            pending.bucket.in_flight -= 1
            self._release(pending)
        for b in self.buckets:
            b.arrived.clear()
            b.launched = False
            if self.stage == 2:
                b.buffer = None
        self._next = 0

    # ------------------------------------------------------------------ hooks
    @property
    def _op_name(self) -> str:
        return f"zero.{self.collective}_grads"

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.sync or param.grad is None:
            return  # no_sync: the gradient stays in param.grad and accumulates there
        bucket, k = self._where[id(param)]
        if bucket.launched:
            # A new backward began before the previous round ended (it had unused parameters
            # and nobody flushed): close that round first.
            self.flush()
        self._take_grad(bucket, k, param)
        if bucket.full:
            while self._next < len(self.buckets) and self.buckets[self._next].full:
                self._launch(self.buckets[self._next], from_hook=True)
                self._next += 1
            if self._next == len(self.buckets):
                self._end_round()

    # ------------------------------------------------------------------ internals
    def _ensure_buffer(self, bucket: _Bucket) -> None:
        if self.stage == 1:
            # The persistent buffer may still be read by this bucket's previous reduction.
            while bucket.in_flight:
                self._complete(self._pending.popleft())
            if bucket.buffer is None:
                key = id(bucket.group)
                if key not in self._persistent:
                    g = bucket.group
                    self._persistent[key] = torch.zeros(g.layout.numel, dtype=g.dtype, device=g.device)
                bucket.buffer = self._persistent[key][bucket.lo:bucket.hi]
        elif bucket.buffer is None:
            # No zeros needed: the bucket's parameters are adjacent, and each one's range is
            # written whole before the launch (its gradient, or zeros when it got none).
            g = bucket.group
            numel = bucket.hi - bucket.lo
            spare = next((t for t in self._spare if t.dtype == g.dtype and t.device == g.device
                          and t.numel() >= numel), None)
            if spare is not None:
                self._spare.remove(spare)
                bucket.buffer = spare[:numel]
            else:
                bucket.buffer = torch.empty(self._largest_bucket, dtype=g.dtype, device=g.device)[:numel]

    def _take_grad(self, bucket: _Bucket, k: int, param: nn.Parameter) -> None:
        """Move `param.grad`, divided by the world size, into its place in the bucket (adding if
        it is already there). Average, not sum, as DDP does; dividing on the way in (one pass
        instead of a copy and a division) before the reduction keeps fp16 sums of many ranks
        from overflowing."""
        self._ensure_buffer(bucket)
        view, grad = bucket.view(k), param.grad.detach().reshape(-1)
        if k in bucket.arrived:
            view.add_(grad / self.world_size if self.world_size > 1 else grad)
        else:
            if self.world_size > 1:
                torch.div(grad, self.world_size, out=view)
            else:
                view.copy_(grad)
            bucket.arrived.add(k)
        param.grad = None

    def _launch(self, bucket: _Bucket, *, from_hook: bool) -> None:
        for k, p in enumerate(bucket.params):
            if k not in bucket.arrived:
                if p.grad is not None:
                    self._take_grad(bucket, k, p)
                else:
                    self._ensure_buffer(bucket)
                    bucket.view(k).zero_()
        self._ensure_buffer(bucket)
        buffer = bucket.buffer
        g = bucket.group
        parts = g.layout.split_by_rank(bucket.lo, bucket.hi)
        own_lo, own_hi = parts[self.rank]
        direct = False
        if self.world_size == 1:
            work, result = None, buffer[own_lo - bucket.lo:own_hi - bucket.lo]
        elif self.fp8:
            # Each rank's copy of each part travels as fp8 with its own scale; this rank gets the
            # fp32 sum of its part (synchronous: the collectives sit between the quantisations).
            work, result = None, fp8_comm.reduce_scatter_fp8(buffer, [b - a for a, b in parts], self.group,
                                                             self.fp8, self.fp8_traffic)
        elif bucket.exchange:
            # Every rank's copy of the part this rank owns arrives; `_complete` adds them up.
            work = comm.OwnPartExchange(buffer, [b - a for a, b in parts], self.rank, self.group, self._op_name,
                                        receive=lambda numel: self._receive_buffer(numel, buffer))
            result = work.received
        elif self.collective != "reduce_scatter":
            # In place, on the whole bucket; this rank then reads the part it owns. Twice the
            # bytes of a reduce-scatter, but on gloo cheaper than its reduce-scatter (comm.is_gloo);
            # also gloo's choice for a bucket whose all-to-all would not fit (_exchange_fits).
            work = comm.all_reduce_sum(buffer, self.group, self._op_name)
            result = buffer[own_lo - bucket.lo:own_hi - bucket.lo]
        else:
            # Each rank receives only the sum of the part it owns; it lands in the fp32
            # gradient shard directly when it can.
            views = [buffer[a - bucket.lo:b - bucket.lo] for a, b in parts]
            result = g.reduce_target(own_lo, own_hi - own_lo, buffer.dtype)
            direct = result is not None
            if not direct:
                result = torch.empty(own_hi - own_lo, dtype=buffer.dtype, device=buffer.device)
            work = comm.reduce_scatter_uneven(result, views, self.group, self._op_name)
        self._pending.append(_Pending(bucket, work, result, own_lo, direct, buffer if self.stage == 2 else None))
        bucket.in_flight += 1
        bucket.launched = True
        bucket.arrived.clear()
        if self.stage == 2:
            bucket.buffer = None  # the pending reduction keeps it alive until it completes
        if from_hook:
            self.stats.launched_in_backward += 1
        else:
            self.stats.launched_at_flush += 1
        self._harvest()

    def _harvest(self) -> None:
        """Fold in reductions that already finished, without blocking, to free their buffers."""
        while self._pending and (self._pending[0].work is None or self._pending[0].work.is_completed()):
            self._complete(self._pending.popleft())

    def _complete(self, pending: _Pending) -> None:
        comm.wait(pending.work, self._op_name)
        if isinstance(pending.work, comm.OwnPartExchange):
            pending.bucket.group.accumulate_grad(pending.flat_lo, *pending.work.copies())
        elif not pending.direct:
            pending.bucket.group.accumulate_grad(pending.flat_lo, pending.result)
        pending.bucket.in_flight -= 1
        self._release(pending)

    def _release(self, pending: _Pending) -> None:
        """Keep a completed stage-2 bucket buffer for the next bucket (at most _SPARE_BUFFERS):
        on the CPU a fresh bucket-sized tensor costs page faults every time, several copies'
        worth; a GPU's caching allocator does the same reuse by itself."""
        if pending.buffer is not None and len(self._spare) < _SPARE_BUFFERS:
            base = pending.buffer._base if pending.buffer._base is not None else pending.buffer
            self._spare.append(base)
        pending.buffer = None
        if isinstance(pending.work, comm.OwnPartExchange) and len(self._spare_received) < _SPARE_BUFFERS:
            received = pending.result._base if pending.result._base is not None else pending.result
            self._spare_received.append(received)

    def _receive_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """An all-to-all's receive buffer of `numel` elements: a kept one when one is large
        enough (each is sized for the largest exchange, at most twice the largest bucket)."""
        spare = next((t for t in self._spare_received if t.dtype == like.dtype and t.device == like.device
                      and t.numel() >= numel), None)
        if spare is not None:
            self._spare_received.remove(spare)
            return spare[:numel]
        return torch.empty(max(numel, self._largest_exchange), dtype=like.dtype, device=like.device)[:numel]

    def _end_round(self) -> None:
        self._next = 0
        for b in self.buckets:
            b.launched = False
            b.arrived.clear()
