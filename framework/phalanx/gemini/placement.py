"""Placement policies: which chunks live on the device, and what to evict when room runs out.

- `StaticPlacement(offload_param_frac, offload_optim_frac)`: a fixed split decided up front.
  The last `offload_param_frac` of the parameter chunks keep their shard on the host (brought
  to the device only while a module needs them, then sent back); the last `offload_optim_frac`
  of the optimizer chunks (fp32 master, moments, gradient) live on the host and are updated
  there. Nothing is ever evicted: the split must fit, `check_fits` says so before training, and
  each step checks that the chunks plus the traced non-model memory still fit.
- `AutoPlacement`: decides from a trace. The first iteration is a warm-up: shards start on
  the host and stay on the device once used, evicting least-recently-used ones when needed,
  while the memory tracer records the non-model memory of each step. Then it moves as many
  optimizer chunks to the device as fit beside the largest working set, and from then on,
  whenever a chunk needs room, evicts the idle shards needed farthest in the future (Belady's
  rule), keeping the traced non-model memory of the current step free.

Either way, when even the unavoidable working set does not fit, `NotEnoughDeviceMemory`
says how many bytes are missing and which settings would fit.

Below both, the host tier and the disk (`place_optim_on_disk`): with a `host_memory_budget`,
the host must hold the parameter shards that start there, the fp32 gradients of the optimizer
chunks that are not on the device, and the optimizer state kept on the host; with
`offload_to_disk`, optimizer chunks (the last ones in model order first) move to files on disk
until that fits, at the cost of a few read-ahead buffers. `NotEnoughHostMemory` says what is
missing otherwise.
"""
from __future__ import annotations

from typing import Sequence

from phalanx.gemini.chunk import Chunk, ChunkState
from phalanx.gemini.tiers import DEVICE, DISK, HOST

MiB = 2**20


class NotEnoughDeviceMemory(RuntimeError):
    pass


class NotEnoughHostMemory(RuntimeError):
    pass


def _mib(n: int) -> str:
    return f"{n / MiB:.3f} MiB"


def working_set(manager, chunks: Sequence[Chunk]) -> int:
    """Device bytes one module needs at once for these chunks: the gathered parameters, the
    shard brought in to gather from (when it lives on the host) and the gradient buffer."""
    total = 0
    for c in chunks:
        total += c.full_bytes() * (2 if c.trainable else 1)
        if not c.full_is_shard:
            total += c.shard_bytes()
    return total


def min_working_set(manager, module_chunks: dict[str, list[Chunk]]) -> tuple[int, str]:
    best, where = 0, ""
    for name, chunks in module_chunks.items():
        need = working_set(manager, chunks)
        if need > best:
            best, where = need, name
    return best, where


def not_enough(manager, what: str, need: int, suggestions: list[str]) -> NotEnoughDeviceMemory:
    budget = manager.tiers.budget
    return NotEnoughDeviceMemory(
        f"GeminiPlugin: {what} needs {_mib(need)} on the device but the budget is {_mib(budget)}: "
        f"{_mib(need - budget)} missing. Settings that would fit: " + "; ".join(suggestions))


class _Policy:
    name = "policy"

    def __init__(self, tracer=None):
        self.tracer = tracer

    def on_position(self, manager, pos: int) -> None:
        """Keep this step's non-model memory (traced; while tracing, what is live now) free:
        evict idle shards (auto) or fail with the numbers (static, nothing to evict)."""
        if self.tracer is not None:
            reserve = self.tracer.nonmodel_now() if manager.tracing else self.tracer.nonmodel(pos)
            manager.tiers.reserve = reserve
            self.make_room(manager, 0, pos, [])
            manager.tiers.note_reserve(reserve)

    def after_release(self, manager, chunk: Chunk) -> None:
        pass

    def after_warmup(self, manager) -> None:
        pass

    def make_room(self, manager, need: int, pos: int, protect: Sequence[Chunk]) -> None:
        free = manager.tiers.free_device()
        if need <= free:
            return
        victims = self._victims(manager, pos, protect)
        for chunk in victims:
            if need <= manager.tiers.free_device():
                return
            manager.move_shard(chunk, HOST)
            manager.stats["evictions"] += 1
        if need > manager.tiers.free_device():
            tiers = manager.tiers
            total = tiers.bytes[DEVICE] + tiers.reserve + need
            raise not_enough(manager, f"step {pos} of the iteration ({_mib(need)} for its chunks on top of "
                             f"{_mib(tiers.bytes[DEVICE])} of chunks that cannot move and {_mib(tiers.reserve)} of "
                             "traced non-model memory such as activations)", total, self.suggest(manager, total))

    def _victims(self, manager, pos, protect):
        return []

    chunk_size_is_smallest = False  # the plugin's search already took the smallest working set

    def _smaller_chunks(self) -> list[str]:
        return [] if self.chunk_size_is_smallest else ["a smaller chunk_size_mb"]

    def suggest(self, manager, need: int) -> list[str]:
        return [f"device_memory_budget >= {_mib(need)}", *self._smaller_chunks(),
                "a smaller micro-batch or activation checkpointing (less non-model memory)",
                "more data-parallel ranks (shards are 1/N of each chunk)"]


class StaticPlacement(_Policy):
    name = "static"

    def __init__(self, offload_param_frac: float = 0.0, offload_optim_frac: float = 0.0, tracer=None):
        super().__init__(tracer)
        for key, v in (("offload_param_frac", offload_param_frac), ("offload_optim_frac", offload_optim_frac)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{key}={v} must be between 0 and 1")
        self.offload_param_frac = offload_param_frac
        self.offload_optim_frac = offload_optim_frac

    @staticmethod
    def _split(n: int, frac: float) -> list[str]:
        on_host = round(frac * n)
        return [DEVICE] * (n - on_host) + [HOST] * on_host

    def initial_tiers(self, manager) -> tuple[list[str], list[str]]:
        n = len(manager.chunks)
        shard = self._split(n, self.offload_param_frac)
        for c, t in zip(manager.chunks, shard):
            c.home = t
        return shard, self._split(n, self.offload_optim_frac)

    def after_release(self, manager, chunk: Chunk) -> None:
        manager.move_shard(chunk, chunk.home)

    def check_fits(self, manager, module_chunks: dict[str, list[Chunk]]) -> None:
        """Before training: persistent device bytes plus the largest working set must fit."""
        chunks = manager.chunks
        work, where = min_working_set(manager, module_chunks)
        budget = manager.tiers.budget

        def persistent(pf: float, of: float) -> int:
            shards = self._split(len(chunks), pf)
            optim = self._split(len(chunks), of)
            return sum((c.shard_bytes() if st == DEVICE else 0)
                       + (c.optim_bytes() - c.shared_bytes(st, ot) if ot == DEVICE else 0)
                       for c, st, ot in zip(chunks, shards, optim))

        need = persistent(self.offload_param_frac, self.offload_optim_frac) + work
        if need <= budget:
            return
        ideas = []
        for of in (self.offload_optim_frac, 0.25, 0.5, 0.75, 1.0):
            for pf in (self.offload_param_frac, 0.25, 0.5, 0.75, 1.0):
                if of >= self.offload_optim_frac and pf >= self.offload_param_frac and persistent(pf, of) + work <= budget:
                    ideas.append(f"offload_param_frac={pf}, offload_optim_frac={of}")
                    break
            if ideas:
                break
        ideas.append("placement_policy='auto'") if persistent(1.0, 1.0) + work <= budget else None
        ideas += [f"device_memory_budget >= {_mib(need)}"]
        if work > budget and not self.chunk_size_is_smallest:
            ideas.append("a smaller chunk_size_mb (the largest module, "
                         f"{where!r}, needs {_mib(work)} of gathered chunks and gradients)")
        raise not_enough(manager, f"placement 'static' (offload_param_frac={self.offload_param_frac}, "
                         f"offload_optim_frac={self.offload_optim_frac})", need, ideas)


class AutoPlacement(_Policy):
    name = "auto"

    def __init__(self, tracer=None):
        super().__init__(tracer)
        self._last_use: dict[int, int] = {}

    def initial_tiers(self, manager) -> tuple[list[str], list[str]]:
        n = len(manager.chunks)
        return [HOST] * n, [HOST] * n

    def check_fits(self, manager, module_chunks: dict[str, list[Chunk]]) -> None:
        work, where = min_working_set(manager, module_chunks)
        if work > manager.tiers.budget:
            what = f"module {where!r} (its gathered chunks and gradients"
            what += ", with chunk sizes searched down to one parameter per chunk)" if self.chunk_size_is_smallest else ")"
            raise not_enough(manager, what, work,
                             [f"device_memory_budget >= {_mib(work)}", *self._smaller_chunks(),
                              "more data-parallel ranks"])

    def on_position(self, manager, pos: int) -> None:
        for ci in (manager.trace[pos] if pos < len(manager.trace) else []):
            self._last_use[ci] = pos
        super().on_position(manager, pos)

    def _victims(self, manager, pos, protect):
        keep = {id(c) for c in protect}
        idle = [c for c in manager.chunks if id(c) not in keep and c.shard_tier == DEVICE
                and c.state == ChunkState.FREE and not manager.gathered(c)
                and not c.master_is_shard]  # that shard is the master, which stays: nothing freed
        if manager.tracing:  # warm-up: no future known yet, least recently used first
            return sorted(idle, key=lambda c: self._last_use.get(c.index, -1))
        return sorted(idle, key=lambda c: -manager.next_use(c, pos))

    def after_warmup(self, manager) -> None:
        """Move optimizer chunks to the device while they fit beside the peak working set
        (gathered chunks, gradients and traced non-model memory) of the warm-up iteration."""
        peak = self.tracer.peak_working if self.tracer is not None else 0
        if peak > manager.tiers.budget:
            raise not_enough(manager, "the warm-up iteration's peak working set (gathered chunks, gradient buffers "
                             f"and {_mib(max(self.tracer.by_position, default=0))} of non-model memory)", peak,
                             self.suggest(manager, peak))
        room = manager.tiers.budget - peak
        for chunk in manager.chunks:
            # An fp32 chunk's master on the device is its shard there, which then stays for good
            # (evicting it would free nothing): its lasting cost is optim_bytes() either way, of
            # which only optim_move_bytes() is new now when the shard is already on the device.
            if chunk.optim_tier == HOST and chunk.optim_bytes() <= room:
                self.make_room(manager, manager.optim_move_bytes(chunk, DEVICE), 0, [chunk])
                manager.move_optim(chunk, DEVICE)
                room -= chunk.optim_bytes()


# ---------------------------------------------------------------------------- host tier and disk
def host_need(chunks: Sequence[Chunk], shard_tiers: Sequence[str], optim_tiers: Sequence[str],
              disk_depth: int) -> dict[str, int]:
    """Host bytes by kind for this placement: parameter shards that live there, fp32 gradients
    of optimizer chunks not on the device, optimizer state kept there (fp32 master and two
    moments; an fp32 master that is its host shard is counted once, as a shard), and the disk
    tier's `disk_depth + 1` read-ahead buffers (of the largest disk chunk)."""
    out = {"shards": 0, "gradients": 0, "optimizer state": 0, "disk buffers": 0}
    largest_disk = 0
    for c, st, ot in zip(chunks, shard_tiers, optim_tiers, strict=True):
        out["shards"] += c.shard_bytes() if st == HOST else 0
        out["gradients"] += 4 * c.shard_numel if ot != DEVICE else 0
        out["optimizer state"] += 12 * c.shard_numel - c.shared_bytes(st, ot) if ot == HOST else 0
        largest_disk = max(largest_disk, c.shard_numel if ot == DISK else 0)
    out["disk buffers"] = (disk_depth + 1) * 12 * largest_disk
    return out


def place_optim_on_disk(chunks: Sequence[Chunk], shard_tiers: Sequence[str], optim_tiers: Sequence[str], *,
                        host_budget: int | None, offload_to_disk: bool | str, disk_depth: int) -> list[str]:
    """The optimizer tiers with the disk tier applied: `True` puts every host optimizer chunk on
    disk, "auto" the last ones until the host budget holds; then the host budget must hold
    (`NotEnoughHostMemory` otherwise)."""
    tiers = list(optim_tiers)
    if offload_to_disk is True:
        tiers = [DISK if t == HOST else t for t in tiers]
    elif offload_to_disk == "auto" and host_budget is not None:
        for i in reversed(range(len(tiers))):
            if sum(host_need(chunks, shard_tiers, tiers, disk_depth).values()) <= host_budget:
                break
            if tiers[i] == HOST:
                tiers[i] = DISK
    if host_budget is None:
        return tiers
    need = host_need(chunks, shard_tiers, tiers, disk_depth)
    total = sum(need.values())
    if total <= host_budget:
        return tiers
    ideas = [f"host_memory_budget >= {_mib(total)}"]
    all_disk = [DISK if t == HOST else t for t in tiers]
    floor = sum(host_need(chunks, shard_tiers, all_disk, disk_depth).values())
    if offload_to_disk is False and floor <= host_budget:
        ideas.insert(0, "offload_to_disk='auto' (the optimizer state that does not fit goes to files under disk_dir)")
    if need["disk buffers"] and disk_depth > 1:
        ideas.append("a smaller disk_prefetch (fewer read-ahead buffers)")
    ideas += ["a smaller chunk_size_mb (smaller read-ahead buffers)" if need["disk buffers"] else None,
              "more data-parallel ranks (each holds 1/N of every sharded chunk)"]
    parts = ", ".join(f"{_mib(v)} of {k}" for k, v in need.items() if v)
    raise NotEnoughHostMemory(
        f"GeminiPlugin: the host tier needs {_mib(total)} ({parts}) but host_memory_budget is {_mib(host_budget)}: "
        f"{_mib(total - host_budget)} missing. Settings that would fit: " + "; ".join(i for i in ideas if i))
