"""FSDP2's two collectives, replaced on gloo by the ones gloo runs fast, and overlapped with backward.

FSDP2 all-gathers each block's parameters (`all_gather_single`) and reduce-scatters its gradients
(`reduce_scatter_single`). On gloo both are slow next to their alternatives (84 MB fp32, wall ms,
2 ranks, `bench/collectives.py`, `zero.comm.is_gloo`): reduce_scatter 144 against an all-to-all
with the copies of its own slice added by each rank 57, or an all_reduce 103; all_gather 131
against one broadcast per rank, 29 in all. The ZeRO plugin already reduces and publishes that way; these classes give
FSDP2 the same through its public hooks (`set_custom_reduce_scatter`, `set_custom_all_gather`).
NCCL keeps FSDP2's own collectives: there the real ones are the fast ones.

The all-to-all moves the bytes of a reduce-scatter (half an all-reduce's) but needs a receive
buffer as large as the block's gradient input while it runs (so the root, reduced last, at the
memory peak, all-reduces in place); `FSDPPlugin(grad_collective=
"all_reduce")` gives the in-place all-reduce (no extra buffer, twice the bytes), "reduce_scatter"
FSDP2's own collectives.

**Gradient reduction runs in gloo's thread while backward goes on** (as DDP's bucketed all-reduce
does). On CPU, FSDP2 has no streams: it calls the reduce-scatter and reads its output at once. But
in fp32 and bf16 (reduce dtype fp32, op AVG, no post-division, no dtype cast) the sharded gradient
it makes is a *view* of the reduce output, written nowhere else until the optimizer reads it. So
`GlooReduceScatter` starts the exchange asynchronously and defers writing this rank's result into
that output to `PendingReduces.finish`, which runs at the end of backward (an autograd final
callback queued by the first deferred reduce, and the root module's reduce, which FSDP2 runs last,
in its own final callback) and, as a guard, before the optimizer step. Where FSDP2 would read the
output at once it runs synchronously: another op (fp16's SUM with its own division), gradients that
accumulate into existing sharded gradients (no `zero_grad` / `set_to_none=False` between backwards),
a reduce dtype other than the parameters' dtype.

The all-gather returns a work handle (`_Works`, the broadcasts still in flight), which FSDP2 waits
on only when it copies the result out, so a gather FSDP2 prefetches runs in gloo's thread while
the current block computes: its backward prefetch of the next block in reverse order, and the
forward prefetch `FSDPPlugin(forward_prefetch=True)` sets up (each block prefetching the next).
The forward prefetch was measured slower in session 6 (large bench model, EPYC, when each block's
reduce still ran on the compute thread: its gathers competed with backward's); with the reduces
deferred and exchanged it is faster on both bench models (docs/zero.md, session 11).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from phalanx.zero.comm import OwnPartExchange, equal_ranges, is_gloo, start_broadcast_into_place, sum_into

# ReduceOps that all_reduce on gloo applies exactly as reduce_scatter would (FSDP2 asks for AVG in
# fp32/bf16 and SUM with its own pre/post division in fp16).
_PLAIN_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class PendingReduces:
    """The gradient reductions started during one backward whose results are still to be written
    into FSDP2's outputs.

    Each holds its block's full-size gradient input (and, for an all-to-all, the full-size receive
    buffer) until it is finished, so at most `max_in_flight` stay pending: adding one more finishes
    the oldest. With 1 (default) a block's reduce runs while the next block's backward computes;
    unbounded, the inputs of every block piled up until the end of backward (8 x 44 MiB at 158M
    parameters, 16 x 177 MiB at 873.5M: docs/plan.md)."""

    def __init__(self, max_in_flight: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight}: at least 1 reduce must be allowed in flight")
        self.max_in_flight = max_in_flight
        self._items: list[_Reduction] = []
        self._callback_queued = False

    def add(self, reduction: "_Reduction") -> None:
        self._items.append(reduction)
        while len(self._items) > self.max_in_flight:
            self._items.pop(0).finish()
        if not self._callback_queued and torch._C._current_graph_task_id() != -1:
            # Inside backward: finish when the autograd engine does (after FSDP2's own final callback).
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True

    def __bool__(self) -> bool:
        return bool(self._items)

    def finish(self) -> None:
        """Wait for every pending reduction and write this rank's result into FSDP2's output."""
        items, self._items, self._callback_queued = self._items, [], False
        for item in items:
            item.finish()


class _Reduction:
    """One started reduction of a full-size gradient buffer whose sum (or mean) over ranks of this
    rank's slice goes to `output`. All-reduce: in place, then the slice is copied out. All-to-all:
    each rank receives every other rank's copy of its own slice and adds them to its own
    (`zero.comm.OwnPartExchange`): the bytes of a reduce-scatter at the speed of gloo's
    all-to-all (`zero.comm.is_gloo`). The copies may travel in a lower precision than `output`
    (the compute dtype the gradients were made in: `GlooReduceScatter`); they are added in
    `output`'s dtype."""

    def __init__(self, output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, op,
                 exchange: str) -> None:
        # `full` is kept referenced until `finish`: gloo reads it while the exchange runs
        self.output, self.full, self.op, self.exchange = output, full, op, exchange
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if exchange == "all_to_all":
            sizes = [full.numel() // self.world] * self.world
            self.work = OwnPartExchange(full.view(-1), sizes, self.rank, group, "fsdp.reduce_scatter")
        else:
            self.work = dist.all_reduce(full, op=op, group=group, async_op=True)

    def finish(self) -> None:
        self.work.wait()
        out = self.output.view(-1)
        if self.exchange != "all_to_all":
            out.copy_(self.full.view(self.world, -1)[self.rank])
        else:
            sum_into(out, self.work.copies(), widen=True)  # bf16 copies are added in the fp32 output
            if self.op == dist.ReduceOp.AVG:
                out.div_(self.world)
        self.full = self.work = None


GLOO_EXCHANGES = ("all_to_all", "all_reduce")


class GlooReduceScatter(DefaultReduceScatter):
    """Reduce-scatter on gloo without gloo's slow reduce-scatter: an all-to-all of the (already
    full-size, temporary) input whose parts each rank then adds up (default), or an in-place
    all-reduce whose slice is copied out (`exchange="all_reduce"`, twice the bytes). The same
    result; the all-to-all needs one more buffer, the receive buffer, while it runs.
    With `pending` (and `module`, the FSDP module whose gradients it reduces) the reduction is
    left running where that is safe (module docstring); `drain=True` (the root, reduced last)
    finishes everything pending after its own reduce.

    `exchange_dtype` (mixed precision, the compute dtype): FSDP2 casts the block's gradients,
    made in the compute dtype, up to the fp32 reduce dtype to build the reduce-scatter input; here
    the input is allocated in the compute dtype instead (`allocate`), so the gradients are copied
    into it unchanged and the all-to-all moves half the bytes; each rank adds the copies of its
    slice in fp32 into the fp32 output. Every value is exactly what an fp32 exchange would carry
    (a bf16 gradient widened to fp32 is the same number), so the result is bit-identical to
    reducing in fp32, and the root, whose in-place all-reduce would add in the compute dtype,
    exchanges by all-to-all too (its input plus receive buffer, 2 + 1 bytes per element on two
    ranks, 2 + 2 on more, is at most the fp32 input's 4). The input stays fp32 whenever the
    gradients may not be in the compute dtype: after a backward without gradient sync (FSDP2 then
    accumulates them in fp32: `accumulating`), with a custom divide factor, or summed
    reductions."""

    def __init__(self, pending: PendingReduces | None = None, module: FSDPModule | None = None,
                 drain: bool = False, exchange: str = "all_to_all", exchange_dtype: torch.dtype | None = None,
                 world: int = 1) -> None:
        super().__init__()
        if exchange not in GLOO_EXCHANGES:
            raise ValueError(f"exchange={exchange!r}: use one of {', '.join(GLOO_EXCHANGES)}")
        self.pending, self.module, self.drain, self.exchange = pending, module, drain, exchange
        self.exchange_dtype, self.world = exchange_dtype, world
        # gradient sync was switched off since the last reduce: it may get fp32 accumulated gradients
        self.accumulating = False
        self._input_numel: int | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2 allocates the reduce-scatter input (world x the output's size), then the output."""
        numel = math.prod(size)
        if self._input_numel is not None and numel * self.world == self._input_numel:
            self._input_numel = None  # the output: the reduce dtype FSDP2 asks for
            return torch.empty(*size, dtype=dtype, device=device)
        self._input_numel = numel
        return torch.empty(*size, dtype=self._input_dtype(dtype), device=device)

    def _input_dtype(self, reduce_dtype: torch.dtype) -> torch.dtype:
        if self.exchange_dtype is None or self.accumulating or self.module is None:
            return reduce_dtype
        groups = _param_groups(self.module)
        if any(g.gradient_divide_factor is not None or g.force_sum_reduction_for_comms for g in groups):
            return reduce_dtype
        return self.exchange_dtype

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        self.accumulating = False  # FSDP2 hands every accumulated gradient to this reduce
        if op not in _PLAIN_OPS:  # PREMUL_SUM and friends: gloo's own reduce-scatter knows them
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        # a low-precision input is summed after the exchange, in the output's dtype: never all-reduced
        exchange = "all_to_all" if input_tensor.dtype != output_tensor.dtype else self.exchange
        reduction = _Reduction(output_tensor, input_tensor, group, op, exchange)
        if self.pending is not None and not self.drain and self._can_defer(output_tensor, op):
            self.pending.add(reduction)
            return None
        reduction.finish()
        if self.drain and self.pending:
            self.pending.finish()
        return None

    def _can_defer(self, output: torch.Tensor, op) -> bool:
        """FSDP2 only views the output (no division, cast or accumulation) in this case."""
        if op != dist.ReduceOp.AVG or self.module is None:
            return False
        params = [p for g in _param_groups(self.module) for p in g.fsdp_params]
        return bool(params) and all(p.sharded_param.grad is None and p.sharded_param.dtype == output.dtype
                                    for p in params)


def _param_groups(module: FSDPModule) -> list:
    state = module._get_fsdp_state()
    return list(getattr(state, "_fsdp_param_groups", None) or [])


class _Works(dist.Work):
    """Several collectives' handles as one: FSDP2 waits on a `dist.Work` before it reads an
    all-gather's output (`foreach_all_gather_copy_out`)."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        return True


class BroadcastAllGather(DefaultAllGather):
    """All-gather as one broadcast per rank of its shard into its slot of the output (the output
    is the ranks' shards back to back, as `all_gather_single` lays them out), by the helper ZeRO
    and Gemini use too (`phalanx.zero.comm.start_broadcast_into_place`). Returns the broadcasts'
    handles unwaited, whatever `async_op` says: FSDP2 waits on them before it reads the output, so
    a prefetched block's gather overlaps the current block's compute."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ranges = equal_ranges(input_tensor.numel(), world)
        return _Works(start_broadcast_into_place(output_tensor.view(-1), ranges, input_tensor.view(-1), rank, group,
                                                 "fsdp.all_gather"))


def use_gloo_collectives(modules: list[FSDPModule], group: dist.ProcessGroup,
                         overlap_reduce: bool = True, exchange: str = "all_to_all",
                         exchange_dtype: torch.dtype | None = None) -> PendingReduces | None:
    """Give every FSDP module the gloo-fast collectives when `group` runs on gloo. `modules` ends
    with the root. `exchange_dtype`: the compute dtype of a mixed-precision model, in which the
    all-to-all carries the gradients (`GlooReduceScatter`). Returns the pending-reduce set the
    optimizer must finish before it reads gradients (None when `group` is not gloo or has one
    rank)."""
    if not is_gloo(group) or dist.get_world_size(group) < 2:
        return None
    pending = PendingReduces() if overlap_reduce else None
    world = dist.get_world_size(group)
    low = exchange_dtype if exchange == "all_to_all" else None  # an all-reduce would add in that dtype
    reducers: dict[FSDPModule, GlooReduceScatter] = {}
    for i, module in enumerate(modules):
        is_root = i == len(modules) - 1
        # The root's reduce (embeddings and LM head, the largest, at the end of backward where memory
        # peaks) is an in-place all-reduce when its input is fp32: an all-to-all's receive buffer
        # there would add half to all of the root's fp32 gradient to the peak (+241 MiB per rank at
        # 158M parameters, vocabulary 32000). A compute-dtype input goes by all-to-all (it must be
        # added in fp32), whose input and receive buffer are no larger than the fp32 input.
        own = "all_reduce" if is_root and len(modules) > 1 else exchange
        reducer = GlooReduceScatter(pending, module, drain=is_root, exchange=own, exchange_dtype=low, world=world)
        module.set_custom_reduce_scatter(reducer)
        module.set_custom_all_gather(BroadcastAllGather())
        reducers[module] = reducer
    if low is not None:
        for module in modules:
            _tell_when_sync_is_off(module, reducers)
    return pending


def _tell_when_sync_is_off(module: FSDPModule, reducers: dict) -> None:
    """Wrap `module.set_requires_gradient_sync` so that switching sync off marks the reducers it
    reaches as accumulating: FSDP2 then keeps the unsynced gradients in fp32 (its reduce dtype),
    and the next reduce must take them in an fp32 input (`GlooReduceScatter`)."""
    original = module.set_requires_gradient_sync

    def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        if not requires_gradient_sync:
            for sub in (module.modules() if recurse else [module]):
                if sub in reducers:
                    reducers[sub].accumulating = True
        original(requires_gradient_sync, recurse=recurse)

    module.set_requires_gradient_sync = set_requires_gradient_sync
