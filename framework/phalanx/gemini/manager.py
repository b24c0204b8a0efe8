"""The chunk manager: where each chunk's data is, gathering it for compute, reducing gradients.

It owns the chunks and the `MemoryTiers` accounting and offers the operations the hooks call:

- `fetch(chunks)` before a module runs (forward, or backward for the module's weights): bring
  each chunk's shard to the device, all-gather it into a full buffer, point the parameters at it.
  Room on the device is made first by the placement policy (`policy.make_room`), which may
  evict the shards of idle chunks to the host;
- `release(chunk)` after a module's forward: free the gathered buffer (the parameters go back
  to placeholders) and let the policy send the shard home;
- `grad_arrived(param)` from each parameter's post-accumulate-grad hook: add the gradient to
  the chunk's gradient buffer; when all of a chunk's gradients are in, reduce-scatter them
  (averaged over ranks) and add this rank's part to the fp32 gradient of its master shard;
- `finish_backward()` at the end of every backward: reduce the chunks some of whose parameters
  got no gradient, free every gathered buffer. Every chunk is reduced once per backward, so
  all ranks issue the same collectives, and micro-steps of gradient accumulation just add.

Optimizer state on disk (`disk`, a `phalanx.gemini.disk.DiskTier`, when some chunks' optimizer
tier is "disk"): such a chunk's master and moments are files between steps; `optim_state(chunk)`
brings them into memory for code that reads or writes them outside the optimizer step
(checkpoints, EMA), and the optimizer step streams them (`GeminiOptimizer.step`).

`position` counts module steps (fetches) within an iteration; the trace of which chunks each
position needed (recorded in the first iteration) drives prefetching and the auto policy's
"evict what is needed farthest in the future".

Saved tensors (`saved_tensors()`, entered by the hooks around every forward): autograd keeps
what backward needs, and a linear layer keeps a view of its weight (`weight.t()`), i.e. of the
chunk's gathered buffer. Kept as it is, that view would hold every gathered buffer of the
forward until backward, whatever `release` and the budget say. The pack hook keeps a reference
to the chunk and the view's geometry instead, and the unpack hook rebuilds the view on the
buffer gathered again for backward (weights do not change within an iteration).
"""
from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from phalanx.gemini.chunk import Chunk, ChunkState, build_layouts
from phalanx.gemini.tiers import DEVICE, DISK, HOST, MemoryTiers
from phalanx.zero import comm


@dataclass(frozen=True)
class _SavedView:
    """A tensor autograd saved that is a view of a chunk's gathered buffer, without the buffer."""

    chunk: Chunk
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the gathered buffer's


@dataclass(frozen=True)
class _Outer:
    """What an enclosing saved-tensors hook (e.g. the user's) packed."""

    packed: object


class ChunkManager:
    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], *, chunk_numel: int, dp_size: int,
                 dp_rank: int, group: dist.ProcessGroup | None, tiers: MemoryTiers, shard_param_frac: float = 1.0,
                 prefetch: int = 1):
        self.tiers = tiers
        self.group = group
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.chunk_numel = chunk_numel
        self.prefetch = prefetch
        self.policy = None  # set by the plugin (phalanx.gemini.placement)
        self.chunks: list[Chunk] = []
        self.where: dict[int, tuple[Chunk, int]] = {}
        params = [p for _, p in named_params]
        for ci, (idx, layout, sharded) in enumerate(build_layouts([p.numel() for p in params], chunk_numel,
                                                                   dp_size, shard_param_frac)):
            chunk = Chunk(ci, [params[i] for i in idx], [named_params[i][0] for i in idx], layout,
                          params[idx[0]].dtype, dp_rank if sharded else 0, sharded, device=tiers.device)
            for k, p in enumerate(chunk.params):
                self.where[id(p)] = (chunk, k)
            self.chunks.append(chunk)
        self.position = 0
        self.tracing = True  # the first iteration records `trace`
        self.trace: list[list[int]] = []
        self._uses: dict[int, list[int]] = {}
        self.in_backward = False
        self.stats = {"gathers": 0, "prefetched": 0, "evictions": 0, "reductions": 0, "adopted_grads": 0}
        self.tracer = None  # set by the plugin: told of the saved tensors that are not chunk views
        self._by_storage: dict[int, Chunk] = {}  # storage address of a gathered buffer -> its chunk
        self.disk = None  # a DiskTier when some optimizer chunks live on disk (set by the plugin)
        self.gloo = dp_size > 1 and comm.is_gloo(group)

    # ------------------------------------------------------------------ storage
    def materialise(self, shard_tiers: Sequence[str], optim_tiers: Sequence[str], read=None) -> None:
        """Copy the parameters into their chunks' shards and create the fp32 masters and Adam
        moments, each on its tier (an fp32 chunk whose shard and optimizer state share a tier:
        the master is the shard); the parameters become placeholders. A "disk" chunk's master
        and moments are written to its file (`self.disk` must be set), its gradient is on the host.

        `read(name, param, a, b)` (a lazy model, whose parameters are on the meta device): elements
        `[a, b)` of the flattened parameter in fp32 (`phalanx.lazy.flat_reader`); only this rank's
        shard of each chunk is then built, and its master holds the values read, unrounded."""
        if DISK in optim_tiers and self.disk is None:
            raise ValueError("optimizer chunks placed on disk but the manager has no disk tier")
        with torch.no_grad():
            for chunk, st, ot in zip(self.chunks, shard_tiers, optim_tiers):
                if read is None:
                    lo, hi = chunk.layout.rank_range(chunk.rank)
                    flat = torch.zeros(chunk.numel, dtype=chunk.dtype)
                    for slot, p in zip(chunk.layout.slots, chunk.params):
                        flat[slot.offset:slot.end].copy_(p.detach().reshape(-1).cpu())
                    values = flat[lo:hi]
                else:
                    values = self._read_shard(chunk, read)
                chunk.shard = self.tiers.empty(st, chunk.shard_numel, chunk.dtype)
                chunk.shard.copy_(values)
                chunk.shard_tier = st
                chunk.optim_tier = ot
                if ot == DISK:
                    self.disk.create(chunk)
                    with self.disk.loaded(chunk, read=False, write=True):
                        chunk.master.copy_(values)
                        chunk.exp_avg.zero_()
                        chunk.exp_avg_sq.zero_()
                else:
                    if chunk.master_shares_shard(st, ot):  # fp32: the shard holds the values already
                        chunk.master = chunk.shard
                    else:
                        chunk.master = self.tiers.empty(ot, chunk.shard_numel, torch.float32)
                        chunk.master.copy_(values)
                    chunk.exp_avg = self.tiers.empty(ot, chunk.shard_numel, torch.float32, zero=True)
                    chunk.exp_avg_sq = self.tiers.empty(ot, chunk.shard_numel, torch.float32, zero=True)
                chunk.master_grad = self.tiers.empty(HOST if ot == DISK else ot, chunk.shard_numel, torch.float32,
                                                     zero=True)
                chunk.detach()

    def _read_shard(self, chunk: Chunk, read) -> torch.Tensor:
        """This rank's shard of `chunk` in fp32, parameter by parameter from `read`; meta
        parameters become real (placeholder) tensors, the same objects. Every parameter is read,
        with an empty range where this rank holds none of it (a random-init source then frees it)."""
        from phalanx.gemini.chunk import placeholder
        from phalanx.lazy import swap_in

        values = torch.zeros(chunk.shard_numel, dtype=torch.float32)
        owned = {k: (a, b) for k, a, b in chunk.owned()}
        for k, (name, p) in enumerate(zip(chunk.names, chunk.params)):
            a, b = owned.get(k, (0, 0))
            piece = read(name, p, a, b)
            if b > a:
                start = chunk.layout.to_shard(chunk.rank, chunk.layout.slots[k].offset + a)
                values[start:start + (b - a)].copy_(piece)
            if p.is_meta:
                swap_in(p, placeholder(p.shape, chunk.dtype, chunk.device))
        return values

    @contextlib.contextmanager
    def optim_state(self, chunk: Chunk, write: bool = False) -> Iterator[Chunk]:
        """Inside: `chunk.master`, `exp_avg`, `exp_avg_sq` usable wherever the chunk's optimizer
        state lives; a disk chunk's are read from its file, and written back after if `write`."""
        if chunk.optim_tier != DISK:
            yield chunk
            return
        with self.disk.loaded(chunk, read=True, write=write):
            yield chunk

    def move_shard(self, chunk: Chunk, tier: str) -> None:
        """Put the chunk's shard on `tier`. A shard that is its fp32 master leaves the master
        where it is (the shard becomes a copy); one that joins its master there becomes the
        master again (the copy is dropped: the two are equal, `publish` keeps them so)."""
        if chunk.shard_tier == tier:
            return
        if chunk.master_is_shard:
            chunk.shard = self.tiers.copy(chunk.shard, tier)
        elif chunk.master is not None and chunk.master_shares_shard(tier, chunk.optim_tier):
            self.tiers.drop(chunk.shard_tier, chunk.shard)
            chunk.shard = chunk.master
        else:
            chunk.shard = self.tiers.move(chunk.shard, chunk.shard_tier, tier)
        chunk.shard_tier = tier

    def move_optim(self, chunk: Chunk, tier: str) -> None:
        """Put the chunk's optimizer state (master, moments, gradient) on `tier`; a master that is
        the shard is copied (the shard stays), one that joins its shard there becomes it."""
        if chunk.optim_tier == tier:
            return
        if DISK in (chunk.optim_tier, tier):
            raise ValueError("disk-tier optimizer chunks stay on disk (the plugin decides that once, up front)")
        for name in ("exp_avg", "exp_avg_sq", "master_grad"):
            setattr(chunk, name, self.tiers.move(getattr(chunk, name), chunk.optim_tier, tier))
        if chunk.master_is_shard:
            chunk.master = self.tiers.copy(chunk.master, tier)
        elif chunk.master_shares_shard(chunk.shard_tier, tier):
            self.tiers.drop(chunk.optim_tier, chunk.master)
            chunk.master = chunk.shard
        else:
            chunk.master = self.tiers.move(chunk.master, chunk.optim_tier, tier)
        chunk.optim_tier = tier

    def optim_move_bytes(self, chunk: Chunk, tier: str) -> int:
        """Bytes `move_optim(chunk, tier)` adds to `tier` (less when the master becomes the shard)."""
        return chunk.optim_bytes() - chunk.shared_bytes(chunk.shard_tier, tier)

    def gathered(self, chunk: Chunk) -> bool:
        return chunk.full is not None or chunk.pending is not None

    def device_need(self, chunk: Chunk) -> int:
        """Device bytes `fetch` must add for this chunk."""
        if self.gathered(chunk):
            return 0
        brought = chunk.shard_tier == HOST and not (chunk.master is not None
                                                    and chunk.master_shares_shard(DEVICE, chunk.optim_tier))
        need = chunk.shard_bytes() if brought else 0  # an fp32 master on the device becomes the shard
        return need if chunk.full_is_shard else need + chunk.full_bytes()

    # ------------------------------------------------------------------ compute
    def begin_iteration(self) -> None:
        """A forward of the root module starts (not a recompute inside backward)."""
        if self.in_backward:
            return
        self.end_iteration(close_trace=False)
        if self.tracing:
            self.trace.clear()

    def begin_step(self, chunks: Sequence[Chunk]) -> int:
        """Record a module step (a fetch) at the current position; returns that position."""
        pos = self.position
        self.position += 1
        if self.tracing:
            self.trace.append([c.index for c in chunks])
        self.policy.on_position(self, pos)
        return pos

    def fetch(self, chunks: Sequence[Chunk], *, hold_user: bool = True, step: bool = True) -> None:
        """Gather `chunks` for compute. `step=False` gathers outside the traced sequence of
        steps (the root-held chunks), so that positions keep meaning the same module steps."""
        pos = self.begin_step(chunks) if step else self.position
        for chunk in chunks:
            self._gather(chunk, pos, protect=chunks)
            chunk.state = ChunkState.COMPUTE
            if hold_user:
                chunk.users += 1
        if step:
            self._prefetch(pos, protect=chunks)

    def _gather(self, chunk: Chunk, pos: int, protect: Sequence[Chunk]) -> None:
        if chunk.pending is not None:
            works, full = chunk.pending
            self._wait(works, "gemini.prefetch")
            chunk.pending = None
            chunk.full = full
            self._attach(chunk)
            return
        if chunk.full is not None:
            return
        self.policy.make_room(self, self.device_need(chunk), pos, protect)
        self.move_shard(chunk, DEVICE)
        if chunk.full_is_shard:
            chunk.full = chunk.shard
        else:
            full = self.tiers.empty(DEVICE, chunk.numel, chunk.dtype)
            self._wait(self._start_gather(full, chunk.shard, chunk.rank, "gemini.all_gather"), "gemini.all_gather")
            chunk.full = full
        self.stats["gathers"] += 1
        self._attach(chunk)

    def _start_gather(self, full: torch.Tensor, shard: torch.Tensor, rank: int, name: str) -> list:
        """Start filling `full` with every rank's equal `shard`; returns the work handles. On gloo
        each rank broadcasts its shard straight into its slice of `full`
        (`phalanx.zero.comm.start_broadcast_into_place`): gloo's all-gather into one tensor stages
        the whole output in a temporary of its own (measured: +128 MiB resident for a 128 MiB
        gather; the broadcasts add nothing, and are faster there, `phalanx.zero.comm.is_gloo`)."""
        if not self.gloo:
            return [comm.all_gather_into(full, shard, self.group, name)]
        ranges = comm.equal_ranges(shard.numel(), self.dp_size)
        return comm.start_broadcast_into_place(full, ranges, shard, rank, self.group, name)

    @staticmethod
    def _wait(works: list, name: str) -> None:
        for work in works:
            comm.wait(work, name)

    def _attach(self, chunk: Chunk) -> None:
        chunk.attach()
        self._by_storage[chunk.full.untyped_storage().data_ptr()] = chunk

    def _prefetch(self, pos: int, protect: Sequence[Chunk]) -> None:
        """Start the all-gathers of the next position's sharded chunks (from the trace), when
        they fit without evicting anything; the same decision on every rank (same trace, same
        accounting), so the collectives line up."""
        if self.tracing or not self.prefetch or pos + 1 >= len(self.trace):
            return
        for ci in self.trace[pos + 1]:
            chunk = self.chunks[ci]
            if chunk.full_is_shard or self.gathered(chunk) or chunk.shard_tier != DEVICE:
                continue
            if self.tiers.free_device() < chunk.full_bytes():
                return
            full = self.tiers.empty(DEVICE, chunk.numel, chunk.dtype)
            chunk.pending = (self._start_gather(full, chunk.shard, chunk.rank, "gemini.prefetch"), full)
            self.stats["gathers"] += 1
            self.stats["prefetched"] += 1

    def release(self, chunk: Chunk) -> None:
        """After a module's forward: free the gathered buffer when nobody else uses it."""
        chunk.users = max(0, chunk.users - 1)
        if chunk.users:
            return
        chunk.state = ChunkState.HOLD
        if not self.in_backward:  # in backward, gradients arriving release the chunk
            self.free_full(chunk)

    def free_full(self, chunk: Chunk) -> None:
        if chunk.pending is not None:
            works, full = chunk.pending
            self._wait(works, "gemini.prefetch")
            chunk.pending, chunk.full = None, full
        if chunk.full is None:
            return
        if not chunk.full_is_shard:
            self.tiers.drop(DEVICE, chunk.full)
        self._by_storage.pop(chunk.full.untyped_storage().data_ptr(), None)
        chunk.detach()
        chunk.full = None
        chunk.state = ChunkState.FREE
        chunk.users = 0
        self.policy.after_release(self, chunk)

    def next_use(self, chunk: Chunk, pos: int) -> int:
        """The next position (after `pos`, wrapping into the next iteration) that needs `chunk`."""
        uses = self._uses.get(chunk.index)
        if not uses:
            return 1 << 60
        i = bisect.bisect_right(uses, pos)
        return uses[i] if i < len(uses) else uses[0] + len(self.trace)

    def end_trace(self) -> None:
        self.tracing = False
        self._uses = {}
        for pos, cis in enumerate(self.trace):
            for ci in cis:
                self._uses.setdefault(ci, []).append(pos)

    # ------------------------------------------------------------------ saved tensors
    def saved_tensors(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensors hooks for one forward (see the module docstring); a hook already
        active outside (e.g. the user's `save_on_cpu`) still handles every other tensor."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, outer),
                                                        lambda x: self._unpack(x, outer))

    def _pack(self, t: torch.Tensor, outer):
        chunk = None
        if t.device.type != "meta":
            try:
                chunk = self._by_storage.get(t.untyped_storage().data_ptr())
            except RuntimeError:  # a tensor without storage (e.g. a wrapper subclass)
                chunk = None
        if chunk is not None and chunk.full is not None and t.dtype == chunk.full.dtype:
            return _SavedView(chunk, tuple(t.size()), tuple(t.stride()),
                              t.storage_offset() - chunk.full.storage_offset())
        if self.tracer is not None:
            self.tracer.saw(t)
        return _Outer(outer[0](t)) if outer is not None else t

    def _unpack(self, packed, outer) -> torch.Tensor:
        if isinstance(packed, _SavedView):
            chunk = packed.chunk
            if chunk.full is None:  # normally gathered by the module's backward pre-hook already
                self.fetch([chunk], hold_user=False, step=False)
            full = chunk.full
            return full.as_strided(packed.size, packed.stride, full.storage_offset() + packed.offset)
        if isinstance(packed, _Outer):
            return outer[1](packed.packed)
        return packed

    # ------------------------------------------------------------------ gradients
    def grad_arrived(self, param: nn.Parameter) -> None:
        chunk, k = self.where[id(param)]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if chunk.full is None:
            raise RuntimeError(
                f"GeminiPlugin: parameter {chunk.names[k]!r} was used outside the forward of the module that owns "
                "it while its chunk was not gathered, so this step computed with a placeholder. Call the module "
                "instead of reading its weight, or use a plugin that keeps whole parameters (DDPPlugin, ZeroPlugin)")
        slot = chunk.layout.slots[k]
        if chunk.grad_full is None:
            self.policy.make_room(self, chunk.full_bytes(), self.position, [chunk])
            if self._adoptable(chunk, slot, grad):  # a chunk of one parameter: its gradient is the buffer
                chunk.grad_full = self.tiers.adopt(DEVICE, grad.detach().view(-1))
                self.stats["adopted_grads"] += 1
            else:
                chunk.grad_full = self.tiers.empty(DEVICE, chunk.numel, chunk.dtype, zero=True)
                chunk.grad_full[slot.offset:slot.end].add_(grad.detach().reshape(-1).to(chunk.grad_full))
        else:
            chunk.grad_full[slot.offset:slot.end].add_(grad.detach().reshape(-1).to(chunk.grad_full))
        del grad  # not kept through the reduction below
        chunk.arrived.add(k)
        chunk.state = ChunkState.HOLD_AFTER_BWD
        expected = {i for i in chunk.trainable if i in chunk.used}
        if expected <= chunk.arrived:
            chunk.state = ChunkState.READY_FOR_REDUCE
            self.reduce(chunk)

    def _adoptable(self, chunk: Chunk, slot, grad: torch.Tensor) -> bool:
        """Whether autograd's gradient can serve as the chunk's gradient buffer as it is: the
        parameter fills the chunk (no padding), and the gradient is a dense, contiguous tensor of
        the chunk's dtype on the device with a storage of its own (autograd's accumulated `.grad`
        is never shared: it steals an unshared incoming gradient or clones it). Saves a chunk-sized
        buffer and a copy; the embedding and LM head are such chunks."""
        return (slot.offset == 0 and slot.numel == chunk.numel and grad.dtype == chunk.dtype
                and grad.layout == torch.strided and grad.is_contiguous() and grad.device == chunk.full.device
                and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size())

    def reduce(self, chunk: Chunk) -> None:
        """Average the chunk's gradient over the ranks, add this rank's part (fp32) to the
        master gradient, free the gradient and parameter buffers."""
        if chunk.reduced:
            return
        chunk.reduced = True
        if chunk.trainable:
            grad = chunk.grad_full
            if grad is None:
                self.policy.make_room(self, chunk.full_bytes(), self.position, [chunk])
                grad = chunk.grad_full = self.tiers.empty(DEVICE, chunk.numel, chunk.dtype, zero=True)
            if self.dp_size > 1:
                grad.div_(self.dp_size)
                if chunk.sharded and self.gloo:
                    # gloo's reduce-scatter copies its whole input first (+1 chunk resident); an
                    # in-place all-reduce adds nothing, and this rank keeps its slice
                    comm.wait(comm.all_reduce_sum(grad, self.group, "gemini.all_reduce"), "gemini.all_reduce")
                    lo, hi = chunk.layout.rank_range(chunk.rank)
                    part = grad[lo:hi]
                elif chunk.sharded:
                    parts = list(grad.chunk(chunk.world))
                    part = torch.empty_like(parts[0])
                    comm.wait(comm.reduce_scatter_uneven(part, parts, self.group, "gemini.reduce_scatter"),
                              "gemini.reduce_scatter")
                else:
                    comm.wait(comm.all_reduce_sum(grad, self.group, "gemini.all_reduce"), "gemini.all_reduce")
                    part = grad
            else:
                part = grad
            chunk.master_grad.add_(part.to(chunk.master_grad.device).float())
            self.stats["reductions"] += 1
        self.tiers.drop(DEVICE, chunk.grad_full)
        chunk.grad_full = None
        chunk.arrived.clear()
        self.free_full(chunk)

    def start_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """End of a backward: reduce what is left (in chunk order, on every rank), free all."""
        for chunk in self.chunks:
            self.reduce(chunk)
        for chunk in self.chunks:
            chunk.reduced = False
            chunk.used.clear()
        self.in_backward = False
        self.end_iteration()

    def end_iteration(self, close_trace: bool = True, keep: Sequence[Chunk] = ()) -> None:
        """Free anything still gathered (e.g. after an evaluation forward) except `keep`; after
        the first backward, end the trace and let the policy plan."""
        for chunk in self.chunks:
            if chunk not in keep:
                self.free_full(chunk)
        if close_trace and self.tracing and self.trace:
            self.end_trace()
            self.policy.after_warmup(self)
        self.position = 0

    # ------------------------------------------------------------------ whole values
    def gather_master(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's full fp32 master values on the CPU (a collective for sharded chunks)."""
        with self.optim_state(chunk):
            shard = chunk.master.detach().to(self.tiers.device, copy=chunk.optim_tier == DISK)  # outlives the buffer
        if not chunk.sharded:
            return shard.cpu()
        full = torch.empty(chunk.numel, dtype=torch.float32, device=self.tiers.device)
        self._wait(self._start_gather(full, shard, chunk.rank, "gemini.gather_master"), "gemini.gather_master")
        return full.cpu()

    def gather_master_param(self, chunk: Chunk, k: int) -> torch.Tensor:
        """Parameter `k` of `chunk`: its full fp32 master values on the CPU, flat. A collective for a
        sharded chunk: each rank that owns part of the parameter broadcasts that part straight into
        its place, so a streamed save holds one parameter, not its chunk. A disk chunk's file is
        read once while its parameters are gathered one after another (`_saved_master`)."""
        slot = chunk.layout.slots[k]
        full = torch.empty(slot.numel, dtype=torch.float32, device=self.tiers.device)
        if not chunk.sharded:
            return full.copy_(self._saved_master(chunk)[slot.offset:slot.end]).cpu()
        ranges = [(a - slot.offset, b - slot.offset) for a, b in chunk.layout.split_by_rank(slot.offset, slot.end)]
        a, b = ranges[chunk.rank]
        lo = chunk.layout.rank_range(chunk.rank)[0] - slot.offset
        # a disk chunk's master is read from its file only by a rank that owns part of the parameter
        mine = self._saved_master(chunk).detach()[a - lo:b - lo] if a < b else None
        return comm.assemble_from_owners(full, ranges, mine, chunk.rank, self.group, "gemini.gather_master").cpu()

    def _saved_master(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's fp32 master shard, to read from right away (before any other disk-tier
        operation). A disk chunk's is read from its file once and kept in one of the disk tier's
        read-ahead buffers while further parameters of the same chunk are asked for
        (`DiskTier.held`): a save reads each file once, not once per parameter, and holds one
        chunk's state at a time in a buffer that exists anyway."""
        if chunk.optim_tier != DISK:
            return chunk.master
        return self.disk.held(chunk)[0]

    def load_values(self, values: dict[int, torch.Tensor]) -> None:
        """Set masters and shards from full parameter values keyed by position `(chunk, k)`."""
        with torch.no_grad():
            for chunk in self.chunks:
                owned = [(k, a, b) for k, a, b in chunk.owned() if id(chunk.params[k]) in values]
                if not owned:
                    continue
                with self.optim_state(chunk, write=True):
                    for k, a, b in owned:
                        start = chunk.layout.to_shard(chunk.rank, chunk.layout.slots[k].offset + a)
                        piece = values[id(chunk.params[k])].detach().reshape(-1)[a:b].float()
                        chunk.master[start:start + (b - a)].copy_(piece)
                        if not chunk.master_is_shard:
                            chunk.shard[start:start + (b - a)].copy_(piece.to(chunk.dtype))

    def publish(self, chunk: Chunk) -> None:
        """Copy the updated fp32 master into the compute-dtype shard (the master must be in
        memory: inside `optim_state` for a disk chunk). Nothing to do where the master is the shard."""
        if chunk.master_is_shard:
            return
        with torch.no_grad():
            chunk.shard.copy_(chunk.master.to(chunk.shard.device))
