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
"""
from __future__ import annotations

from typing import Sequence

from phalanx.gemini.chunk import Chunk, ChunkState
from phalanx.gemini.tiers import DEVICE, HOST

MiB = 2**20


class NotEnoughDeviceMemory(RuntimeError):
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

    def suggest(self, manager, need: int) -> list[str]:
        return [f"device_memory_budget >= {_mib(need)}", "a smaller chunk_size_mb",
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
            return (sum(c.shard_bytes() for c, t in zip(chunks, shards) if t == DEVICE)
                    + sum(c.optim_bytes() for c, t in zip(chunks, optim) if t == DEVICE))

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
        if work > budget:
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
            raise not_enough(manager, f"module {where!r} (its gathered chunks and gradients)", work,
                             [f"device_memory_budget >= {_mib(work)}", "a smaller chunk_size_mb",
                              "more data-parallel ranks"])

    def on_position(self, manager, pos: int) -> None:
        for ci in (manager.trace[pos] if pos < len(manager.trace) else []):
            self._last_use[ci] = pos
        super().on_position(manager, pos)

    def _victims(self, manager, pos, protect):
        keep = {id(c) for c in protect}
        idle = [c for c in manager.chunks if id(c) not in keep and c.shard_tier == DEVICE
                and c.state == ChunkState.FREE and not manager.gathered(c)]
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
            if chunk.optim_tier == HOST and chunk.optim_bytes() <= room:
                self.make_room(manager, chunk.optim_bytes(), 0, [])
                manager.move_optim(chunk, DEVICE)
                room -= chunk.optim_bytes()
